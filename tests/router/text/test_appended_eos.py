"""The token a tokenizer's own configuration appends to a text (an embedding
model's EOS): embeddings read it, /tokenize and generation never add it."""

from __future__ import annotations

from pathlib import Path

import tokenizers
from tokenizers import processors

from router.text import ModelText, Tokenizer, read_gguf_metadata

ENDOFTEXT = 151643


def test_a_post_processor_that_appends_eos_is_found(qwen3_text: ModelText) -> None:
    assert qwen3_text.tokenizer.appended_eos_id is None  # Qwen3's own appends nothing
    # A copy: the fixture's tokenizer stays as it is.
    backend = tokenizers.Tokenizer.from_str(qwen3_text.tokenizer.backend.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", ENDOFTEXT)])
    tokenizer = Tokenizer._from_hf_backend(backend, {})
    assert tokenizer.appended_eos_id == ENDOFTEXT
    assert tokenizer.encode("hello", add_special_tokens=True)[-1:] != [ENDOFTEXT]
    # One put in front (BOS) is not an appended one.
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", ENDOFTEXT)])
    assert Tokenizer._from_hf_backend(backend, {}).appended_eos_id is None


def test_llama_cpps_add_eos_token(qwen2_gguf: Path) -> None:
    metadata = dict(read_gguf_metadata(qwen2_gguf))
    assert Tokenizer.from_gguf(metadata).appended_eos_id is None
    metadata.update({"tokenizer.ggml.add_eos_token": True, "tokenizer.ggml.eos_token_id": ENDOFTEXT})
    assert Tokenizer.from_gguf(metadata).appended_eos_id == ENDOFTEXT
