"""llama.cpp's native API against a real router: POST /completion, /tokenize,
/detokenize, /apply-template and GET /props, in llama.cpp's shapes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from router.text.model_text import ModelText
from tests.e2e.llamacpp_support import bos_model, stream_events
from tests.support.server import Server, running_server

# One torch thread for transformers' reference beside the servers: two would
# stall each other whenever a server process takes one of the two cores.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]  # PROMPT in SmolLM2's vocabulary
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
FINAL_FIELDS = {"index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted",
                "tokens_evaluated", "generation_settings", "prompt", "has_new_line", "truncated",
                "stop_type", "stopping_word", "tokens_cached", "timings"}
TIMINGS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
           "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path, tiny_qwen3_dir: Path) -> Path:
    directory = tmp_path_factory.mktemp("llamacpp-models")
    (directory / "smollm2.gguf").symlink_to(smollm2_gguf)
    (directory / "qwen3-tiny").symlink_to(tiny_qwen3_dir, target_is_directory=True)
    bos_model(directory / "qwen3-bos", tiny_qwen3_dir)
    return directory


@pytest.fixture(scope="module")
def server(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("llamacpp-logs") / "router.log"
    # Small prefill chunks, so a prompt reports its progress several times.
    args = ["--models-dir", str(models), "--models-max", "1", "--threads", "1",
            "--max-batched-tokens", "32"]
    with running_server(args, log) as running:
        yield running


def complete(server: Server, **body: object) -> dict:
    reply = server.post("/completion", json={"model": "smollm2", "temperature": 0, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def chat_prompt(server: Server) -> str:
    return server.post("/apply-template", json={"model": "smollm2", "messages": QUESTION}).json()["prompt"]


def statuses(server: Server) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in server.get("/models").json()["data"]}


# ---- text side: never loads a model -------------------------------------------------


def test_router_props_without_a_model(server: Server) -> None:
    props = server.get("/props").json()
    assert props["role"] == "router"
    assert props["max_instances"] == 1 and props["models_autoload"] is True
    assert props["model_alias"] == "llama-server" and props["model_path"] == "none"
    assert props["default_generation_settings"] == {"params": {}, "n_ctx": 0}
    assert props["build_info"].startswith("b") and props["build_info"].endswith("-roundhouse")


def test_text_endpoints_never_load_a_model(server: Server, tiny_qwen3_dir: Path) -> None:
    before = statuses(server)
    props = server.get("/props", params={"model": "qwen3-tiny"}).json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 2048  # not loaded: the trained context
    assert settings["params"]["n_predict"] == -1 and settings["params"]["seed"] == 0xFFFFFFFF
    assert props["model_alias"] == "qwen3-tiny" and props["model_path"].endswith("qwen3-tiny")
    assert props["total_slots"] == 8 and props["is_sleeping"] is False
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}
    assert props["chat_template"] == ModelText.load(tiny_qwen3_dir).template.source
    assert props["eos_token"] == "<|im_end|>" and "role" not in props
    server.post("/tokenize", json={"model": "qwen3-bos", "content": "hi", "with_pieces": True})
    server.post("/detokenize", json={"model": "qwen3-tiny", "tokens": [872]})
    server.post("/apply-template", json={"model": "qwen3-tiny", "messages": QUESTION})
    after = statuses(server)
    assert after["qwen3-tiny"] == after["qwen3-bos"] == "unloaded"
    assert after == before


def test_props_of_an_unknown_model_is_404(server: Server) -> None:
    reply = server.get("/props", params={"model": "nope"})
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == 404 and reply.json()["error"]["reason"] == "model_not_found"


def test_tokenize_and_pieces(server: Server) -> None:
    ids = server.post("/tokenize", json={"model": "smollm2", "content": PROMPT}).json()["tokens"]
    assert ids == PROMPT_IDS
    pieces = server.post("/tokenize", json={"model": "smollm2", "content": PROMPT,
                                            "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == PROMPT_IDS
    assert "".join(p["piece"] for p in pieces) == PROMPT
    # A character split over several byte tokens: pieces that are not UTF-8 come as bytes.
    llama = server.post("/tokenize", json={"model": "smollm2", "content": "🦙",
                                           "with_pieces": True}).json()["tokens"]
    assert any(isinstance(p["piece"], list) for p in llama)
    assert b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode()
                    for p in llama) == "🦙".encode()


def test_tokenize_parse_special(server: Server) -> None:
    text = "<|im_start|>user <think>"
    parsed = server.post("/tokenize", json={"model": "qwen3-tiny", "content": text}).json()["tokens"]
    assert parsed == [151644, 872, 220, 151667]
    plain = server.post("/tokenize", json={"model": "qwen3-tiny", "content": text,
                                           "parse_special": False, "with_pieces": True}).json()["tokens"]
    # The special token is spelled out; <think> (added, not special) still matches whole.
    assert 151644 not in [p["id"] for p in plain] and plain[-1]["id"] == 151667
    assert "".join(p["piece"] for p in plain) == text


def test_tokenize_add_special(server: Server) -> None:
    for model, bos in (("qwen3-bos", [151643]), ("qwen3-tiny", []), ("smollm2", [])):
        plain = server.post("/tokenize", json={"model": model, "content": "hi"}).json()["tokens"]
        special = server.post("/tokenize", json={"model": model, "content": "hi",
                                                 "add_special": True}).json()["tokens"]
        assert special == bos + plain, model
    spelled = server.post("/tokenize", json={"model": "qwen3-bos", "content": "<|im_end|>",
                                             "add_special": True, "parse_special": False}).json()
    assert spelled["tokens"][0] == 151643 and 151645 not in spelled["tokens"]


def test_detokenize_round_trip(server: Server) -> None:
    for model, text in (("qwen3-tiny", "<|im_start|>user\nHello, wörld 🦙<|im_end|>"),
                        ("smollm2", "Hello, wörld 🦙")):
        ids = server.post("/tokenize", json={"model": model, "content": text}).json()["tokens"]
        reply = server.post("/detokenize", json={"model": model, "tokens": ids}).json()
        assert reply == {"content": text}
    bad = server.post("/detokenize", json={"model": "smollm2", "tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["reason"] == "invalid_value"


def test_apply_template_equals_the_chat_template(server: Server, smollm2_gguf: Path,
                                                 tiny_qwen3_dir: Path) -> None:
    assert chat_prompt(server) == ModelText.load(smollm2_gguf).render_chat(QUESTION)
    reply = server.post("/apply-template", json={
        "model": "qwen3-tiny", "messages": QUESTION, "chat_template_kwargs": {"enable_thinking": False}})
    expected = ModelText.load(tiny_qwen3_dir).render_chat(QUESTION, enable_thinking=False)
    assert reply.json() == {"prompt": expected}
    missing = server.post("/apply-template", json={"model": "qwen3-tiny"})
    assert missing.status_code == 400
    assert missing.json()["error"]["reason"] == "missing_required_parameter"


# ---- /completion -------------------------------------------------------------------------


def test_greedy_completion_equals_openai_completions(server: Server) -> None:
    body = complete(server, prompt=PROMPT, n_predict=8)
    openai = server.post("/v1/completions", json={"model": "smollm2", "prompt": PROMPT,
                                                  "max_tokens": 8, "temperature": 0}).json()
    assert body["content"] == openai["choices"][0]["text"]
    assert set(body) == FINAL_FIELDS
    assert body["stop"] is True and body["stop_type"] == "limit" and body["stopping_word"] == ""
    assert body["tokens_predicted"] == 8 and body["tokens_evaluated"] == len(PROMPT_IDS)
    assert body["tokens"] == [] and body["truncated"] is False and body["model"] == "smollm2"
    assert body["prompt"] == PROMPT and body["id_slot"] == 0
    assert body["generation_settings"]["n_predict"] == 8
    assert body["generation_settings"]["temperature"] == 0
    assert set(body["timings"]) >= TIMINGS and body["timings"]["predicted_n"] == 8


def test_token_id_and_mixed_prompts(server: Server) -> None:
    expected = complete(server, prompt=PROMPT, n_predict=6)["content"]
    assert complete(server, prompt=PROMPT_IDS, n_predict=6)["content"] == expected
    assert complete(server, prompt=[PROMPT_IDS], n_predict=6)["content"] == expected
    assert complete(server, prompt=["The capital", 282, 4649, 314], n_predict=6)["content"] == expected
    assert complete(server, prompt={"prompt_string": PROMPT}, n_predict=6)["content"] == expected
    several = server.post("/completion", json={"model": "smollm2", "prompt": ["a", "b"]})
    assert several.status_code == 400 and several.json()["error"]["code"] == 400


def test_return_tokens_and_response_fields(server: Server) -> None:
    body = complete(server, prompt=PROMPT, n_predict=5, return_tokens=True)
    assert len(body["tokens"]) == 5
    detok = server.post("/detokenize", json={"model": "smollm2", "tokens": body["tokens"]}).json()
    assert detok["content"] == body["content"]
    only = complete(server, prompt=PROMPT, n_predict=5,
                    response_fields=["content", "generation_settings/n_predict", "timings/nope"])
    assert only == {"content": body["content"], "generation_settings/n_predict": 5}


def test_stop_word_eos_and_prompt_only(server: Server) -> None:
    prompt = chat_prompt(server)
    answer = complete(server, prompt=prompt, n_predict=64)
    assert "Paris" in answer["content"]
    assert answer["stop_type"] == "eos" and answer["tokens_predicted"] < 64
    stopped = complete(server, prompt=prompt, n_predict=64, stop=["Paris", "never"])
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == "Paris"
    assert stopped["content"] == answer["content"][:answer["content"].index("Paris")]
    warm = complete(server, prompt=prompt, n_predict=0)
    assert warm["content"] == "" and warm["tokens_predicted"] == 0 and warm["stop_type"] == "limit"
    # The prompt is in the prefix cache now.
    again = complete(server, prompt=prompt, n_predict=1)
    assert again["tokens_cached"] > 0 and again["timings"]["cache_n"] == again["tokens_cached"]


def test_streamed_chunks(server: Server) -> None:
    whole = complete(server, prompt=PROMPT, n_predict=8)
    events = stream_events(server, "/completion", {"model": "smollm2", "prompt": PROMPT,
                                                   "n_predict": 8, "temperature": 0, "stream": True})
    *tokens, final = events
    assert len(tokens) == 8
    assert all(e["stop"] is False and len(e["tokens"]) == 1 and "timings" not in e for e in tokens)
    assert "".join(e["content"] for e in tokens) == whole["content"]
    assert [e["tokens_predicted"] for e in tokens] == list(range(1, 9))
    assert final["stop"] is True and final["content"] == "" and final["tokens"] == []
    assert set(final) == FINAL_FIELDS and final["stop_type"] == "limit"
    assert set(final["timings"]) >= TIMINGS and final["generation_settings"]["stream"] is True


def test_timings_per_token_and_progress(server: Server) -> None:
    events = stream_events(server, "/completion", {
        "model": "smollm2", "prompt": PROMPT, "n_predict": 3, "temperature": 0, "stream": True,
        "timings_per_token": True})
    assert all(set(e["timings"]) >= TIMINGS for e in events)
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)
    events = stream_events(server, "/completion", {
        "model": "smollm2", "prompt": long_prompt, "n_predict": 3, "temperature": 0, "stream": True,
        "return_progress": True, "cache_prompt": False})
    progress = [e for e in events if "prompt_progress" in e]
    first_token = next(i for i, e in enumerate(events) if e["tokens"])
    assert progress and all("prompt_progress" in e for e in events[:first_token])
    total = events[-1]["tokens_evaluated"]
    assert total > 64  # more than two prefill chunks of 32
    assert len(progress) >= 2
    for chunk in progress:
        assert chunk["content"] == "" and chunk["tokens"] == [] and chunk["stop"] is False
        assert set(chunk["prompt_progress"]) == {"total", "cache", "processed", "time_ms"}
        assert chunk["prompt_progress"]["total"] == total
    processed = [c["prompt_progress"]["processed"] for c in progress]
    assert processed == sorted(processed) and processed[-1] == total


def test_sampler_controls_at_neutral_values(server: Server) -> None:
    neutral = {"mirostat": 0, "dry_multiplier": 0.0, "typical_p": 1.0, "xtc_probability": 0.0,
               "top_n_sigma": -1.0, "n_probs": 0, "logit_bias": [], "samplers": "edskypmxt",
               "dynatemp_range": 0.0, "n_indent": 0, "lora": [], "cache_prompt": True,
               "id_slot": -1, "repeat_penalty": 1.0, "seed": 42}
    body = complete(server, prompt=PROMPT, n_predict=2, **neutral)
    assert body["generation_settings"]["samplers"] == [
        "penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
    assert body["generation_settings"]["seed"] == 42


@pytest.mark.parametrize(("field", "value"), [
    ("mirostat", 2), ("dry_multiplier", 0.8), ("typical_p", 0.5), ("xtc_probability", 0.5),
    ("top_n_sigma", 1.0), ("n_indent", 4),
    ("t_max_predict_ms", 100), ("lora", [{"id": 0, "scale": 0.5}]), ("dynatemp_range", 0.5),
    ("samplers", ["temperature", "top_k"]),
])
def test_sampler_controls_we_lack_are_refused(server: Server, field: str, value: object) -> None:
    reply = server.post("/completion", json={"model": "smollm2", "prompt": PROMPT, field: value})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == 400 and error["reason"] == f"{field}_not_supported"
    assert field in error["message"]


def test_errors_in_llamacpp_shape(server: Server) -> None:
    missing = server.post("/completion", json={"model": "smollm2"})
    assert missing.status_code == 400
    assert missing.json()["error"]["reason"] == "missing_required_parameter"
    unknown = server.post("/completion", json={"model": "nope", "prompt": "hi"})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    outside = server.post("/completion", json={"model": "smollm2", "prompt": [10**6]})
    assert outside.status_code == 400 and outside.json()["error"]["reason"] == "invalid_value"


def test_props_of_a_loaded_model(server: Server) -> None:
    complete(server, prompt=PROMPT, n_predict=1)
    loaded = {m["id"]: m for m in server.get("/models").json()["data"]}["smollm2"]
    assert loaded["status"]["value"] == "loaded"
    props = server.get("/props", params={"model": "smollm2"}).json()
    assert props["default_generation_settings"]["n_ctx"] == loaded["meta"]["n_ctx"]
    assert props["bos_token"] == "<|im_start|>" and props["eos_token"] == "<|im_end|>"


# ---- n_probs and post_sampling_probs ----------------------------------------------------

ENTRY = {"id", "token", "bytes", "logprob", "top_logprobs"}
ALTERNATIVE = {"id", "token", "bytes", "logprob"}


@torch.inference_mode()
def reference_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log_softmax at each generated position: [len(tokens), V]."""
    logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:], dim=-1)


def test_n_probs_are_the_raw_log_probabilities(server: Server, smollm2_reference: torch.nn.Module) -> None:
    body = complete(server, prompt=PROMPT, n_predict=6, n_probs=3, return_tokens=True)
    entries = body["completion_probabilities"]
    assert [e["id"] for e in entries] == body["tokens"] and len(entries) == 6
    assert "".join(e["token"] for e in entries) == body["content"]
    expected = reference_logprobs(smollm2_reference, PROMPT_IDS, body["tokens"])
    for position, entry in enumerate(entries):
        assert set(entry) == ENTRY and bytes(entry["bytes"]) == entry["token"].encode()
        row = expected[position]
        assert entry["logprob"] == pytest.approx(float(row[entry["id"]]), abs=1e-3)
        assert len(entry["top_logprobs"]) == 3
        assert all(set(alt) == ALTERNATIVE for alt in entry["top_logprobs"])
        assert [alt["logprob"] for alt in entry["top_logprobs"]] == pytest.approx(
            row.topk(3).values.tolist(), abs=1e-3)
        assert entry["top_logprobs"][0]["id"] == entry["id"]  # greedy: the most likely
    assert body["generation_settings"]["n_probs"] == 3
    # Streamed: each token's chunk carries its own entry; the last chunk none.
    events = stream_events(server, "/completion", {"model": "smollm2", "prompt": PROMPT, "n_predict": 6,
                                                   "temperature": 0, "stream": True, "n_probs": 3})
    *tokens, final = events
    assert [len(e["completion_probabilities"]) for e in tokens] == [1] * 6
    streamed = [e["completion_probabilities"][0] for e in tokens]
    assert [e["id"] for e in streamed] == body["tokens"]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in entries], abs=1e-5)
    assert "completion_probabilities" not in final
    # Without n_probs there are none.
    assert "completion_probabilities" not in complete(server, prompt=PROMPT, n_predict=2)


def test_post_sampling_probs_are_the_sampling_distribution(server: Server,
                                                           smollm2_reference: torch.nn.Module) -> None:
    # Greedy: the chosen token had probability 1 and was the only candidate.
    greedy = complete(server, prompt=PROMPT, n_predict=4, n_probs=5, post_sampling_probs=True)
    for entry in greedy["completion_probabilities"]:
        assert set(entry) == {"id", "token", "bytes", "prob", "top_probs"}
        assert entry["prob"] == 1.0
        assert entry["top_probs"] == [{"id": entry["id"], "token": entry["token"],
                                       "bytes": entry["bytes"], "prob": 1.0}]
    # Sampled: temperature 0.7 over the 4 most likely tokens; all 4 listed.
    settings = {"temperature": 0.7, "top_k": 4, "top_p": 1.0, "min_p": 0.0, "seed": 3}
    body = complete(server, prompt=PROMPT, n_predict=6, n_probs=10, post_sampling_probs=True,
                    return_tokens=True, **settings)
    expected = reference_logprobs(smollm2_reference, PROMPT_IDS, body["tokens"])
    for position, entry in enumerate(body["completion_probabilities"]):
        top = expected[position].topk(4)
        probs = torch.softmax(top.values / 0.7, dim=-1)
        assert [alt["id"] for alt in entry["top_probs"]] == top.indices.tolist()
        assert [alt["prob"] for alt in entry["top_probs"]] == pytest.approx(probs.tolist(), abs=1e-3)
        assert entry["prob"] == pytest.approx(float(probs[top.indices.tolist().index(entry["id"])]),
                                              abs=1e-3)
    events = stream_events(server, "/completion", {"model": "smollm2", "prompt": PROMPT, "n_predict": 6,
                                                   "stream": True, "n_probs": 10,
                                                   "post_sampling_probs": True, **settings})
    streamed = [e["completion_probabilities"][0] for e in events[:-1]]
    assert [e["id"] for e in streamed] == body["tokens"]
    assert [e["top_probs"] for e in streamed] == [e["top_probs"] for e in body["completion_probabilities"]]


def test_the_end_of_sequence_token_has_an_entry_and_a_stop_word_none(server: Server) -> None:
    prompt = chat_prompt(server)
    answer = complete(server, prompt=prompt, n_predict=64, n_probs=1, return_tokens=True)
    entries = answer["completion_probabilities"]
    assert answer["stop_type"] == "eos" and len(entries) == answer["tokens_predicted"]
    assert entries[-1]["token"] == "" and entries[-1]["bytes"] == []  # <|im_end|>, a control token
    assert [e["id"] for e in entries] == answer["tokens"]
    stopped = complete(server, prompt=prompt, n_predict=64, n_probs=1, stop=["Paris"])
    paris = len(server.post("/tokenize", json={"model": "smollm2", "content": "Paris"}).json()["tokens"])
    assert stopped["stop_type"] == "word"
    assert len(stopped["completion_probabilities"]) == stopped["tokens_predicted"] - paris
    events = stream_events(server, "/completion", {"model": "smollm2", "prompt": prompt, "n_predict": 64,
                                                   "temperature": 0, "stream": True, "n_probs": 1})
    streamed = [entry for e in events for entry in e.get("completion_probabilities", [])]
    assert [e["id"] for e in streamed] == answer["tokens"]
