"""Log probabilities in OpenAI's shapes: Chat's content entries, Completions'
parallel lists, and JSON-safe values."""

from __future__ import annotations

import json
import math

import msgspec
import pytest

from protocol import TokenLogprobs
from router.errors import InvalidRequest
from router.openai.logprobs import (
    ChatLogprobs,
    CompletionLogprobs,
    TokenTexts,
    joined,
    json_logprob,
)
from router.openai.params import chat_logprobs, completion_logprobs
from router.openai.schemas import ChatCompletionRequest, CompletionRequest
from router.text.model_text import ModelText
from router.text.token_pieces import pieces_for

LLAMA = "🦙"  # three SmolLM2 tokens, none a whole character


def test_values_json_cannot_carry_become_openais_floor() -> None:
    assert json_logprob(-math.inf) == -9999.0
    assert json_logprob(math.nan) == -9999.0
    assert json_logprob(-0.25) == -0.25
    json.dumps(json_logprob(-math.inf), allow_nan=False)


def test_chat_entries_hold_text_bytes_and_alternatives(smollm2_text: ModelText) -> None:
    texts = TokenTexts(pieces_for(smollm2_text.tokenizer))
    ids = smollm2_text.tokenizer.encode(LLAMA)
    scored = [TokenLogprobs(-0.5, [ids[0], 11], [-0.5, -math.inf]), TokenLogprobs(-1.0),
              TokenLogprobs(-2.0)]
    entries = ChatLogprobs(texts).entries([*ids, 2], scored)  # a hidden stop token runs past
    assert len(entries) == 3
    # A part of a character reads as U+FFFD; its bytes join into the character.
    assert [e["token"] for e in entries] == ["\ufffd"] * 3
    assert bytes(b for e in entries for b in e["bytes"]).decode() == LLAMA
    assert entries[0]["top_logprobs"][1] == {"token": texts.text(11), "logprob": -9999.0,
                                             "bytes": list(texts.of(11)[1])}
    assert entries[1]["top_logprobs"] == []
    assert ChatLogprobs.body(entries) == {"content": entries, "refusal": None}


def test_completion_lists_with_an_echoed_prompt(smollm2_text: ModelText) -> None:
    texts = TokenTexts(pieces_for(smollm2_text.tokenizer))
    the, capital, of = smollm2_text.tokenizer.encode("The capital of")
    logprobs = CompletionLogprobs(texts)
    prompt = logprobs.prompt_part([the, capital], [TokenLogprobs(-3.0, [of], [-1.0])])
    logprobs.restart_at(len("The capital"))
    generated = logprobs.part([of], [TokenLogprobs(-0.5, [of, the], [-0.5, -2.0])])
    whole = joined([prompt, generated])
    assert whole == {
        "tokens": ["The", " capital", " of"],
        "token_logprobs": [None, -3.0, -0.5],
        # The chosen token and the most likely ones: up to N + 1 entries.
        "top_logprobs": [None, {" capital": -3.0, " of": -1.0}, {" of": -0.5, "The": -2.0}],
        "text_offset": [0, 3, 11],
    }


def test_text_offsets_count_characters_a_split_one_once(smollm2_text: ModelText) -> None:
    texts = TokenTexts(pieces_for(smollm2_text.tokenizer))
    ids = smollm2_text.tokenizer.encode(LLAMA + " and é")
    part = CompletionLogprobs(texts).part(ids, [TokenLogprobs(-1.0)] * len(ids))
    text = LLAMA + " and é"
    # The llama's three tokens start where it does; the next token after it.
    assert part["text_offset"] == [0, 0, 0, 1, 5]
    assert text[1:5] == " and" and text[5:] == " é"


def chat(**fields: object) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)


def test_chat_logprobs_fields() -> None:
    assert chat_logprobs(chat()) == -1
    assert chat_logprobs(chat(logprobs=False, top_logprobs=0)) == -1
    assert chat_logprobs(chat(logprobs=True)) == 0
    assert chat_logprobs(chat(logprobs=True, top_logprobs=20)) == 20
    for fields in ({"logprobs": True, "top_logprobs": 21}, {"logprobs": True, "top_logprobs": -1},
                   {"top_logprobs": 3}, {"logprobs": False, "top_logprobs": 1}):
        with pytest.raises(InvalidRequest) as caught:
            chat_logprobs(chat(**fields))
        assert caught.value.param == "top_logprobs", fields


def test_completion_logprobs_field() -> None:
    def ask(value: object) -> int:
        return completion_logprobs(msgspec.json.decode(
            json.dumps({"prompt": "x", "logprobs": value}), type=CompletionRequest))

    assert [ask(None), ask(0), ask(5)] == [-1, 0, 5]
    for value in (6, -1):
        with pytest.raises(InvalidRequest) as caught:
            ask(value)
        assert caught.value.param == "logprobs"
