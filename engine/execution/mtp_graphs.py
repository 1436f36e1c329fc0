"""CUDA graphs of an MTP head's pass over a decode step's rows
(engine/sampling/mtp_drafter.py runs the head after every step).

A decode step (and a verify step laid out as decode rows) replays one of the
decode graphs (engine/execution/cuda_graphs.py); the head's pass over the
same rows reads the same positions, slots, lengths and page tables, which
are still in those graphs' static inputs when the head runs (before the
next step is staged), and the rows' hidden states, which the decode graph
copied into hidden_out. So the head is captured once per (padded batch,
context bucket) of the decode graphs, reading those buffers and a static
buffer of the rows' next tokens, and writing its output into a static
buffer: one launch instead of a layer's worth, which the slow host of our
GPU machines would otherwise pay on every step. Padding rows write no K/V
(slot -1), as in the decode graph.

The graphs share the decode graphs' memory pool: nothing of a decode
graph's intermediates is alive when the head replays.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.execution.attention_metadata import AttentionMetadata
from engine.execution.cuda_graphs import DecodeGraphs

# (next token ids [B], hidden states [B, H], positions [B], metadata) -> output [B, H]
HeadCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class MTPGraphs:
    def __init__(self, head: HeadCall, decode: DecodeGraphs, hidden: torch.Tensor) -> None:
        """decode: the step's decode graphs (captured); hidden: the buffer they
        copy each row's final hidden state into."""
        self.head = head
        self.decode = decode
        self.hidden = hidden
        rows = decode.max_batch
        self.ids = torch.zeros(rows, dtype=torch.int64, device=decode.device)
        self.out = torch.zeros((rows, hidden.shape[1]), dtype=hidden.dtype, device=decode.device)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def _forward(self, batch: int, bucket: int) -> None:
        decode = self.decode
        out = self.head(self.ids[:batch], self.hidden[:batch], decode.positions[:batch],
                        decode.static_metadata(batch, bucket))
        self.out[:batch].copy_(out)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every shape the decode graphs have, largest first, into their pool.
        The warm-up and the captures run on whatever the decode graphs'
        static inputs hold: slot -1 before their first step; after one (a
        capture after a wake), the rows of the step being observed, whose
        K/V the replay that follows writes again."""
        decode = self.decode
        self._forward(decode.max_batch, decode.buckets[-1])
        torch.cuda.synchronize(decode.device)
        for batch in reversed(decode.batch_sizes):
            for bucket in reversed(decode.buckets):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=decode.memory.pool):
                    self._forward(batch, bucket)
                self._graphs[(batch, bucket)] = graph
        torch.cuda.synchronize(decode.device)

    @property
    def count(self) -> int:
        return len(self._graphs)

    def run(self, rows: int) -> torch.Tensor:
        """Replay the head for the decode step the decode graphs replayed
        last (its rows' next tokens in ids[:rows]); its output [rows, H]."""
        shape = self.decode.last_shape
        assert shape is not None, "the MTP head's graphs follow a decode graph's replay"
        self._graphs[shape].replay()
        return self.out[:rows]
