"""The multi-token-prediction (MTP) head of Qwen3-Next and Qwen3.5 checkpoints.

The checkpoints carry, after the decoder, one more layer trained to predict
the token after next (mtp.*; llama.cpp's GGUFs keep it as the last block,
its extra tensors named nextn.*). Position i of the head combines the
target's final hidden state there (after the model's norm) with the
embedding of the token at i + 1:

    x_i = fc([norm_e(embed(t_{i+1})), norm_h(h_i)])      (fc: 2H -> H, no bias)
    g_i = norm(layer(x_i))                                (a full-attention layer)

and lm_head(g_i), with the target's own embedding and lm_head, guesses
t_{i+2}. Its attention layer keeps K/V per position like any other (the
engine gives it a paged pool of its own, indexed by the target's page ids:
engine/sampling/mtp_drafter.py). Drafting further feeds g_i back as the
hidden state of the next position with the guess as its token, as vLLM and
SGLang run these heads. The concatenation order, the zero-centred norms and
the shared embedding follow the published checkpoints' layout; transformers
has no implementation of the head, so tests/engine/test_mtp_head.py checks it
against transformers' own decoder layer and norms assembled the same way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.execution.attention_metadata import AttentionMetadata
from engine.execution.model_ops import ReferenceOps
from engine.models.config import ModelConfig
from engine.models.hybrid_layers import GatedAttention

KVCache = tuple[torch.Tensor, torch.Tensor]

# The prefix of the head's tensors in Hugging Face checkpoints.
MTP_PREFIX = "mtp"


def _weight(*shape: int, device: torch.device | str, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class MTPHead(nn.Module):
    def __init__(self, config: ModelConfig, layer: nn.Module, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        """layer: the head's decoder layer (a HybridLayer with gated full
        attention and the model's kind of MLP), built by the model."""
        super().__init__()
        if config.mtp_layers != 1:
            raise ValueError(f"{config.architecture} has {config.mtp_layers} MTP layers; "
                             "drafting supports checkpoints with exactly one")
        self.config = config
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        hidden = config.hidden_size
        self.fc_weight = _weight(hidden, 2 * hidden, **kw)
        self.embedding_norm_weight = _weight(hidden, **kw)
        self.hidden_norm_weight = _weight(hidden, **kw)
        self.norm_weight = _weight(hidden, **kw)
        self.layer = layer
        assert isinstance(getattr(layer, "mixer", None), GatedAttention), \
            "the MTP layer is a full-attention layer"

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache, embed_tokens: torch.Tensor,
                rope_cache: torch.Tensor, ops: ReferenceOps) -> torch.Tensor:
        """input_ids [N]: the token after each row's position; hidden [N, H]:
        the target's final hidden state at the position (or the head's own
        output there, when drafting further). Writes the layer's K/V at
        meta.slot_mapping and returns the head's output g [N, H]."""
        eps = self.config.rms_norm_eps
        embedded = ops.zero_centred_rms_norm(F.embedding(input_ids, embed_tokens),
                                             self.embedding_norm_weight, eps)
        normed = ops.zero_centred_rms_norm(hidden, self.hidden_norm_weight, eps)
        x = ops.linear(torch.cat([embedded, normed], dim=-1), self.fc_weight)
        out, residual = self.layer(x, None, positions, meta, kv_cache, rope_cache, ops)
        out, _ = ops.add_zero_centred_rms_norm(out, residual, self.norm_weight, eps)
        return out

    def weight_destinations(self, stacked_experts: bool = False) -> dict[str, torch.Tensor]:
        dests = {
            f"{MTP_PREFIX}.fc.weight": self.fc_weight,
            f"{MTP_PREFIX}.pre_fc_norm_embedding.weight": self.embedding_norm_weight,
            f"{MTP_PREFIX}.pre_fc_norm_hidden.weight": self.hidden_norm_weight,
            f"{MTP_PREFIX}.norm.weight": self.norm_weight,
        }
        dests.update(self.layer.weight_destinations(f"{MTP_PREFIX}.layers.0",  # type: ignore[operator]
                                                    stacked_experts))
        return dests
