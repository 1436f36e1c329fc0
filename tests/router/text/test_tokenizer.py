"""Token ids must be exactly those of the reference (Hugging Face) tokenizers."""

from __future__ import annotations

import asyncio
import random
import re
from pathlib import Path

import pytest

from router.text import ModelText, Tokenizer, read_gguf_metadata
from tests.router.text.corpus import CORPUS

QWEN_IM_START, QWEN_IM_END, QWEN_THINK = 151644, 151645, 151667



def _digit_split_matters(text: str) -> bool:
    # Where transformers' GGUF loader and SmolLM2's real pre-tokenizer disagree
    # (see the hf_smollm2_digits fixture): a whitespace run before a digit, and
    # numerals outside ASCII, which the vocabulary does merge with a space.
    return bool(re.search(r"\s{2,}\d", text)) or any(
        c.isnumeric() and not c.isascii() for c in text)


@pytest.mark.parametrize("text", CORPUS)
def test_smollm2_gguf_matches_its_reference_tokenizer(smollm2_text: ModelText, hf_smollm2_digits,
                                                      text: str) -> None:
    assert smollm2_text.tokenizer.encode(text) == hf_smollm2_digits.encode(
        text, add_special_tokens=False).ids


@pytest.mark.parametrize("text", [t for t in CORPUS if not _digit_split_matters(t)])
def test_smollm2_gguf_matches_transformers_gguf_loader(smollm2_text: ModelText, hf_smollm2,
                                                       text: str) -> None:
    ids = smollm2_text.tokenizer.encode(text)
    assert ids == hf_smollm2.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert smollm2_text.tokenizer.decode(ids, skip_special_tokens=skip) == hf_smollm2.decode(
            ids, skip_special_tokens=skip)


def test_smollm2_isolates_digits_like_llama_cpp(smollm2_text: ModelText) -> None:
    tok = smollm2_text.tokenizer
    assert [tok.id_to_token(i) for i in tok.encode("x  2")] == ["x", "ĠĠ", "2"]
    assert [tok.id_to_token(i) for i in tok.encode(" 12345")] == ["Ġ", "1", "2", "3", "4", "5"]


@pytest.mark.parametrize("text", CORPUS)
def test_qwen3_tokenizer_json_matches_transformers(qwen3_text: ModelText, hf_qwen3,
                                                   text: str) -> None:
    ids = qwen3_text.tokenizer.encode(text)
    assert ids == hf_qwen3.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert qwen3_text.tokenizer.decode(ids, skip_special_tokens=skip) == hf_qwen3.decode(
            ids, skip_special_tokens=skip)


def test_special_tokens_in_text_become_single_ids(qwen3_text: ModelText,
                                                  smollm2_text: ModelText) -> None:
    assert qwen3_text.tokenizer.encode("<|im_start|>user\nhi<|im_end|>") == [
        QWEN_IM_START, 872, 198, 6023, QWEN_IM_END]
    assert qwen3_text.tokenizer.encode("<think>")[0] == QWEN_THINK
    assert smollm2_text.tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[::4] == [1, 2]


def test_special_token_ids_are_the_control_tokens(qwen3_text: ModelText,
                                                  smollm2_text: ModelText) -> None:
    assert smollm2_text.tokenizer.special_token_ids == frozenset(range(17))
    qwen = qwen3_text.tokenizer.special_token_ids
    assert {QWEN_IM_START, QWEN_IM_END, 151643} <= qwen
    assert QWEN_THINK not in qwen  # <think> is an added but not a special token


def test_vocab_and_lookups(qwen3_text: ModelText, hf_qwen3) -> None:
    tok = qwen3_text.tokenizer
    assert tok.vocab_size == len(hf_qwen3) == 151669
    assert tok.token_to_id("<|im_end|>") == QWEN_IM_END
    assert tok.id_to_token(QWEN_IM_END) == "<|im_end|>"
    assert tok.token_to_id("no such token here") is None
    assert tok.id_to_token(10**6) is None


def test_ids_past_the_vocabulary_decode_to_nothing(qwen3_text: ModelText) -> None:
    # Qwen3's embedding has 151,936 rows for 151,669 tokens; random weights pick the rest.
    hello = qwen3_text.tokenizer.encode("Hello")
    assert qwen3_text.tokenizer.decode([*hello, 151900]) == "Hello"


def test_qwen2_gguf_vocabulary_matches_tokenizer_json(qwen2_gguf: Path,
                                                      qwen3_text: ModelText) -> None:
    rebuilt = Tokenizer.from_gguf(read_gguf_metadata(qwen2_gguf))
    reference = qwen3_text.tokenizer
    assert rebuilt.vocab_size == reference.vocab_size
    assert rebuilt.special_token_ids == reference.special_token_ids
    for text in CORPUS:
        assert rebuilt.encode(text) == reference.encode(text), text
    # The NFC normalizer: a decomposed é tokenizes as the composed one.
    assert rebuilt.encode("cafe\u0301") == reference.encode("café")


def test_sentencepiece_gguf_matches_transformers(spm_gguf: Path, hf_spm) -> None:
    tok = Tokenizer.from_gguf(read_gguf_metadata(spm_gguf))
    assert tok.add_bos_token and tok.bos_token_id == 1
    texts = [t.replace("<|im_start|>", "<s>").replace("<|im_end|>", "</s>") for t in CORPUS]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=True)
        assert ids == hf_spm.encode(text), text
        assert tok.decode(ids) == hf_spm.decode(ids, skip_special_tokens=True), text
    # Byte fallback: a character the vocabulary lacks becomes its UTF-8 bytes.
    assert [tok.id_to_token(i) for i in tok.encode("😀")][-4:] == ["<0xF0>", "<0x9F>", "<0x98>",
                                                                  "<0x80>"]


def test_unsupported_gguf_tokenizer_is_named() -> None:
    with pytest.raises(ValueError, match="'bert'"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


def test_unknown_pre_tokenizer_falls_back_to_gpt2(caplog: pytest.LogCaptureFixture) -> None:
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "mystery",
                "tokenizer.ggml.tokens": ["a", "b", "ab", "Ġ"], "tokenizer.ggml.merges": ["a b"]}
    with caplog.at_level("WARNING"):
        tok = Tokenizer.from_gguf(metadata)
    assert "mystery" in caplog.text
    assert tok.encode("ab a") == [2, 3, 0]


def test_encode_async_equals_encode(qwen3_text: ModelText) -> None:
    text = CORPUS[5] * 50

    async def both() -> list[int]:
        return await qwen3_text.tokenizer.encode_async(text)

    assert asyncio.run(both()) == qwen3_text.tokenizer.encode(text)


def test_ids_no_vocabulary_has_decode_to_nothing(qwen3_text: ModelText) -> None:
    # The backend takes 32-bit ids; bigger or negative ones used to raise OverflowError.
    hello = qwen3_text.tokenizer.encode("Hello")
    assert qwen3_text.tokenizer.decode([-1, *hello, 2**40, 2**63]) == "Hello"


def test_long_texts_encode_and_decode_off_the_loop_to_the_same_ids(qwen3_text: ModelText) -> None:
    import asyncio

    tok = qwen3_text.tokenizer
    text = "Long text, 長いテキスト 🙂 <|im_start|> and 12345.\n" * 2000
    ids = tok.encode(text, add_special_tokens=True)
    assert asyncio.run(tok.encode_async(text, add_special_tokens=True)) == ids
    assert len(ids) > 4096  # decoded with decode_batch, which lets go of the GIL
    assert tok.decode(ids, skip_special_tokens=False) == tok.backend.decode(ids, skip_special_tokens=False)


def test_single_ids_decode_as_the_backend_does_every_time(qwen3_text: ModelText) -> None:
    # One id's text is kept after its first decode; it must stay what the backend says,
    # for both skip_special_tokens settings and for ids no vocabulary has.
    tok = qwen3_text.tokenizer
    ids = [0, 198, 151645, 151667, 151900, -1, 2**40, *tok.encode("naïve 東京 🦙")]
    for skip in (True, False):
        for _ in range(2):
            for token_id in ids:
                expected = (tok.backend.decode([token_id], skip_special_tokens=skip)
                            if 0 <= token_id < tok.id_limit else "")
                assert tok.decode([token_id], skip_special_tokens=skip) == expected, token_id
                assert tok.decode((token_id,), skip_special_tokens=skip) == expected, token_id


def test_byte_level_texts_of_whole_characters_concatenate(qwen3_text: ModelText,
                                                          smollm2_text: ModelText,
                                                          spm_gguf: Path) -> None:
    """What Tokenizer.decodes_bytewise promises the detokenizer: ids whose
    texts are whole characters (no U+FFFD) decode together to their texts
    joined, special and out-of-vocabulary ids included."""
    for tok in (qwen3_text.tokenizer, smollm2_text.tokenizer):
        assert tok.decodes_bytewise
        rng = random.Random(0)
        specials = sorted(tok.special_token_ids)
        checked = 0
        while checked < 20_000:
            ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(tok.id_limit + 40)
                   for _ in range(rng.choice((2, 3, 5)))]
            skip = rng.random() < 0.5
            texts = [tok.decode([i], skip_special_tokens=skip) for i in ids]
            if any("\ufffd" in text for text in texts):
                continue
            assert tok.decode(ids, skip_special_tokens=skip) == "".join(texts), ids
            checked += 1
    # A SentencePiece decoder strips the first token's space: not byte-level.
    assert not Tokenizer.from_gguf(read_gguf_metadata(spm_gguf)).decodes_bytewise
