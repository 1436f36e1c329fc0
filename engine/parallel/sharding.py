"""Which part of each checkpoint tensor a tensor-parallel rank holds.

A dense decoder (Llama, Qwen2, Qwen3) splits as Megatron-LM laid out:
- q heads evenly across ranks; KV heads too where there are at least as many
  as ranks, else each KV head is replicated on the ranks whose q heads read
  it (as vLLM does), so every rank keeps whole heads and attends alone;
- the fused qkv and gate_up projections by output rows (column-parallel),
  each of q, k, v (gate, up) sliced on its own; o_proj and down_proj by input
  columns (row-parallel), their products summed over the ranks;
- embedding and lm_head by vocabulary rows, contiguous slices of
  ceil(vocab / world) rows (the last rank's may be shorter).
Norms, q/k norms and o_proj's bias are whole on every rank.

The rank's view of the config (ShardPlan.config) has its head counts and MLP
size, so the modules, the attention ops and the KV cache sizing read fewer
heads without knowing about ranks; its vocab_size stays whole: that is the
width of the logits after the gather.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.parallel.tensor_parallel import TensorParallel

if TYPE_CHECKING:  # engine.models imports this module
    from engine.models.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """length entries from start, of total along one dimension of a tensor."""

    start: int
    length: int
    total: int

    @classmethod
    def whole(cls, total: int) -> Shard:
        return cls(0, total, total)

    @property
    def is_whole(self) -> bool:
        return self.length == self.total


@dataclass(frozen=True)
class ShardedSlot:
    """A weight slot that takes part of its checkpoint tensor: the entries
    shard names along dim."""

    slot: torch.Tensor
    dim: int
    shard: Shard

    @property
    def checkpoint_shape(self) -> tuple[int, ...]:
        shape = list(self.slot.shape)
        shape[self.dim] = self.shard.total
        return tuple(shape)

    def fill(self, tensor: torch.Tensor) -> None:
        self.slot.copy_(tensor.narrow(self.dim, self.shard.start, self.shard.length))


# A weight_destinations() value: a whole slot, or one taking part of its tensor.
Destination = torch.Tensor | ShardedSlot


def sharded(slot: torch.Tensor, dim: int, shard: Shard) -> Destination:
    """The destination of a slot holding shard of its checkpoint tensor: the
    slot itself where it is whole (always at world size 1)."""
    return slot if shard.is_whole else ShardedSlot(slot, dim, shard)


@dataclass(frozen=True)
class ShardPlan:
    """What one rank holds of a dense decoder: its config view and the
    checkpoint rows of each split tensor."""

    tp: TensorParallel
    config: ModelConfig  # the rank's view (the checkpoint's at world size 1)
    q_rows: Shard  # of q_proj (and o_proj's columns)
    kv_rows: Shard  # of k_proj and v_proj
    mlp_rows: Shard  # of gate_proj and up_proj (and down_proj's columns)
    vocab_rows: Shard  # of embed_tokens and lm_head

    @classmethod
    def of(cls, config: ModelConfig, tp: TensorParallel) -> ShardPlan:
        """The plan of tp.rank; ValueError naming what does not split."""
        check_tensor_parallel(config, tp)
        world, rank, dim = tp.world_size, tp.rank, config.head_dim
        heads = config.num_heads // world
        kv_heads = max(config.num_kv_heads // world, 1)
        # The first KV head this rank's q heads read (whole heads either way).
        first_kv = rank * config.num_kv_heads // world
        inter = config.intermediate_size // world
        per_rank = vocab_per_rank(config.vocab_size, world)
        vocab_start = rank * per_rank
        view = config if world == 1 else dataclasses.replace(
            config, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=inter)
        return cls(
            tp=tp,
            config=view,
            q_rows=Shard(rank * heads * dim, heads * dim, config.q_size),
            kv_rows=Shard(first_kv * dim, kv_heads * dim, config.kv_size),
            mlp_rows=Shard(rank * inter, inter, config.intermediate_size),
            vocab_rows=Shard(vocab_start, min(per_rank, config.vocab_size - vocab_start),
                             config.vocab_size),
        )

    @property
    def vocab_per_rank(self) -> int:
        return vocab_per_rank(self.vocab_rows.total, self.tp.world_size)


def vocab_per_rank(vocab_size: int, world_size: int) -> int:
    return -(-vocab_size // world_size)


def check_tensor_parallel(config: ModelConfig, tp: TensorParallel) -> None:
    """ValueError, saying what to do, where config cannot be split across tp's ranks."""
    world = tp.world_size
    if world == 1:
        return
    kind = _unsupported_kind(config)
    if kind is not None:
        raise ValueError(f"tensor parallelism is not supported yet for {kind} models "
                         f"({config.architecture}); serve it on one device")
    problems = []
    if config.num_heads % world:
        problems.append(f"{config.num_heads} attention heads are not a multiple of {world}")
    kv = config.num_kv_heads
    if (kv >= world and kv % world) or (kv < world and world % kv):
        problems.append(f"{kv} KV heads neither split evenly over {world} ranks nor "
                        "replicate evenly on them")
    if config.intermediate_size % world:
        problems.append(f"MLP size {config.intermediate_size} is not a multiple of {world}")
    if vocab_per_rank(config.vocab_size, world) * (world - 1) >= config.vocab_size:
        problems.append(f"a {config.vocab_size}-token vocabulary leaves a rank no slice")
    if problems:
        raise ValueError(f"{config.architecture} does not split across {world} tensor-parallel "
                         f"ranks: {'; '.join(problems)}; choose a tensor-parallel size that "
                         "divides its head counts and MLP size")


def _unsupported_kind(config: ModelConfig) -> str | None:
    if config.moe is not None:
        return "mixture-of-experts"
    if config.layer_types or config.linear_attention is not None:
        return "hybrid (linear-attention)"
    if config.mrope_section:
        return "vision-language"
    return None
