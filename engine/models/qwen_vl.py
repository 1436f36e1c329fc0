"""Qwen2.5-VL and Qwen3-VL: the text side of the vision-language models.

Their language models are our Qwen2 (q/k/v biases) and Qwen3 (q/k norms)
decoders; what differs is multimodal RoPE (engine/models/mrope.py), whose
layout the config names, and the image embeddings a prefill step places at
the image tokens (engine/models/multimodal_inputs.py). The vision towers
are loaded and run elsewhere (engine/models/vision/); the text loader skips
their tensors (engine/loader/hf_weights.py is_vision_tensor).

llama.cpp's text GGUFs of these models ("qwen2vl", "qwen3vl") hold the plain
Qwen2 / Qwen3 tensors and name the sections in <arch>.rope.dimension_sections,
four entries (t, h, w and a fourth axis these models leave at 0); qwen3vl's
sections interleave, as its rope type (IMROPE) says.
"""

from __future__ import annotations

from typing import Any

from engine.models.config import hf_mrope_section
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM


class _MultimodalRotary:
    """The multimodal RoPE fields both families read from a config.json or
    a llama.cpp GGUF: their sections, and whether the axes interleave."""

    # transformers' sections when a config names none.
    default_mrope_section: tuple[int, int, int]
    mrope_interleaved: bool

    @classmethod
    def hf_multimodal(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        section = hf_mrope_section(cfg) or cls.default_mrope_section
        return {"mrope_section": section, "mrope_interleaved": cls.mrope_interleaved}

    @classmethod
    def gguf_multimodal(cls, meta: Any) -> dict[str, Any]:
        return {"mrope_section": gguf_mrope_section(meta),
                "mrope_interleaved": cls.mrope_interleaved}


class Qwen2_5_VLForConditionalGeneration(_MultimodalRotary, Qwen2ForCausalLM):
    # Qwen2-VL's text GGUFs say qwen2vl too: the same decoder and sections.
    gguf_architecture = "qwen2vl"
    default_mrope_section = (16, 24, 24)
    mrope_interleaved = False


class Qwen3VLForConditionalGeneration(_MultimodalRotary, Qwen3ForCausalLM):
    gguf_architecture = "qwen3vl"
    default_mrope_section = (24, 20, 20)
    # transformers' Qwen3-VL always interleaves the axes (its configs say
    # mrope_interleaved: true; the modeling code does not read the flag).
    mrope_interleaved = True


def gguf_mrope_section(meta: Any) -> tuple[int, ...]:
    """The (t, h, w) sections of <arch>.rope.dimension_sections (meta:
    config._GGUFFields); a fourth section other than 0 is a layout we do not
    serve."""
    key = f"{meta.architecture}.rope.dimension_sections"
    sections = [int(n) for n in meta.get(key)]
    if len(sections) < 3 or any(sections[3:]):
        raise ValueError(f"GGUF {key} is {sections}; three sections (t, h, w), then zeros, "
                         "are supported")
    return tuple(sections[:3])
