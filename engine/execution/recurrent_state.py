"""The recurrent state of a hybrid model's linear-attention layers, on the device.

A Gated DeltaNet layer (Qwen3-Next, Qwen3.5) carries, per sequence, a short
convolution state and a float32 state matrix per value head instead of a
growing KV cache. The pools hold `rows` of each, one row a sequence's state
at one point:

- rows 0 .. lanes-1: the running sequences', one per lane (llama.cpp's slot,
  engine/scheduling/lanes.py); a lane's row is its sequence's state as far as
  the steps launched so far have computed it;
- rows lanes .. lanes+checkpoints-1: state checkpoints
  (engine/kv/state_checkpoints.py), copies of a lane's row at a known token
  prefix, from which a later request with that prefix resumes instead of
  computing it again;
- under speculative decoding, one backup row per lane after those: a lane's
  state before a step that verifies its drafts, put back when a draft is
  rejected (engine/scheduling/scheduler.py).

With a host tier, host_rows more rows in host memory (page-locked on CUDA)
hold the checkpoints that made room on the device. Rows are copied between
lanes, checkpoints and the host on the device's stream, in step order
(copy_rows), so a copy sees exactly the steps launched before it. The model
reads its layer's pools through layer(index) (HybridCausalLM).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.kv.state_checkpoints import RowCopy
from engine.models.config import ModelConfig

# The recurrent state accumulates decays and delta updates over the whole
# sequence: float32, as transformers and FLA keep it.
STATE_DTYPE = torch.float32


def state_row_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one row (one sequence's state) over all linear-attention layers."""
    dims = config.linear_attention
    if dims is None:
        return 0
    layers = sum(1 for layer in range(config.num_layers) if config.is_linear_attention(layer))
    conv = dims.conv_channels * (dims.conv_kernel_size - 1) * dtype.itemsize
    state = dims.num_value_heads * dims.key_head_dim * dims.value_head_dim * STATE_DTYPE.itemsize
    return layers * (conv + state)


class RecurrentStatePools:
    def __init__(self, config: ModelConfig, *, lanes: int, checkpoints: int,
                 device: torch.device, dtype: torch.dtype, backups: bool = False,
                 host_rows: int = 0) -> None:
        dims = config.linear_attention
        assert dims is not None, "recurrent state pools are for hybrid models"
        self.lanes = lanes
        self.checkpoints = checkpoints
        # The first backup row (-1: none).
        self.backup_row = lanes + checkpoints if backups else -1
        self.rows = lanes + checkpoints + (lanes if backups else 0)
        self.device = device
        self.dtype = dtype
        self.linear_layers = [layer for layer in range(config.num_layers)
                              if config.is_linear_attention(layer)]
        self._conv_shape = dims.conv_state_shape(self.rows)
        self._state_shape = dims.state_shape(self.rows)
        self.conv: list[torch.Tensor] = []
        self.states: list[torch.Tensor] = []
        self._allocate()
        self._host: list[torch.Tensor] | None = None  # while asleep
        self._dims = dims
        self.allocate_host(host_rows)

    def allocate_host(self, rows: int) -> None:
        """Host checkpoint rows (the host tier's share): host memory, so they
        stay through a sleep; page-locked on CUDA."""
        self.host_rows = rows
        pin = self.device.type == "cuda" and rows > 0
        self.host_conv = [torch.zeros(self._dims.conv_state_shape(rows), dtype=self.dtype,
                                      pin_memory=pin) for _ in self.linear_layers]
        self.host_states = [torch.zeros(self._dims.state_shape(rows), dtype=STATE_DTYPE,
                                        pin_memory=pin) for _ in self.linear_layers]

    def _allocate(self) -> None:
        # Zeros, so a row never read before it is written is still finite.
        self.conv = [torch.zeros(self._conv_shape, dtype=self.dtype, device=self.device)
                     for _ in self.linear_layers]
        self.states = [torch.zeros(self._state_shape, dtype=STATE_DTYPE, device=self.device)
                       for _ in self.linear_layers]
        self._by_layer = {layer: (conv, state) for layer, conv, state
                          in zip(self.linear_layers, self.conv, self.states, strict=True)}

    @property
    def nbytes(self) -> int:
        """Device bytes (host rows apart: host_nbytes)."""
        return sum(t.numel() * t.element_size() for t in (*self.conv, *self.states))

    @property
    def host_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.host_conv, *self.host_states))

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.rows

    def checkpoint_row(self, index: int) -> int:
        """The pool row of checkpoint index (0 .. checkpoints-1)."""
        assert 0 <= index < self.checkpoints
        return self.lanes + index

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv_states [rows, C, K-1], states [rows, Hv, Dk, Dv]) of a linear-attention layer."""
        return self._by_layer[index]

    @torch.no_grad()
    def copy_rows(self, copies: Sequence[RowCopy]) -> None:
        """Copy rows src -> dst, in order (a row written by an earlier copy is
        read as written), on the current stream: after the steps launched
        before, before those launched after."""
        # In order, one gather/scatter per run of device copies that do not
        # depend on each other (the common case: all of them); a copy to or
        # from the host goes alone.
        batch: list[tuple[int, int]] = []
        written: set[int] = set()
        for copy in copies:
            if copy.src_host or copy.dst_host:
                self._copy(batch)
                batch, written = [], set()
                self._copy_host(copy)
                continue
            if copy.src in written or copy.dst in written:
                self._copy(batch)
                batch, written = [], set()
            batch.append((copy.src, copy.dst))
            written.add(copy.dst)
        self._copy(batch)

    def _copy_host(self, copy: RowCopy) -> None:
        # Page-locked rows: asynchronous, ordered on the stream like the rest.
        pin = self.device.type == "cuda"
        pairs = zip((*self.conv, *self.states), (*self.host_conv, *self.host_states), strict=True)
        for device_pool, host_pool in pairs:
            if copy.dst_host:
                host_pool[copy.dst].copy_(device_pool[copy.src], non_blocking=pin)
            else:
                device_pool[copy.dst].copy_(host_pool[copy.src], non_blocking=pin)

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64).to(self.device,
                                                                       non_blocking=True)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64).to(self.device,
                                                                       non_blocking=True)
        for pool in (*self.conv, *self.states):
            pool.index_copy_(0, dst, pool.index_select(0, src))

    # ---- sleep and wake ----------------------------------------------------------

    @torch.no_grad()
    def stash(self) -> int:
        """Move every row to host memory (the checkpoints survive a sleep;
        nothing runs then, so the lanes' rows are kept only for simplicity:
        they are rows like the others). Returns the host bytes taken."""
        assert self._host is None, "the state pools are stashed already"
        self._host = [t.to("cpu") for t in (*self.conv, *self.states)]
        self.conv, self.states, self._by_layer = [], [], {}
        return sum(t.numel() * t.element_size() for t in self._host)

    @torch.no_grad()
    def put_back(self) -> None:
        host = self._host
        assert host is not None, "the state pools are not stashed"
        self._allocate()
        for pool, saved in zip((*self.conv, *self.states), host, strict=True):
            pool.copy_(saved)
        self._host = None


def state_kernels_cover(config: ModelConfig) -> bool:
    """Whether our Gated DeltaNet kernels are built for this model's shapes:
    only then do its linear-attention layers read the batch on the device
    (and so may be captured in CUDA graphs)."""
    from kernels import gated_delta

    dims = config.linear_attention
    return dims is not None and gated_delta.conv_supported(dims.conv_kernel_size) \
        and gated_delta.rule_supported(dims.key_head_dim, dims.value_head_dim)


class StaticStateInputs:
    """A CUDA graph's static state_slots / state_fresh (hybrid models) and,
    for decode graphs, the bounds of each slot's tokens (a verify step's
    sequence spans several decode rows), with page-locked mirrors. Entries
    past a step's sequences get slot -1 and no tokens, which the Gated
    DeltaNet kernels skip (their state rows stay untouched)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.slots = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.fresh = torch.zeros(rows, dtype=torch.bool, device=device)
        self.bounds = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self._host_slots = torch.full((rows,), -1, dtype=torch.int64, pin_memory=True)
        self._host_fresh = torch.zeros(rows, dtype=torch.bool, pin_memory=True)
        self._host_bounds = torch.arange(rows + 1, dtype=torch.int32, pin_memory=True)

    def stage(self, slots: np.ndarray | None, fresh: np.ndarray | None, padded: int,
              bounds: np.ndarray | None = None) -> None:
        """Queue the copy of a step's entries (the caller's event covers it);
        bounds None: each entry owns one row (a decode step)."""
        assert slots is not None and fresh is not None, "a hybrid model's step has state slots"
        count = len(slots)
        host_slots, host_fresh = self._host_slots.numpy(), self._host_fresh.numpy()
        host_slots[:count] = slots
        host_slots[count:padded] = -1
        host_fresh[:count] = fresh
        host_fresh[count:padded] = False
        self.slots[:padded].copy_(self._host_slots[:padded], non_blocking=True)
        self.fresh[:padded].copy_(self._host_fresh[:padded], non_blocking=True)
        host_bounds = self._host_bounds.numpy()
        if bounds is None:
            host_bounds[: padded + 1] = np.arange(padded + 1)
        else:
            host_bounds[: count + 1] = bounds
            host_bounds[count + 1 : padded + 1] = bounds[-1]  # no tokens
        self.bounds[: padded + 1].copy_(self._host_bounds[: padded + 1], non_blocking=True)
