"""Streaming detokenization must add up to decode(all ids), with no broken characters on the way."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from router.text import IncrementalDetokenizer, ModelText, Tokenizer, read_gguf_metadata
from tests.router.text.corpus import CORPUS

LONG_TEXT = "\n".join(CORPUS) * 3


def _stream(tokenizer: Tokenizer, ids: Sequence[int], *, prompt: Sequence[int] = (),
            skip_special_tokens: bool = True, step: int = 1) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    pieces = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    pieces.append(detok.flush())
    return pieces, detok


@pytest.fixture(scope="module", params=["smollm2", "qwen3"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    model: ModelText = request.getfixturevalue(f"{request.param}_text")
    return model.tokenizer


@pytest.mark.parametrize("text", [t for t in CORPUS if t] + [LONG_TEXT])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_token_by_token_equals_decode(tokenizer: Tokenizer, text: str,
                                      skip_special_tokens: bool) -> None:
    ids = tokenizer.encode(text)
    pieces, detok = _stream(tokenizer, ids, skip_special_tokens=skip_special_tokens)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(pieces) == expected == detok.text
    assert not any("\ufffd" in piece for piece in pieces), pieces
    assert detok.num_tokens == len(ids)


def test_multibyte_characters_split_across_tokens_are_held(qwen3_text: ModelText) -> None:
    tok = qwen3_text.tokenizer
    ids = tok.encode("ok 🦙 done")
    # The emoji is spread over tokens that each hold part of its 4 bytes.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces, _ = _stream(tok, ids)
    assert "".join(pieces) == "ok 🦙 done"
    assert any("🦙" in piece for piece in pieces)
    assert "" in pieces[:-1]  # a step that completed nothing emitted nothing


@pytest.mark.parametrize("step", [2, 3, 7])
def test_steps_of_several_tokens(tokenizer: Tokenizer, step: int) -> None:
    ids = tokenizer.encode(LONG_TEXT)
    pieces, _ = _stream(tokenizer, ids, step=step)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_prompt_context_does_not_leak_into_the_output(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("<|im_start|>user\n你好 😀<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode("Hi! 世界 🎉")
    pieces, detok = _stream(tokenizer, ids, prompt=prompt)
    assert detok.text == "".join(pieces) == "Hi! 世界 🎉"


def test_special_tokens_skipped_or_kept(qwen3_text: ModelText) -> None:
    tok = qwen3_text.tokenizer
    ids = tok.encode("<think>\nhmm\n</think>\n\nAnswer<|im_end|>")
    kept, _ = _stream(tok, ids, skip_special_tokens=False)
    skipped, _ = _stream(tok, ids, skip_special_tokens=True)
    assert "".join(kept) == "<think>\nhmm\n</think>\n\nAnswer<|im_end|>"
    # <think> is an added, not a special, token: it stays either way.
    assert "".join(skipped) == "<think>\nhmm\n</think>\n\nAnswer"


def test_invalid_bytes_come_out_eventually(qwen3_text: ModelText) -> None:
    tok = qwen3_text.tokenizer
    lone_bytes = [i for i in range(256) if tok.decode([i]) == "\ufffd"]  # e.g. 0x80 alone
    assert lone_bytes
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.add([lone_bytes[0]]) for _ in range(40))
    # Never valid UTF-8: it must not be held forever (the window would grow without bound).
    assert out.count("\ufffd") >= 20
    assert out + detok.flush() == tok.decode([lone_bytes[0]] * 40)


@pytest.mark.parametrize("step", [1, 3])
def test_each_step_decodes_a_bounded_window(qwen3_text: ModelText, step: int) -> None:
    class CountingTokenizer:
        def __init__(self, inner: Tokenizer) -> None:
            self.inner = inner
            self.longest = 0

        def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
            self.longest = max(self.longest, len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    counting = CountingTokenizer(qwen3_text.tokenizer)
    ids = qwen3_text.tokenizer.encode(LONG_TEXT * 4)
    assert len(ids) > 2000
    pieces, _ = _stream(counting, ids, prompt=ids[:100], step=step)  # type: ignore[arg-type]
    assert "".join(pieces) == qwen3_text.tokenizer.decode(ids)
    assert counting.longest <= 8 + 2 * step


def test_sentencepiece_leading_spaces(spm_gguf: Path) -> None:
    tok = Tokenizer.from_gguf(read_gguf_metadata(spm_gguf))
    for text in ("Hello world, this is a test", "  two leading spaces", "tab\tand 😀 emoji"):
        ids = tok.encode(text)
        pieces, _ = _stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids)
        assert not any("\ufffd" in piece for piece in pieces)
    # Decoding tokens one by one would strip every word's space; the window keeps them.
    prompt = tok.encode("Say:", add_special_tokens=True)
    ids = tok.encode("Say: import json")[len(prompt) - 1:]
    _, detok = _stream(tok, ids, prompt=prompt)
    assert detok.text == " import json"


def test_random_streams_match_decode(qwen3_text: ModelText) -> None:
    # Random token ids, as random weights produce: any byte sequence, valid or not.
    tok = qwen3_text.tokenizer
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(151700) for _ in range(rng.randrange(1, 60))]
        pieces, _ = _stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids)


class _WindowOnly:
    """The same tokenizer without decodes_bytewise: every step decodes its window."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_the_byte_level_shortcut_emits_what_the_window_would(tokenizer: Tokenizer) -> None:
    """Piece for piece, the one-token shortcut of byte-level tokenizers changes
    nothing: random ids (split characters, invalid bytes, special tokens, ids
    past the vocabulary), steps of one to three tokens, random prompts."""
    assert tokenizer.decodes_bytewise
    rng = random.Random(1)
    specials = sorted(tokenizer.special_token_ids)
    text_ids = tokenizer.encode(LONG_TEXT)
    for _ in range(150):
        if rng.random() < 0.5:
            start = rng.randrange(len(text_ids) - 80)
            ids = text_ids[start:start + rng.randrange(1, 80)]
        else:
            ids = [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(tokenizer.id_limit + 20)
                   for _ in range(rng.randrange(1, 60))]
        prompt = [rng.randrange(tokenizer.id_limit) for _ in range(rng.randrange(0, 8))]
        skip = rng.random() < 0.5
        fast = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
        slow = IncrementalDetokenizer(_WindowOnly(tokenizer), prompt,  # type: ignore[arg-type]
                                      skip_special_tokens=skip)
        at = 0
        while at < len(ids):
            step = ids[at:at + rng.choice((1, 1, 1, 2, 3))]
            at += len(step)
            assert fast.add(step) == slow.add(step), (ids, at)
        assert fast.flush() == slow.flush()
        assert fast.text == slow.text and fast.num_tokens == slow.num_tokens
