"""Reference tokenizers (transformers') and synthetic GGUF files for the router.text tests (built once per session;
hf_smollm2 is in tests/conftest.py, shared with the engine tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def hf_smollm2_digits(hf_smollm2):
    """transformers' GGUF tokenizer with SmolLM2's real pre-tokenizer.

    transformers ignores tokenizer.ggml.pre = "smollm" and splits with the plain
    GPT-2 regex. SmolLM2's own tokenizer.json, and llama.cpp's "smollm" type,
    first isolate every digit; that changes "  2" (one "  " token, then "2").
    """
    import tokenizers
    from tokenizers import pre_tokenizers

    backend = tokenizers.Tokenizer.from_str(hf_smollm2.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return backend


@pytest.fixture(scope="session")
def hf_qwen3(qwen3_tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)


@pytest.fixture(scope="session")
def qwen2_gguf(qwen3_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tensorless GGUF carrying Qwen3's vocabulary the way llama.cpp's converter writes it."""
    import gguf

    data = json.loads((qwen3_tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    size = len(vocab) + len(data["added_tokens"])
    tokens = [""] * size
    types = [1] * size  # NORMAL
    for token, token_id in vocab.items():
        tokens[token_id] = token
    for added in data["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added["special"] else 4  # CONTROL / USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    path = tmp_path_factory.mktemp("qwen2-gguf") / "qwen-tokenizer.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_context_length(40960)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(151643)
    writer.add_eos_token_id(151645)
    writer.add_eot_token_id(151643)
    writer.add_add_bos_token(False)
    _finish(writer)
    return path


@pytest.fixture(scope="session")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tensorless GGUF with a small SentencePiece-style BPE vocabulary (scores, byte fallback).

    No SentencePiece model is available offline, so one is trained here on
    source text: merges in training order become descending scores, as
    SentencePiece stores them.
    """
    import gguf
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    base = tokenizers.Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=3000, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>", *byte_tokens])
    import argparse
    import textwrap

    lines = [line for module in (json, argparse, textwrap)
             for line in Path(module.__file__).read_text(encoding="utf-8").splitlines()]
    base.train_from_iterator(lines, trainer)
    vocab = base.get_vocab()
    tokens = [""] * len(vocab)
    for token, token_id in vocab.items():
        tokens[token_id] = token
    fixed = 3 + len(byte_tokens)
    types = [2, 3, 3] + [6] * len(byte_tokens) + [1] * (len(tokens) - fixed)  # UNKNOWN CONTROL BYTE NORMAL
    scores = [0.0] * fixed + [-float(rank) for rank in range(len(tokens) - fixed)]
    path = tmp_path_factory.mktemp("spm-gguf") / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(4096)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)
    _finish(writer)
    return path


@pytest.fixture(scope="session")
def hf_spm(spm_gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spm_gguf.parent, gguf_file=spm_gguf.name)


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
