"""Rerank against a real router and engine (CPU): the scores equal the judge's
P(yes) / (P(yes) + P(no)) that transformers computes on Qwen3-Reranker's
prompt, the results are sorted and cut, the four paths answer alike, errors
name their field in each route's shape, and a model started without
--reranking refuses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.support.server import Server, running_server

pytestmark = pytest.mark.slow

PATHS = ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")
QUERY = "What is a panda?"
DOCUMENTS = [
    "hi",
    "it is a bear",
    "The giant panda (Ailuropoda melanoleuca) is a bear species endemic to China.",
    "Paris is the capital of France.",
    "Pandas eat bamboo almost exclusively.",
]
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# Qwen3-Reranker's model card.
CARD_PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on '
               'the Query and the Instruct provided. Note that the answer can only be "yes" or '
               '"no".<|im_end|>\n<|im_start|>user\n')
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"

Reference = Callable[..., tuple[list[float], int]]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir: Path) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("rerank")
    preset = root / "models.ini"
    preset.write_text(f"[judge]\nmodel = {tiny_qwen3_dir}\nreranking = true\n\n"
                      f"[plain]\nmodel = {tiny_qwen3_dir}\n")
    args = ["--models-preset", str(preset), "--models-max", "1", "--threads", "1",
            "--max-concurrency", "4"]
    with running_server(args, root / "router.log") as running:
        yield running


@pytest.fixture(scope="module")
def reference(tiny_qwen3_dir: Path) -> Reference:
    """The model card's scoring with transformers, float32: the scores of the
    documents and the prompts' token count."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    prefix = tokenizer.encode(CARD_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(CARD_SUFFIX, add_special_tokens=False)
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")

    @torch.inference_mode()
    def score(query: str, documents: list[str], instruction: str = DEFAULT_INSTRUCTION
              ) -> tuple[list[float], int]:
        scores, tokens = [], 0
        for document in documents:
            pair = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
            ids = prefix + tokenizer(pair)["input_ids"] + suffix
            tokens += len(ids)
            last = model(torch.tensor([ids])).logits[0, -1].float()
            judged = torch.log_softmax(torch.stack([last[no], last[yes]]), dim=0)
            scores.append(float(judged[1].exp()))
        return scores, tokens

    return score


def rerank(server: Server, path: str = "/v1/rerank", **body: object) -> dict:
    reply = server.post(path, json={"model": "judge", "query": QUERY, "documents": DOCUMENTS,
                                    **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_scores_are_the_judges_yes_probability(server: Server, reference: Reference) -> None:
    expected, tokens = reference(QUERY, DOCUMENTS)
    body = rerank(server)
    assert body["model"] == "judge" and body["object"] == "list"
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    results = body["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
    for result in results:
        assert set(result) == {"index", "relevance_score"}
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-4)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: expected[i], reverse=True)
    assert [r["index"] for r in results] == order
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) > 1


def test_an_instruction_replaces_the_default_task(server: Server, reference: Reference) -> None:
    instruction = "Given an animal, retrieve facts about what it eats"
    expected, _ = reference(QUERY, DOCUMENTS, instruction)
    results = rerank(server, instruction=instruction)["results"]
    for result in results:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-4)
    default, _ = reference(QUERY, DOCUMENTS)
    assert max(abs(a - b) for a, b in zip(expected, default, strict=True)) > 1e-4


def test_top_n_and_documents_as_objects(server: Server) -> None:
    whole = rerank(server)["results"]
    objects = [{"text": document} for document in DOCUMENTS]
    cut = rerank(server, documents=objects, top_n=2, return_documents=True)["results"]
    assert [r["index"] for r in cut] == [r["index"] for r in whole[:2]]
    for result in cut:
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
        match = next(r for r in whole if r["index"] == result["index"])
        assert result["relevance_score"] == pytest.approx(match["relevance_score"], abs=1e-6)
    assert len(rerank(server, top_n=50)["results"]) == len(DOCUMENTS)


@pytest.mark.parametrize("path", PATHS)
def test_every_path_ranks_alike(server: Server, path: str) -> None:
    results = rerank(server, path, top_n=3)["results"]
    assert [r["index"] for r in results] == [r["index"] for r in rerank(server)["results"][:3]]


def error(reply: object, path: str) -> tuple[str | None, str]:
    """(the field named, the message) from either error shape."""
    body = reply.json()["error"]  # type: ignore[attr-defined]
    if path.startswith("/v1/"):
        assert set(body) == {"message", "type", "param", "code"}
        return body["param"], body["message"]
    assert body["code"] == 400
    return None, body["message"]


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
@pytest.mark.parametrize(("body", "field"), [
    ({"documents": DOCUMENTS}, "query"),
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY, "documents": ["d"] * 1001}, "documents"),
    ({"query": QUERY, "documents": DOCUMENTS, "top_n": 0}, "top_n"),
    ({"query": QUERY, "documents": ["short", "panda " * 2100]}, "documents[1]"),
    ({"query": QUERY, "documents": [{"title": "no text"}]}, "documents[0].text"),
])
def test_bad_requests_are_400s_naming_the_field(server: Server, path: str,
                                                body: dict, field: str) -> None:
    reply = server.post(path, json={"model": "judge", **body})
    assert reply.status_code == 400, reply.text
    param, message = error(reply, path)
    assert field in message or param == field
    if path.startswith("/v1/"):
        assert param == field


@pytest.mark.parametrize("path", ["/v1/reranking", "/reranking"])
def test_a_model_without_reranking_refuses_and_stays_unloaded(server: Server, path: str) -> None:
    reply = server.post(path, json={"model": "plain", "query": QUERY, "documents": DOCUMENTS})
    assert reply.status_code == 400, reply.text
    param, message = error(reply, path)
    assert "does not support reranking" in message and "--reranking" in message
    if path.startswith("/v1/"):
        assert param == "model" and reply.json()["error"]["code"] == "reranking_not_enabled"
    else:
        assert reply.json()["error"]["reason"] == "reranking_not_enabled"
    models = {m["id"]: m["status"]["value"] for m in server.get("/models").json()["data"]}
    assert models["plain"] == "unloaded"


def test_props_say_which_model_reranks(server: Server) -> None:
    assert server.get("/props", params={"model": "judge"}).json()["reranking"] is True
    assert server.get("/props", params={"model": "plain"}).json()["reranking"] is False
    judge = server.get("/props", params={"model": "judge"}).json()["capabilities"]
    assert judge == ["completion", "chat", "logprobs", "embeddings", "rerank"]
    cards = {m["id"]: m for m in server.get("/v1/models").json()["data"]}
    assert "rerank" in cards["judge"]["capabilities"]
    assert cards["plain"]["capabilities"] == ["completion", "chat", "logprobs", "embeddings"]
