"""Qwen2.5-VL and Qwen3-VL: the text side of the vision-language models.

Their language models are our Qwen2 (q/k/v biases) and Qwen3 (q/k norms)
decoders; what differs is multimodal RoPE (engine/models/mrope.py), whose
layout the config names, and the image embeddings a prefill step places at
the image tokens (engine/models/multimodal_inputs.py). The vision towers
are loaded and run elsewhere (engine/models/vision/); the text loader skips
their tensors (engine/loader/hf_weights.py is_vision_tensor).
"""

from __future__ import annotations

from typing import Any

from engine.models.config import hf_mrope_section
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    # llama.cpp ships these as "qwen2vl" GGUFs, not read yet; None also keeps
    # the "qwen2" GGUF architecture mapped to Qwen2ForCausalLM.
    gguf_architecture = None

    @classmethod
    def hf_multimodal(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        # transformers' default when the config names no sections.
        section = hf_mrope_section(cfg) or (16, 24, 24)
        return {"mrope_section": section, "mrope_interleaved": False}


class Qwen3VLForConditionalGeneration(Qwen3ForCausalLM):
    gguf_architecture = None

    @classmethod
    def hf_multimodal(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        # transformers' Qwen3-VL always interleaves the axes (its configs say
        # mrope_interleaved: true; the modeling code does not read the flag).
        section = hf_mrope_section(cfg) or (24, 20, 20)
        return {"mrope_section": section, "mrope_interleaved": True}
