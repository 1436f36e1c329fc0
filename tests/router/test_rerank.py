"""Rerank's router side without an engine: the judge prompt against
Qwen3-Reranker's model card (transformers' tokenizer), the score, the
request's checks, the ranking, and how the documents are submitted."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from pathlib import Path

import msgspec
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from protocol import RequestOutput, TokenLogprobs
from router.engine_client import EngineFailure
from router.errors import ContextLengthExceeded, InvalidRequest
from router.rerank.handler import check_fits, ranked
from router.rerank.judge import DEFAULT_INSTRUCTION, Judge, relevance
from router.rerank.request import MAX_DOCUMENTS, RerankRequest, checked
from router.rerank.scoring import score_prompts
from router.text import ModelText
from router.text.tokenizer import Tokenizer

# Qwen3-Reranker's model card, as its transformers example writes it.
CARD_PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on '
               'the Query and the Instruct provided. Note that the answer can only be "yes" or '
               '"no".<|im_end|>\n<|im_start|>user\n')
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def request(**fields: object) -> RerankRequest:
    body = {"query": "what is a panda?", "documents": ["hi", "a bear"], **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=RerankRequest)


# ---- the judge ------------------------------------------------------------------------


@pytest.mark.parametrize("instruction", [DEFAULT_INSTRUCTION, "Find recipes"])
def test_judge_prompt_is_the_model_cards(qwen3_text: ModelText, qwen3_tokenizer_dir: Path,
                                         instruction: str) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    judge = Judge.of("qwen3", qwen3_text)
    documents = ["The giant panda is a bear species endemic to China.", "", "naïve café 東京"]
    got = asyncio.run(judge.prompts(instruction, "What is panda?", documents))
    for document, ids in zip(documents, got, strict=True):
        pair = f"<Instruct>: {instruction}\n<Query>: What is panda?\n<Document>: {document}"
        expected = (hf.encode(CARD_PREFIX, add_special_tokens=False) + hf(pair)["input_ids"]
                    + hf.encode(CARD_SUFFIX, add_special_tokens=False))
        assert ids == expected
    assert (judge.yes_id, judge.no_id) == (hf.convert_tokens_to_ids("yes"),
                                           hf.convert_tokens_to_ids("no"))


def test_long_documents_are_tokenized_the_same_off_the_loop(qwen3_text: ModelText) -> None:
    judge = Judge.of("qwen3", qwen3_text)
    documents = [f"document {i}: " + "pandas eat bamboo. " * 200 for i in range(3)]
    batched = asyncio.run(judge.prompts(DEFAULT_INSTRUCTION, "panda", documents))
    one_by_one = [asyncio.run(judge.prompts(DEFAULT_INSTRUCTION, "panda", [d]))[0]
                  for d in documents[:1]]
    assert batched[0] == one_by_one[0] and len(batched) == 3


def test_a_model_without_single_token_answers_cannot_judge(qwen3_text: ModelText) -> None:
    # Characters only: "yes" and "no" take a token per letter.
    backend = Backend(models.BPE(vocab={c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")},
                                 merges=[]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    letters = dataclasses.replace(qwen3_text, tokenizer=Tokenizer(backend))
    with pytest.raises(InvalidRequest) as refused:
        Judge.of("letters", letters)
    assert refused.value.code == "reranking_not_supported" and refused.value.param == "model"
    assert '"yes", "no" are not single tokens' in refused.value.message


def test_relevance_is_the_softmax_over_yes_and_no() -> None:
    yes, no = math.log(0.6), math.log(0.2)
    assert relevance(yes, no) == pytest.approx(0.75)
    assert relevance(-3.0, -3.0) == 0.5
    # Far apart, neither exponent overflows.
    assert relevance(0.0, -2000.0) == 1.0 and relevance(-2000.0, 0.0) == 0.0


# ---- the request --------------------------------------------------------------------


def test_documents_may_be_strings_or_objects_with_text() -> None:
    job = checked(request(documents=["a", {"text": "b"}, ""], top_n=10))
    assert job.documents == ["a", "b", ""] and job.top_n == 3  # top_n past the documents: all
    assert job.instruction == DEFAULT_INSTRUCTION and job.return_documents is False
    assert checked(request(instruction="Find recipes")).instruction == "Find recipes"


@pytest.mark.parametrize(("fields", "param"), [
    ({"query": ""}, "query"),
    ({"documents": []}, "documents"),
    ({"documents": ["d"] * (MAX_DOCUMENTS + 1)}, "documents"),
    ({"top_n": 0}, "top_n"),
    ({"top_n": -2}, "top_n"),
    ({"instruction": " "}, "instruction"),
])
def test_bad_fields_are_refused_by_name(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        checked(request(**fields))
    assert refused.value.param == param and refused.value.kind.value == "invalid"


def test_a_prompt_must_leave_room_for_the_answer() -> None:
    check_fits([[1] * 9, [1] * 3], 10)
    with pytest.raises(ContextLengthExceeded) as refused:
        check_fits([[1] * 3, [1] * 10, [1] * 11], 10)
    assert refused.value.param == "documents[1]" and refused.value.n_prompt_tokens == 10


def test_results_are_sorted_cut_to_top_n_and_carry_documents_when_asked() -> None:
    job = checked(request(documents=["a", "b", "c", "d"], top_n=3, return_documents=True))
    results = ranked(job, [0.1, 0.9, 0.5, 0.9])
    assert [r["index"] for r in results] == [1, 3, 2]  # equal scores keep their order
    assert results[0] == {"index": 1, "relevance_score": 0.9, "document": {"text": "b"}}
    bare = ranked(checked(request(documents=["a", "b"])), [0.2, 0.3])
    assert bare == [{"index": 1, "relevance_score": 0.3}, {"index": 0, "relevance_score": 0.2}]


# ---- submitting the documents ---------------------------------------------------------


class FakeStream:
    def __init__(self, client: FakeClient, request_id: str, prompt: list[int]) -> None:
        self.client, self.request_id, self.prompt = client, request_id, prompt
        self.done = False

    async def take(self) -> list[RequestOutput]:
        if self.done:
            return []
        self.client.running += 1
        self.client.peak = max(self.client.peak, self.client.running)
        try:
            # A prompt starting with 0 stands for a request that runs long.
            await asyncio.sleep(10 if self.prompt[0] == 0 else 0.01)
        finally:
            self.client.running -= 1
        self.done = True
        if self.prompt[0] < 0:
            raise EngineFailure("refused", code="invalid_request")
        # The prompt's first id stands for log P(yes); log P(no) is 0.
        entry = TokenLogprobs(-1.0, named_logprobs=[float(-self.prompt[0]), 0.0])
        return [RequestOutput(self.request_id, [7], "length", logprobs=[entry])]

    def abort(self) -> None:
        if not self.done:
            self.client.aborted.append(self.request_id)
        self.done = True


class FakeClient:
    def __init__(self) -> None:
        self.running = self.peak = 0
        self.submitted: list[tuple[str, list[int], object]] = []
        self.aborted: list[str] = []

    def submit(self, request_id: str, prompt: list[int], params: object,
               id_slot: int = -1) -> FakeStream:
        self.submitted.append((request_id, prompt, params))
        return FakeStream(self, request_id, prompt)


def judge(qwen3_text: ModelText) -> Judge:
    return Judge.of("qwen3", qwen3_text)


def test_documents_are_scored_together_up_to_the_lane_count(qwen3_text: ModelText) -> None:
    client = FakeClient()
    prompts = [[1 + i] for i in range(7)]
    scores = asyncio.run(score_prompts(client, judge(qwen3_text), prompts, "rr", 3))  # type: ignore[arg-type]
    assert scores == [relevance(-float(1 + i), 0.0) for i in range(7)]
    assert client.peak == 3
    assert [request_id for request_id, _, _ in client.submitted] == [f"rr-{i}" for i in range(7)]
    _, _, params = client.submitted[0]
    assert params.max_tokens == 1 and params.temperature == 0.0 and params.logprobs == 0  # type: ignore[attr-defined]
    assert params.logprob_token_ids == [judge(qwen3_text).yes_id, judge(qwen3_text).no_id]  # type: ignore[attr-defined]


def test_a_refused_document_aborts_the_others(qwen3_text: ModelText) -> None:
    client = FakeClient()
    # Document 1 is refused while document 0 still runs.
    with pytest.raises(EngineFailure):
        asyncio.run(score_prompts(client, judge(qwen3_text), [[0], [-1], [0]], "rr", 2))  # type: ignore[arg-type]
    submitted = {request_id for request_id, _, _ in client.submitted}
    assert "rr-0" in client.aborted and set(client.aborted) == submitted - {"rr-1"}
