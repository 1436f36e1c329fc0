"""Runs one scheduled step on the model: builds the flat batch, runs the
forward pass over the paged KV cache, and samples the rows that need a token.

The runner owns the engine's device state (weights, KV tensors, and later CUDA
graphs), so putting it to sleep and waking it are its job too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention_metadata import AttentionMetadata
from engine.device_state import (
    DroppedWeights,
    KVCache,
    KVPageStash,
    WeightsMode,
    WeightStash,
    device_bytes,
    release_device_memory,
)
from engine.loader import LoadedModel, load_model
from engine.models import CausalLM
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput
from engine.token_mask import TokenMask


@dataclass
class _Sleeping:
    kv: KVPageStash
    # None: the weights stayed where they were (the CPU device is host memory).
    weights: WeightStash | DroppedWeights | None


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        model_path: Path,
        device: torch.device,
        dtype: torch.dtype,
        num_pages: int,
        page_size: int,
        sampler: Sampler,
    ):
        self.model = loaded.model
        self.config = loaded.config
        # Where a wake after Sleep(weights="disk") reads the weights again.
        self.model_path = model_path
        self._model_mtime = os.path.getmtime(model_path)
        self.device = device
        self.dtype = dtype
        self.num_pages = num_pages
        self.page_size = page_size
        self.sampler = sampler
        self.kv_caches = self._allocate_kv()
        self._sleeping: _Sleeping | None = None

    def _allocate_kv(self) -> list[KVCache]:
        shape = (self.num_pages, self.page_size, self.config.num_kv_heads, self.config.head_dim)
        dtype, device = self.dtype, self.device
        return [(torch.zeros(shape, dtype=dtype, device=device),
                 torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(self.config.num_layers)]

    # ---- sleep and wake --------------------------------------------------------

    @property
    def asleep(self) -> bool:
        return self._sleeping is not None

    def device_bytes(self) -> int:
        """Device memory this process holds (CUDA: reserved by torch; CPU: 0)."""
        return device_bytes(self.device)

    def sleep(self, weights: WeightsMode, keep_pages: Sequence[int]) -> int:
        """Give the device memory back. keep_pages (the prefix cache's pages)
        are copied to host memory and return on wake(); every other page's
        contents are lost, so nothing may be running. weights="host" keeps a
        host copy of the weights (on the CPU device they already are one);
        "disk" drops them and wake() reads the model file again.
        Returns the bytes of host memory taken for the copies."""
        if self._sleeping is not None:
            raise RuntimeError("the model runner is already asleep")
        pin = self.device.type == "cuda"
        kv = KVPageStash(self.kv_caches, keep_pages, pin=pin)
        self.kv_caches = []
        stash: WeightStash | DroppedWeights | None
        if weights == "disk":
            stash = DroppedWeights(self.model)
        elif self.device.type == "cpu":
            stash = None
        else:
            stash = WeightStash(self.model, pin=pin)
        self._sleeping = _Sleeping(kv, stash)
        release_device_memory(self.device)
        return kv.nbytes + (stash.nbytes if isinstance(stash, WeightStash) else 0)

    def wake(self) -> None:
        """Undo sleep(): weights and KV tensors back on the device, the kept
        pages back in their page ids. Raises on failure (a CUDA out-of-memory
        error, a model file changed meanwhile): the engine cannot go on."""
        sleeping = self._sleeping
        if sleeping is None:
            raise RuntimeError("the model runner is not asleep")
        if isinstance(sleeping.weights, DroppedWeights):
            sleeping.weights.put_back(self.model, self._reload_model())
        elif isinstance(sleeping.weights, WeightStash):
            sleeping.weights.put_back(self.model, self.device)
        self.kv_caches = self._allocate_kv()
        sleeping.kv.put_back(self.kv_caches)
        self._sleeping = None
        # NOTE: CUDA graphs captured before a sleep point at freed memory (the
        # weights and KV tensors were reallocated): recapture them here.

    def _reload_model(self) -> CausalLM:
        # The kept KV pages (and the prefix-cache fingerprint) belong to the
        # weights loaded at start-up; a changed file must not be mixed in.
        if os.path.getmtime(self.model_path) != self._model_mtime:
            raise RuntimeError(
                f"{self.model_path} changed while the engine slept; its kept KV pages belong "
                "to the old weights: unload the model and load it again"
            )
        loaded = load_model(self.model_path, self.device, self.dtype)
        if loaded.config != self.config:
            raise RuntimeError(f"{self.model_path} now describes another model than it did at load")
        return loaded.model

    # ---- one step --------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, mask: TokenMask | None = None) -> list[int]:
        """Returns one sampled token per chunk whose `samples` is true, in order;
        mask (grammar rows) is indexed by those sampled rows."""
        ps = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_seqs = []
        max_pages = max(len(chunk.seq.block_table) for chunk in out.chunks)
        block_tables = torch.zeros((len(out.chunks), max_pages), dtype=torch.int32)
        for row, chunk in enumerate(out.chunks):
            seq = chunk.seq
            end = chunk.start + chunk.num_tokens
            table = seq.block_table
            input_ids.extend(seq.token_ids[chunk.start : end])
            span = range(chunk.start, end)
            positions.extend(span)
            slots.extend(table[p // ps] * ps + p % ps for p in span)
            query_start.append(query_start[-1] + chunk.num_tokens)
            seq_lens.append(end)
            block_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
            if chunk.samples:
                sample_rows.append(query_start[-1] - 1)
                sample_seqs.append(seq)

        device = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=block_tables.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(c.num_tokens for c in out.chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_host=tuple(query_start),
            seq_lens_host=tuple(seq_lens),
        )
        hidden = self.model.forward(
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            meta,
            self.kv_caches,
        )
        if not sample_rows:
            return []
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        return self.sampler.sample(logits, sample_seqs, mask)
