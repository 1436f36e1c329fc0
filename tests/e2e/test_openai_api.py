"""Chat Completions and Completions through the openai SDK against a real server."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.support.server import Server

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_catalog_lists_the_models_in_the_directory(router: Server) -> None:
    data = router.get("/v1/models").json()["data"]
    assert sorted(m["id"] for m in data) == ["broken", "qwen3-tiny", "smollm2"]
    assert all(m["object"] == "model" and "status" in m for m in data)


def test_chat_answers_paris(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert reply.model == "smollm2" and reply.object == "chat.completion"
    usage = reply.usage
    assert usage.prompt_tokens > 10 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streamed_chat_equals_the_whole_answer(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0)
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=QUESTION, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_from_text_and_from_token_ids(client: openai.OpenAI, router: Server) -> None:
    by_text = client.completions.create(model="smollm2", prompt="The capital of France is",
                                        max_tokens=6, temperature=0)
    assert by_text.object == "text_completion"
    assert by_text.choices[0].finish_reason == "length"
    assert by_text.usage.completion_tokens == 6
    ids = router.post("/v1/completions", json={"model": "smollm2", "prompt": "The capital of France is",
                                               "max_tokens": 1, "echo": True, "temperature": 0}).json()
    assert ids["choices"][0]["text"].startswith("The capital of France is")
    token_ids = [504, 3575, 282, 4649, 314]  # "The capital of France is" in SmolLM2's vocabulary
    by_ids = client.completions.create(model="smollm2", prompt=token_ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    streamed = client.completions.create(model="smollm2", prompt="The capital of France is",
                                         max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == by_text.choices[0].text


def test_stop_strings_are_withheld(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0,
                                           stop=["Paris", "never"])
    content = reply.choices[0].message.content
    assert "Paris" not in content and content.startswith("The capital of France is")
    assert reply.choices[0].finish_reason == "stop"
    # "Par" stops at the same place; streamed, no piece of it leaks out.
    streamed = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0,
                                              stop="Par", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == content


def test_max_tokens_ends_with_length(client: openai.OpenAI) -> None:
    for field in ("max_tokens", "max_completion_tokens"):
        reply = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0,
                                               **{field: 3})
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 3


def test_a_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def ask(seed: int) -> str:
        reply = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=1.0,
                                               top_p=1.0, seed=seed, max_tokens=24)
        return reply.choices[0].message.content

    first = ask(11)
    assert ask(11) == first
    assert any(ask(seed) != first for seed in (12, 13, 14))


def test_concurrent_requests_give_the_same_tokens_as_one_by_one(client: openai.OpenAI) -> None:
    prompts = ["Tell me about the ocean.", "What is 2 + 2?", "Write a haiku about trains.",
               "Name three colors.", "Why is the sky blue?", "Say hello in French."]

    def ask(prompt: str) -> str:
        reply = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=20)
        return reply.choices[0].message.content

    one_by_one = [ask(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, prompts))
    assert together == one_by_one
