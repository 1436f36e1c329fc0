"""Log probabilities, prompt scoring, n, best_of and several prompts on the
OpenAI routes, through the openai SDK and as lm-eval-harness asks, against
a real server; the values against transformers' log_softmax."""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from typing import Any

import openai
import pytest
import requests

from tests.support.server import Server, wait_until

# One torch thread for transformers' reference beside the servers: two would
# stall each other whenever a server process takes one of the two cores.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a story about a dragon."}]
# "The capital of France is" in SmolLM2's vocabulary.
FRANCE = [504, 3575, 282, 4649, 314]


def reference_rows(model: Any, ids: list[int]) -> Any:
    """log_softmax of transformers' float32 logits: row i scores token i + 1."""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_chat_logprobs_whole_and_streamed(client: openai.OpenAI) -> None:
    # "Par" holds text back while it might start the stop string.
    for stop in (None, ["Par"]):
        whole = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0,
                                               logprobs=True, top_logprobs=3, stop=stop)
        content = whole.choices[0].message.content
        entries = whole.choices[0].logprobs.content
        # Every shown token, the one that the stop string cut too.
        assert "".join(e.token for e in entries).startswith(content)
        assert bytes(b for e in entries for b in e.bytes).decode().startswith(content)
        for entry in entries:
            assert entry.top_logprobs[0].token == entry.token  # greedy
            assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
            values = [t.logprob for t in entry.top_logprobs]
            assert values == sorted(values, reverse=True)
        chunks = list(client.chat.completions.create(
            model="smollm2", messages=QUESTION, temperature=0, logprobs=True, top_logprobs=3,
            stop=stop, stream=True))
        streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content]
        assert [(e.token, e.logprob) for e in streamed] == \
            [(e.token, pytest.approx(e.logprob, abs=1e-4)) for e in entries]
        for chunk in chunks if stop is None else ():
            # A chunk's entries are those of tokens whose text it brings.
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].delta.content:
                assert "".join(e.token for e in chunk.choices[0].logprobs.content) == \
                    chunk.choices[0].delta.content
    plain = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_with_echo(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    reply = client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0,
                                      logprobs=2, echo=True)
    choice = reply.choices[0]
    logprobs = choice.logprobs
    count = reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == count
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert choice.text.startswith(prompt) and "".join(logprobs.tokens) == choice.text
    for token, offset in zip(logprobs.tokens, logprobs.text_offset, strict=True):
        assert choice.text[offset:].startswith(token)
    for token, value, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:],
                                 logprobs.top_logprobs[1:], strict=True):
        # The 2 most likely tokens plus the chosen one.
        assert top[token] == value and 2 <= len(top) <= 3
    streamed = list(client.completions.create(model="smollm2", prompt=prompt, max_tokens=4,
                                              temperature=0, logprobs=2, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    parts = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == logprobs.tokens
    assert [o for p in parts for o in p.text_offset] == logprobs.text_offset
    assert [v for p in parts for v in p.token_logprobs][1:] == \
        pytest.approx(logprobs.token_logprobs[1:], abs=1e-4)


def lm_eval_request(router: Server, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """The body lm-eval-harness's local-completions sends for loglikelihood."""
    body = {"model": "smollm2", "prompt": [ids], "max_tokens": max_tokens, "logprobs": 1,
            "echo": True, "temperature": 0, "seed": 1234}
    response = router.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_lm_eval_loglikelihood_equals_transformers(router: Server, client: openai.OpenAI,
                                                   smollm2_reference: Any) -> None:
    ids = [*FRANCE, 7042, 30]  # " Paris."
    rows = reference_rows(smollm2_reference, ids)
    for max_tokens in (0, 1):
        reply = lm_eval_request(router, ids, max_tokens)
        (choice,) = reply["choices"]
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids) + max_tokens
        assert logprobs["token_logprobs"][0] is None
        for position, token in enumerate(ids[1:]):
            row = rows[position]
            assert math.isclose(logprobs["token_logprobs"][position + 1], float(row[token]),
                                abs_tol=1e-4), position
            # logprobs 1: the most likely token, and the prompt's own.
            top = logprobs["top_logprobs"][position + 1]
            assert max(top.values()) == pytest.approx(float(row.max()), abs=1e-4)
        assert reply["usage"]["completion_tokens"] == max_tokens
        assert reply["usage"]["prompt_tokens"] == len(ids)
        if max_tokens == 0:
            assert choice["text"] == "The capital of France is Paris."
            assert choice["finish_reason"] == "length"
        else:
            # The generated token: the greedy one, scored at the last position.
            generated = logprobs["token_logprobs"][-1]
            assert generated == pytest.approx(float(rows[len(ids) - 1].max()), abs=1e-4)
    # Generated tokens' values and alternatives too, several positions on
    # (transformers' greedy tokens are the server's).
    import torch

    with torch.inference_mode():
        greedy = smollm2_reference.generate(torch.tensor([FRANCE]), max_new_tokens=4,
                                            do_sample=False)[0, len(FRANCE):].tolist()
    rows = reference_rows(smollm2_reference, FRANCE + greedy)
    reply = client.completions.create(model="smollm2", prompt=FRANCE, max_tokens=4, temperature=0,
                                      logprobs=5)
    values = reply.choices[0].logprobs.token_logprobs
    assert len(values) == len(greedy)
    for index, (token, value) in enumerate(zip(greedy, values, strict=True)):
        row = rows[len(FRANCE) - 1 + index]
        assert value == pytest.approx(float(row[token]), abs=1e-4)
        top = sorted(reply.choices[0].logprobs.top_logprobs[index].values(), reverse=True)
        assert top == pytest.approx(row.topk(5).values.tolist(), abs=1e-4)


def test_n_choices_are_identical_greedy_and_reproducible_with_a_seed(client: openai.OpenAI) -> None:
    greedy = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.message.content for c in greedy.choices}) == 1
    one = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0)
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens

    def sampled(n: int) -> list[str]:
        reply = client.chat.completions.create(model="smollm2", messages=STORY, temperature=1.0,
                                               top_p=1.0, seed=21, max_tokens=16, n=n)
        return [c.message.content for c in reply.choices]

    first = sampled(3)
    assert sampled(3) == first
    assert len(set(first)) > 1  # each choice its own seed
    assert sampled(1) == first[:1]  # choice 0 is what n = 1 gives
    completions = client.completions.create(model="smollm2", prompt=FRANCE, max_tokens=5,
                                            temperature=0, n=2)
    assert completions.choices[0].text == completions.choices[1].text
    # Streamed: each chunk about one choice, a finish chunk each, usage summed.
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=QUESTION, temperature=0, n=2, stream=True, logprobs=True,
        stream_options={"include_usage": True}))
    texts: dict[int, str] = defaultdict(str)
    tokens: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[str]] = defaultdict(list)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        tokens[choice.index] += "".join(e.token for e in choice.logprobs.content) \
            if choice.logprobs else ""
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    content = one.choices[0].message.content
    assert texts == tokens == {0: content, 1: content}
    assert finishes == {0: ["stop"], 1: ["stop"]}
    assert chunks[-1].usage.completion_tokens == greedy.usage.completion_tokens * 2 // 3


def test_several_prompts_give_a_choice_each(client: openai.OpenAI) -> None:
    prompts = ["The capital of France is", "One, two,"]
    alone = [client.completions.create(model="smollm2", prompt=p, max_tokens=5, temperature=0)
             for p in prompts]
    reply = client.completions.create(model="smollm2", prompt=prompts, max_tokens=5, temperature=0,
                                      n=2)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [alone[0].choices[0].text] * 2 + \
        [alone[1].choices[0].text] * 2
    assert reply.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert reply.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    by_ids = client.completions.create(model="smollm2", prompt=[FRANCE, FRANCE[:3]], max_tokens=5,
                                       temperature=0)
    assert by_ids.choices[0].text == alone[0].choices[0].text
    chunks = list(client.completions.create(
        model="smollm2", prompt=prompts, max_tokens=5, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True}))
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[str]] = defaultdict(list)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices  # each chunk is about one choice
        texts[choice.index] += choice.text
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert texts == {c.index: c.text for c in reply.choices}
    assert finishes == {c.index: [c.finish_reason] for c in reply.choices}
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_best_of_returns_the_most_likely_candidates(client: openai.OpenAI) -> None:
    def mean(choice: Any) -> float:
        values = choice.logprobs.token_logprobs
        return sum(values) / len(values)

    # The candidates best_of picks from are the n = 3 choices of the same seed.
    candidates = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=8,
                                           temperature=1.0, top_p=1.0, seed=5, n=3, logprobs=0)
    ranked = sorted(candidates.choices, key=mean, reverse=True)
    best = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=8,
                                     temperature=1.0, top_p=1.0, seed=5, n=2, best_of=3)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == candidates.usage.completion_tokens  # all 3 generated


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"n": 17}, "n"),
        ("/v1/completions", {"logprobs": 6}, "logprobs"),
        ("/v1/completions", {"n": 3, "best_of": 2}, "best_of"),
        ("/v1/completions", {"best_of": 2, "stream": True}, "best_of"),
        ("/v1/completions", {"n": 17}, "n"),
        ("/v1/completions", {"prompt": ["a"] * 9, "n": 2}, "n"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ],
)
def test_refusals_name_their_field(router: Server, path: str, fields: dict[str, Any],
                                   param: str) -> None:
    body: dict[str, Any] = {"model": "smollm2"}
    body.update({"messages": QUESTION} if "chat" in path else {"prompt": "Hello"})
    response = router.post(path, json={**body, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_siblings_share_the_prompts_pages(router: Server) -> None:
    """The 2nd and 3rd choices find the 1st's full prompt pages cached."""
    router.post("/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 1})
    load = router.load()["smollm2"]
    page = load["capacity"]["kv_page_tokens"]
    before = load["counters"]["cached_prompt_tokens"]
    # A prompt no earlier request held: 40 tokens, two full 16-token pages.
    prompt = random.Random().sample(range(1000, 30000), 40)
    reply = router.post("/v1/completions", json={"model": "smollm2", "prompt": prompt,
                                                  "max_tokens": 2, "n": 3, "temperature": 0}).json()
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Each sibling finds at least the full pages; if the first has already
    # ended, its partial last page too (reuse to the token), never the last
    # prompt token, which is always computed.
    expected = 2 * ((len(prompt) - 1) // page * page)
    wait_until(lambda: router.load()["smollm2"]["counters"]["cached_prompt_tokens"] - before
               >= expected, 5, "the siblings' cache hits", router)
    cached = router.load()["smollm2"]["counters"]["cached_prompt_tokens"] - before
    assert expected <= cached <= 2 * (len(prompt) - 1)


def test_every_shown_token_is_scored_whatever_the_parsers_make_of_it(
        client: openai.OpenAI) -> None:
    """Qwen3's template thinks: reasoning and answer tokens alike are in
    logprobs.content, streamed or not."""
    fields: dict[str, Any] = {"model": "qwen3-tiny", "messages": QUESTION, "temperature": 0,
                              "max_tokens": 12, "logprobs": True, "top_logprobs": 2,
                              "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**fields)
    entries = whole.choices[0].logprobs.content
    assert len(entries) == whole.usage.completion_tokens == 12
    message = whole.choices[0].message
    shown = (getattr(message, "reasoning_content", None) or "") + (message.content or "")
    assert len(shown) > 0
    chunks = list(client.chat.completions.create(**fields, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]


def test_a_client_that_leaves_aborts_every_choice(router: Server) -> None:
    body = {"model": "qwen3-tiny", "messages": QUESTION, "max_tokens": 1500, "ignore_eos": True,
            "stream": True, "n": 3}
    with requests.post(router.url + "/v1/chat/completions", json=body, stream=True,
                       timeout=60) as response:
        lines = response.iter_lines()
        # (The model loads first: the stream opens with keep-alive comments.)
        assert next(line for line in lines if line.startswith(b"data: "))
        wait_until(lambda: router.load()["qwen3-tiny"]["requests"]["running"] == 3, 30,
                   "all three choices to run", router)
    wait_until(lambda: router.load()["qwen3-tiny"]["requests"]["running"] == 0, 5,
               "the engine to drop the aborted choices", router)
    generated = router.load()["qwen3-tiny"]["counters"]["generated_tokens"]
    time.sleep(0.5)
    assert router.load()["qwen3-tiny"]["counters"]["generated_tokens"] == generated
