"""CUDA graphs of a draft model's drafting round (engine/sampling/draft_model.py).

A round has two parts, each replayed from graphs:
- catch-up: the tokens each row's draft cache has not seen yet (the target's
  last accepted tokens, a few per row) fed as decode rows, every token a row
  of its own (engine/execution/step_inputs.py's verify layout), through the
  draft's own DecodeGraphs; the greedy guess after each row's last token is
  taken on the device;
- the chain: one graph per padded batch size feeds every row's newest guess
  at its next position and writes the greedy token after it, then advances
  a step counter on the device, so replaying it n times drafts n more tokens
  with no host round trip between positions.
The host reads the whole draft back once, at the end of the round.

A row may want fewer tokens than the longest: its steps past its own length
write no KV (slot -1) and attend to one token, and what they guess is cut
off by the host. Padding rows are such rows from the start.
"""

from __future__ import annotations

import torch

from engine.execution.attention_metadata import AttentionMetadata
from engine.execution.cuda_graphs import (
    DecodeGraphs,
    capture_batch_sizes,
    context_bucket,
    context_buckets,
)
from engine.execution.future_tokens import FutureTokens
from engine.execution.graph_memory import GraphMemory
from engine.execution.step_inputs import StepInputs
from engine.models import CausalLM

KVCache = tuple[torch.Tensor, torch.Tensor]


class DraftGraphs:
    def __init__(self, model: CausalLM, kv_caches: list[KVCache], *, catch_up_rows: int,
                 max_rows: int, max_tokens: int, max_context: int, page_size: int,
                 vocab_limit: int, device: torch.device) -> None:
        """catch_up_rows: the most catch-up tokens one round feeds through the
        graphs; max_rows: the most rows drafting at once; max_tokens: the
        longest draft (K)."""
        self.model = model
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.vocab_limit = vocab_limit
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        self.device = device
        self.memory = GraphMemory(max(catch_up_rows, max_rows), model.config.vocab_size, device)
        self.catch_up = DecodeGraphs(model, kv_caches, FutureTokens(1, device), self.memory,
                                     max_batch=catch_up_rows, max_context=max_context,
                                     page_size=page_size, device=device)
        self.batch_sizes = capture_batch_sizes(max_rows)
        self.buckets = context_buckets(max_context)
        max_pages = -(-max_context // page_size)
        kw = {"device": device}
        # The chain's static inputs, rows [0, padded) of each read by a replay.
        self.guess = torch.zeros(max_rows, dtype=torch.int64, **kw)  # the newest guess
        self.start = torch.zeros(max_rows, dtype=torch.int64, **kw)  # position of the first guess
        self.length = torch.zeros(max_rows, dtype=torch.int64, **kw)  # tokens the row drafts
        self.tables = torch.zeros((max_rows, max_pages), dtype=torch.int32, **kw)
        self.step = torch.zeros(1, dtype=torch.int64, **kw)
        # Column j: the row's guess j (column 0 from the catch-up).
        self.drafts = torch.zeros((max_rows, max_tokens), dtype=torch.int64, **kw)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def _chain_step(self, rows: int, bucket: int) -> None:
        """Feed each row's newest guess (at position start + step) and write
        the token after it into column step + 1 of drafts."""
        step = self.step.expand(rows)
        position = self.start[:rows] + step
        # Step s feeds guess s, which only a row drafting more than s + 1 tokens needs.
        active = step + 1 < self.length[:rows]
        page_index = (position // self.page_size).clamp_(max=self.tables.shape[1] - 1)
        page = self.tables[:rows].gather(1, page_index[:, None]).squeeze(1).to(torch.int64)
        slots = torch.where(active, page * self.page_size + position % self.page_size,
                            torch.full_like(position, -1))
        seq_lens = torch.where(active, position + 1, torch.ones_like(position)).to(torch.int32)
        meta = AttentionMetadata(
            query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=self.device),
            seq_lens=seq_lens, block_tables=self.tables[:rows], slot_mapping=slots,
            max_query_len=1, max_seq_len=bucket, query_start_loc_host=(), seq_lens_host=())
        hidden = self.model.forward(self.guess[:rows], position, meta, self.kv_caches)
        logits = self.model.compute_logits(hidden)[:, : self.vocab_limit]
        token = logits.argmax(dim=-1)
        self.guess[:rows].copy_(token)
        column = (step + 1).clamp_(max=self.max_tokens - 1)[:, None]
        self.drafts[:rows].scatter_(1, column, token[:, None])
        self.step.add_(1)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture the catch-up graphs and a chain step for every (batch size,
        context bucket), largest first, into one pool."""
        self.catch_up.capture()
        self.length.zero_()  # warm-up and capture write no KV
        self.step.zero_()
        self._chain_step(self.max_rows, self.buckets[-1])
        torch.cuda.synchronize(self.device)
        for rows in reversed(self.batch_sizes):
            for bucket in reversed(self.buckets):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.memory.pool):
                    self._chain_step(rows, bucket)
                self._graphs[(rows, bucket)] = graph
        torch.cuda.synchronize(self.device)

    def release(self) -> None:
        self.catch_up.release()
        self._graphs.clear()

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    @property
    def count(self) -> int:
        return self.catch_up.count + len(self._graphs)

    def handles(self, catch_up_tokens: int, rows: int, pages: int, span: int) -> bool:
        """Whether a round of these sizes fits the graphs (pages: the longest
        page table; span: the furthest position + 1 a guess reaches)."""
        return (self.captured and catch_up_tokens <= self.catch_up.max_batch
                and rows <= self.max_rows and pages <= self.tables.shape[1]
                and span <= self.buckets[-1])

    @torch.inference_mode()
    def draft(self, catch_up: StepInputs, last_rows: list[int], starts: list[int],
              lengths: list[int], tables: torch.Tensor) -> list[list[int]]:
        """One round: catch_up in decode-row layout, last_rows its row of each
        drafting row's last token, starts each row's first guess position,
        lengths the tokens each row drafts (>= 1), tables [rows, pages] the
        rows' page tables (host int32). Returns each row's guesses."""
        rows = len(starts)
        logits = self.catch_up.run(catch_up)
        last = torch.tensor(last_rows, dtype=torch.int64).to(self.device, non_blocking=True)
        first = logits.index_select(0, last)[:, : self.vocab_limit].argmax(dim=-1)
        padded = next(size for size in self.batch_sizes if size >= rows)
        host = torch.zeros((2, padded), dtype=torch.int64)
        host[0, :rows] = torch.tensor(starts, dtype=torch.int64)
        host[1, :rows] = torch.tensor(lengths, dtype=torch.int64)
        host = host.pin_memory().to(self.device, non_blocking=True)
        self.start[:padded].copy_(host[0])
        self.length[:padded].copy_(host[1])
        width = tables.shape[1]
        self.tables[:padded].zero_()
        self.tables[:rows, :width].copy_(tables.pin_memory(), non_blocking=True)
        self.guess[:rows].copy_(first)
        self.drafts[:rows, 0].copy_(first)
        self.step.zero_()
        longest = max(lengths)
        bucket = context_bucket(self.buckets, max(s + n for s, n in zip(starts, lengths,
                                                                           strict=True)))
        graph = self._graphs[(padded, bucket)]
        for _ in range(longest - 1):
            graph.replay()
        out = self.drafts[:rows, :longest].tolist()
        return [guesses[:length] for guesses, length in zip(out, lengths, strict=True)]
