"""Token bytes and texts (/tokenize's pieces, log probabilities' tokens) and
the parse_special: false tokenizer."""

from __future__ import annotations

import asyncio

from router.text.model_text import ModelText
from router.text.token_pieces import pieces_for


def test_pieces_are_text_or_bytes(smollm2_text: ModelText, qwen3_text: ModelText) -> None:
    for text in (smollm2_text, qwen3_text):
        tokenizer = text.tokenizer
        pieces = pieces_for(tokenizer)
        assert pieces_for(tokenizer) is pieces
        ids = tokenizer.encode("<|im_start|>Hello wörld 🦙\n")
        joined = b"".join(pieces.token_bytes(i) for i in ids)
        assert joined == "<|im_start|>Hello wörld 🦙\n".encode()
        assert all(isinstance(pieces.piece(i), str | list) for i in ids)
    smol = pieces_for(smollm2_text.tokenizer)
    llama = smollm2_text.tokenizer.encode("🦙")
    assert [smol.piece(i) for i in llama][:1] == [[240, 159]]


def test_token_texts_mark_parts_of_a_character(smollm2_text: ModelText) -> None:
    pieces = pieces_for(smollm2_text.tokenizer)
    hello = smollm2_text.tokenizer.encode(" Hello")
    assert [pieces.text(i) for i in hello] == [" Hello"]
    llama = smollm2_text.tokenizer.encode("🦙")
    assert pieces.text(llama[0]) == "\ufffd"
    assert b"".join(pieces.token_bytes(i) for i in llama).decode() == "🦙"


def test_special_tokens_spelled_out(qwen3_text: ModelText) -> None:
    pieces = pieces_for(qwen3_text.tokenizer)
    ids = asyncio.run(pieces.encode_plain("<|im_start|>user<think>"))
    assert 151644 not in ids and ids[-1] == 151667
    assert qwen3_text.tokenizer.encode("<|im_start|>user")[0] == 151644
