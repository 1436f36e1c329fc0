"""Runs one scheduled step on the model: builds the flat batch, runs the
forward pass over the paged KV cache, and samples the rows that need a token."""

from __future__ import annotations

import torch

from engine.attention_metadata import AttentionMetadata
from engine.loader import LoadedModel
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        device: torch.device,
        dtype: torch.dtype,
        num_pages: int,
        page_size: int,
        sampler: Sampler,
    ):
        self.model = loaded.model
        self.config = loaded.config
        self.device = device
        self.page_size = page_size
        self.sampler = sampler
        shape = (num_pages, page_size, self.config.num_kv_heads, self.config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(self.config.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[int]:
        """Returns one sampled token per chunk whose `samples` is true, in order."""
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
        return self.sampler.sample(logits, sample_seqs)
