"""Embeddings through a real server and engines: OpenAI's /v1/embeddings with
the openai SDK, llama.cpp's /embedding and /embeddings, the pooling a
model's own sentence-transformers configuration names, and the errors."""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from tests.engine.test_pooling_choice import sentence_transformers_dir
from tests.support.server import Server, running_server
from tests.support.tiny_models import QWEN_BOS

pytestmark = pytest.mark.slow

N_EMBD = 64  # the tiny Qwen3's hidden size
CONTEXT = 256
TEXTS = ["The capital of France is Paris.", "Trains", "a roundhouse turns locomotives around"]


def eos_model(source: Path, target: Path) -> Path:
    """The tiny Qwen3 whose tokenizer appends <|endoftext|> to every text, as
    Qwen3-Embedding's does."""
    import shutil

    from tokenizers import Tokenizer, processors

    shutil.copytree(source, target)
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", QWEN_BOS)])
    tokenizer.save(str(target / "tokenizer.json"))
    return target


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir: Path) -> Iterator[Server]:
    models = tmp_path_factory.mktemp("embedding-models")
    (models / "qwen3-tiny").symlink_to(tiny_qwen3_dir, target_is_directory=True)
    sentence_transformers_dir(tiny_qwen3_dir, models / "qwen3-mean", pooling_mode_mean_tokens=True)
    eos_model(tiny_qwen3_dir, models / "qwen3-eos")
    log = tmp_path_factory.mktemp("embedding-logs") / "router.log"
    args = ["--models-dir", str(models), "--models-max", "3", "--threads", "1",
            "--max-context", str(CONTEXT), "--max-batched-tokens", "64"]
    with running_server(args, log) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def tokens(server: Server, text: str, model: str = "qwen3-tiny") -> list[int]:
    return server.post("/tokenize", json={"model": model, "content": text}).json()["tokens"]


def floats(server: Server, body: dict[str, object], path: str = "/v1/embeddings") -> list[list[float]]:
    reply = server.post(path, json={"model": "qwen3-tiny", **body})
    assert reply.status_code == 200, reply.text
    if path == "/v1/embeddings":
        return [item["embedding"] for item in reply.json()["data"]]
    return [item["embedding"][0] for item in reply.json()]


def close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, abs_tol=tol) for x, y in zip(a, b, strict=True))


def test_openai_sdk_floats_and_base64(client: openai.OpenAI, server: Server) -> None:
    reply = client.embeddings.create(model="qwen3-tiny", input=TEXTS, encoding_format="float")
    assert reply.object == "list" and reply.model == "qwen3-tiny"
    assert [item.index for item in reply.data] == [0, 1, 2]
    assert all(item.object == "embedding" and len(item.embedding) == N_EMBD for item in reply.data)
    for item in reply.data:  # unit length, as OpenAI's
        assert math.isclose(sum(x * x for x in item.embedding), 1.0, abs_tol=1e-5)
    counts = [len(tokens(server, text)) for text in TEXTS]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(counts)
    # The SDK's default asks for base64 and decodes it: the same float32 values
    # (to float32 rounding: the second request may take its prefix from the
    # cache, computed in another batch shape).
    default = client.embeddings.create(model="qwen3-tiny", input=TEXTS)
    assert all(close(a.embedding, b.embedding) for a, b in zip(default.data, reply.data, strict=True))
    # Asked for explicitly, base64 is handed over as it is: little-endian float32.
    raw = client.embeddings.create(model="qwen3-tiny", input=TEXTS[0], encoding_format="base64")
    packed = base64.b64decode(raw.data[0].embedding)  # type: ignore[arg-type]
    assert close(list(struct.unpack(f"<{N_EMBD}f", packed)), reply.data[0].embedding)
    # Distinct inputs, distinct vectors.
    assert reply.data[0].embedding != reply.data[1].embedding


def test_token_inputs_equal_text_inputs(client: openai.OpenAI, server: Server) -> None:
    by_text = [item.embedding for item in client.embeddings.create(
        model="qwen3-tiny", input=TEXTS, encoding_format="float").data]
    ids = [tokens(server, text) for text in TEXTS]
    by_ids = [item.embedding for item in client.embeddings.create(
        model="qwen3-tiny", input=ids, encoding_format="float").data]
    (one,) = client.embeddings.create(model="qwen3-tiny", input=ids[0],
                                      encoding_format="float").data
    assert all(close(a, b) for a, b in zip(by_text, by_ids, strict=True))
    assert close(one.embedding, by_text[0])


def test_many_inputs_come_back_in_order(server: Server) -> None:
    texts = [f"input number {i} " + "word " * (i % 7) for i in range(64)]
    together = floats(server, {"input": texts})
    assert len(together) == 64
    for index in (0, 17, 63):
        (alone,) = floats(server, {"input": texts[index]})
        assert close(together[index], alone)


def test_llama_cpp_embedding_shape(server: Server) -> None:
    (openai_vector,) = floats(server, {"input": TEXTS[0], "encoding_format": "float"})
    for path in ("/embedding", "/embeddings"):
        reply = server.post(path, json={"content": TEXTS[0]})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert isinstance(body, list) and len(body) == 1
        assert set(body[0]) == {"index", "embedding"} and body[0]["index"] == 0
        (vector,) = body[0]["embedding"]  # pooled: one vector inside a list
        assert close(vector, openai_vector)
    # Several prompts, `input` read as llama.cpp does, token ids and mixes.
    ids = tokens(server, TEXTS[1])
    several = floats(server, {"input": [TEXTS[0], ids, [ids[0], TEXTS[2]]]}, "/embedding")
    assert len(several) == 3 and close(several[0], openai_vector)
    assert close(several[1], floats(server, {"input": TEXTS[1]})[0])


def test_embd_normalize(server: Server) -> None:
    (unit,) = floats(server, {"content": TEXTS[0]}, "/embedding")
    (raw,) = floats(server, {"content": TEXTS[0], "embd_normalize": -1}, "/embedding")
    (taxicab,) = floats(server, {"content": TEXTS[0], "embd_normalize": 1}, "/embedding")
    (int16,) = floats(server, {"content": TEXTS[0], "embd_normalize": 0}, "/embedding")
    length = math.sqrt(sum(x * x for x in raw))
    assert length > 1.5  # the final norm's output is far from unit length
    assert close([x / length for x in raw], unit)
    assert math.isclose(sum(abs(x) for x in taxicab), 1.0, abs_tol=1e-4)
    assert math.isclose(max(abs(x) for x in int16), 32760.0, rel_tol=1e-6)


def test_pooling_from_the_models_sentence_transformers_config(
        server: Server, tiny_qwen3_dir: Path) -> None:
    from transformers import AutoModel

    ids = tokens(server, TEXTS[2], "qwen3-mean")
    (vector,) = floats(server, {"model": "qwen3-mean", "input": [ids]})
    model = AutoModel.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    for pooled, kind in ((hidden.mean(dim=0), "mean"), (hidden[-1], "last")):
        expected = (pooled / pooled.norm()).tolist()
        assert close(vector if kind == "mean" else floats(server, {"input": [ids]})[0],
                     expected, 1e-4), kind
    props = server.get("/props", params={"model": "qwen3-mean"}).json()
    assert props["embeddings"] == {"pooling": "mean", "n_embd": N_EMBD}
    cards = {card["id"]: card for card in server.get("/v1/models").json()["data"]}
    assert cards["qwen3-mean"]["meta"]["pooling"] == "mean"
    assert cards["qwen3-tiny"]["meta"]["pooling"] == "last"
    assert "embeddings: mean pooling (the model's own configuration)" in server.log()


def test_the_tokenizers_appended_eos_is_embedded(server: Server) -> None:
    ids = tokens(server, TEXTS[1], "qwen3-eos")
    assert ids[-1:] != [QWEN_BOS]  # /tokenize adds no EOS
    (by_text,) = floats(server, {"model": "qwen3-eos", "input": TEXTS[1]})
    (with_eos,) = floats(server, {"model": "qwen3-eos", "input": [[*ids, QWEN_BOS]]})
    (without,) = floats(server, {"model": "qwen3-eos", "input": [ids]})
    assert close(by_text, with_eos) and not close(by_text, without)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["fine", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [1, "mixed"]}, "input"),
    ({"input": [151936]}, "input"),  # one past the embedding's rows
    ({"input": [[5, -1]]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 32}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": ["x"] * 2049}, "input"),
])
def test_openai_errors_name_the_field(body: dict[str, object], param: str, server: Server) -> None:
    reply = server.post("/v1/embeddings", json={"model": "qwen3-tiny", **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_openai_sdk_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model="qwen3-tiny", input=[[7] * (CONTEXT + 1)])
    assert raised.value.code == "context_length_exceeded" and raised.value.param == "input"
    # The model's own size is accepted; it has no shorter (Matryoshka) ones.
    reply = client.embeddings.create(model="qwen3-tiny", input="x", dimensions=N_EMBD)
    assert len(reply.data[0].embedding) == N_EMBD
    # An input may fill the whole context: nothing is generated after it.
    full = client.embeddings.create(model="qwen3-tiny", input=[[7] * CONTEXT])
    assert full.usage.prompt_tokens == CONTEXT


@pytest.mark.parametrize(("body", "param"), [
    ({}, "content"),
    ({"content": ""}, "content"),
    ({"content": "x", "embd_normalize": -2}, "embd_normalize"),
    ({"content": [{"prompt_string": "x"}]}, "content"),
])
def test_llama_cpp_errors_name_the_field(body: dict[str, object], param: str,
                                         server: Server) -> None:
    reply = server.post("/embedding", json={"model": "qwen3-tiny", **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]  # llama.cpp's shape: the message names the field
    assert error["code"] == 400 and f"'{param}" in error["message"], error
