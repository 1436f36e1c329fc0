"""A rank of a tensor-parallel model and the collectives its forward pass calls.

Every collective is a no-op at world size 1 (it returns its input untouched and
never touches torch.distributed), so the single-device path costs nothing and
gives bit-for-bit the results it gave before tensor parallelism existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.execution.fp8_weight import Fp8Weight
    from engine.execution.model_ops import ReferenceOps
    from engine.execution.quantized_weight import QuantizedWeight

# How long a collective waits for a missing rank before it fails: a dead rank
# must end the others with an error, never leave them hanging.
DEFAULT_TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group. group None: the default
    process group (the only one at world size 1, where it is never used)."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} of a tensor-parallel group of "
                             f"{self.world_size}")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum tensor over the ranks, in place; returns it."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., world_size * n], rank 0's columns first."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=-1)

    def row_parallel_linear(self, ops: ReferenceOps, x: torch.Tensor,
                            weight: torch.Tensor | QuantizedWeight | Fp8Weight,
                            bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T where each rank holds its slice of the inner dimension
        (o_proj, down_proj): the partial products are summed over the ranks.
        The bias goes into rank 0's part only, so it is added once."""
        out = ops.linear(x, weight, bias if self.rank == 0 else None)
        return self.all_reduce(out)

    def vocab_embedding(self, input_ids: torch.Tensor, weight: torch.Tensor,
                        start: int) -> torch.Tensor:
        """Embedding rows of input_ids where this rank holds the rows
        start:start + len(weight) of the table: a rank zeroes the tokens outside
        its slice and the ranks' sum is each token's row (exactly: one term is
        not zero)."""
        if self.world_size == 1:
            return F.embedding(input_ids, weight)
        local = input_ids - start
        outside = (local < 0) | (local >= weight.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return self.all_reduce(hidden)

    def gather_vocab(self, logits: torch.Tensor, per_rank: int, vocab_size: int) -> torch.Tensor:
        """Each rank's [N, its vocab slice] logits -> [N, vocab_size] on every
        rank. Slices are per_rank wide but the last may be narrower (a vocab
        that does not split evenly): it is padded for the gather, then cut."""
        if self.world_size == 1:
            return logits
        if logits.shape[-1] < per_rank:
            logits = F.pad(logits, (0, per_rank - logits.shape[-1]))
        return self.all_gather_last_dim(logits)[..., :vocab_size]


SINGLE_RANK = TensorParallel()


def join_tensor_parallel(init_method: str, rank: int, world_size: int, device: torch.device,
                         timeout: timedelta = DEFAULT_TIMEOUT) -> TensorParallel:
    """Join a group of world_size ranks through torch.distributed's rendezvous
    at init_method (tcp://HOST:PORT, file://PATH or env://): NCCL for CUDA
    devices, gloo for the CPU. The group is the default process group, so a
    process holds one model's ranks."""
    if world_size == 1:
        return SINGLE_RANK
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timeout, **kwargs)
    return TensorParallel(rank, world_size)


def leave_tensor_parallel(tp: TensorParallel) -> None:
    """Destroy the process group join_tensor_parallel made (no-op at world size 1)."""
    if tp.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
