"""Per-model text processing for the router: tokenizer, chat template, streaming detokenization, stop strings.

Pure CPU and metadata-only: nothing here imports torch, cupy, engine/ or kernels/,
and loading a model's text side never reads its weights.
"""

from __future__ import annotations

from protocol.gguf_file import GGUFMetadata, read_gguf_metadata
from router.text.chat_template import ChatTemplate, TemplateError
from router.text.detokenizer import IncrementalDetokenizer
from router.text.model_text import ModelText
from router.text.stop_strings import StopStringMatcher
from router.text.tokenizer import Tokenizer

__all__ = [
    "ChatTemplate",
    "GGUFMetadata",
    "IncrementalDetokenizer",
    "ModelText",
    "StopStringMatcher",
    "TemplateError",
    "Tokenizer",
    "read_gguf_metadata",
]
