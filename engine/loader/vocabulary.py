"""Whether two checkpoints share a vocabulary: a draft model's tokens must
mean what the target's mean (engine/sampling/draft_model.py), or its guesses
are noise at best and out-of-range ids at worst.

The token strings come from the checkpoint itself: tokenizer.json beside a
Hugging Face model, tokenizer.ggml.tokens in a GGUF file. Embedding tables
are often padded past the tokenizer's last token (Qwen's 151,936 rows hold
151,669 tokens), and family members pad differently (Qwen2.5-0.5B and -7B),
so when both token lists are known they decide; only without them must the
embedding sizes agree.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.loader import Checkpoint, open_checkpoint
from engine.loader.gguf_weights import GGUFCheckpoint


def token_strings(checkpoint: Checkpoint) -> dict[int, str] | None:
    """The checkpoint's tokens by id, or None when it carries no tokenizer
    we can read (the embedding size then stands for the vocabulary)."""
    if isinstance(checkpoint, GGUFCheckpoint):
        # Read when the checkpoint was opened: the GGUF is not parsed again.
        tokens = checkpoint.metadata().get("tokenizer.ggml.tokens")
        return dict(enumerate(tokens)) if tokens is not None else None
    tokenizer = checkpoint.path / "tokenizer.json"
    if not tokenizer.is_file():
        return None
    data = json.loads(tokenizer.read_text(encoding="utf-8"))
    vocab = data.get("model", {}).get("vocab")
    if isinstance(vocab, dict):  # BPE, WordPiece: token -> id
        tokens = {int(index): token for token, index in vocab.items()}
    elif isinstance(vocab, list):  # Unigram: [token, score] in id order
        tokens = {index: entry[0] for index, entry in enumerate(vocab)}
    else:
        return None
    for added in data.get("added_tokens", []):
        tokens[int(added["id"])] = added["content"]
    return tokens


def vocabulary_mismatch(target: Path, draft: Path) -> str | None:
    """Why draft cannot draft for target (what differs), or None when their
    vocabularies agree."""
    # Each file opened once: its config and its tokens come from the one read.
    target_checkpoint, draft_checkpoint = open_checkpoint(target), open_checkpoint(draft)
    target_size = target_checkpoint.config.vocab_size
    draft_size = draft_checkpoint.config.vocab_size
    target_tokens = token_strings(target_checkpoint)
    draft_tokens = token_strings(draft_checkpoint)
    if target_tokens is None or draft_tokens is None:
        if target_size != draft_size:
            return (f"vocabulary sizes differ: {target_size} tokens against {draft_size} "
                    "(and no tokenizer to compare the tokens themselves)")
        return None
    if len(target_tokens) != len(draft_tokens):
        return (f"the tokenizers differ: {len(target_tokens)} tokens against "
                f"{len(draft_tokens)} (embedding sizes {target_size} and {draft_size})")
    for index in sorted(target_tokens):
        if draft_tokens.get(index) != target_tokens[index]:
            return (f"the tokenizers differ: token {index} is {target_tokens[index]!r} in the "
                    f"target and {draft_tokens.get(index)!r} in the draft")
    return None


def check_same_vocabulary(target: Path, draft: Path) -> None:
    """Raise ValueError naming both models and what differs, unless draft's
    vocabulary is target's."""
    why = vocabulary_mismatch(target, draft)
    if why is not None:
        raise ValueError(f"--draft-model {draft} cannot draft for {target}: {why}; a draft "
                         "model must share the target's vocabulary (the same tokenizer)")
