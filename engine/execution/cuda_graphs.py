"""CUDA graphs of the decode forward pass.

A decode step launches a few hundred small kernels; from the slow host CPU of
our GPU machines, launching them one by one costs more than running them. So
the forward pass of a decode step (embedding to final norm) is captured once
per padded batch size and replayed: one launch per step.

Capture follows vLLM's recipe: batch sizes 1, 2, 4, 8 and then every multiple
of 8 up to the largest decode batch, captured largest first into one shared
memory pool (a smaller graph's intermediates fit in what the larger one left
free). A step pads its batch up to the next captured size; padding rows write
no KV (slot -1) and read one token of page 0. The decode attention kernel's
split-K grid depends on an upper bound of the sequence lengths, so each batch
size is captured for a few context buckets, and a step replays the smallest
bucket that holds its longest sequence. The graph ends with the logits of
every row, written into the static float32 buffer all graphs share
(engine/execution/graph_memory.py); sampling runs eagerly after the replay,
since grammar masks and penalties change from step to step.
Input ids may be placeholders for tokens the previous step sampled on the
device (engine/execution/future_tokens.py): the graph reads them there.

Graphs point at the weights, KV and workspace addresses they were captured
with: sleep() drops them and wake() captures them again.
"""

from __future__ import annotations

import logging

import torch

from engine.execution.attention_metadata import AttentionMetadata
from engine.execution.future_tokens import FutureTokens
from engine.execution.graph_memory import GraphMemory
from engine.execution.recurrent_state import StaticStateInputs
from engine.execution.step_inputs import StepInputs
from engine.models import CausalLM

log = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]

# Context buckets below the served context: a decode step whose sequences are
# all shorter replays a graph whose attention grid covers only this much.
CONTEXT_BUCKETS = (4096,)


# Verify steps run as decode rows (engine/execution/step_inputs.py) up to
# this many tokens: speculation pays where decoding reads weights, not where
# it computes (small batches), and 64 rows cover batch 1-12 at 4 drafts while
# the decode workspace and graphs stay small.
VERIFY_DECODE_ROWS = 64


def decode_row_capacity(max_batch: int, draft_tokens: int) -> int:
    """The decode rows to size the workspace and graphs for: the lanes, and
    with speculation the tokens of a verify step of small batches."""
    if draft_tokens <= 0:
        return max_batch
    return max(max_batch, min(max_batch * (1 + draft_tokens), VERIFY_DECODE_ROWS))


def capture_batch_sizes(max_batch: int) -> list[int]:
    sizes = [size for size in (1, 2, 4) if size < max_batch]
    sizes += range(8, max_batch, 8)
    sizes.append(max_batch)
    return sorted(set(sizes))


def context_buckets(max_context: int) -> list[int]:
    return sorted({bucket for bucket in CONTEXT_BUCKETS if bucket < max_context} | {max_context})


def context_bucket(buckets: list[int], longest: int) -> int:
    """The smallest bucket that holds a step whose longest sequence is `longest`."""
    return next(bucket for bucket in buckets if bucket >= longest)


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[KVCache],
        future: FutureTokens,
        memory: GraphMemory,
        *,
        max_batch: int,
        max_context: int,
        page_size: int,
        device: torch.device,
        hidden_out: torch.Tensor | None = None,
    ) -> None:
        """hidden_out: a buffer each replay also copies the rows' final hidden
        states into (MTP drafting reads them: engine/sampling/mtp_drafter.py)."""
        self.model = model
        self.kv_caches = kv_caches
        self.future = future
        self.memory = memory
        self.hidden_out = hidden_out
        self.batch_sizes = capture_batch_sizes(max_batch)
        self.buckets = context_buckets(max_context)
        self.max_batch = max_batch
        self.device = device
        max_pages = -(-max_context // page_size)
        # Static inputs: every graph reads its rows of these.
        kw = {"device": device}
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, **kw)
        self.block_tables = torch.zeros((max_batch, max_pages), dtype=torch.int32, **kw)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, **kw)
        # Token ids, positions and slots side by side, so one DMA moves them.
        self._tokens = torch.zeros((3, max_batch), dtype=torch.int64, **kw)
        self.input_ids, self.positions, self.slot_mapping = self._tokens
        # Slot -1 writes no KV: the warm-up before capture (possibly after a
        # wake, with kept prefix pages in the pool) must not touch any page.
        self.slot_mapping.fill_(-1)
        # Page-locked mirrors: one step's inputs are written here, then copied
        # in three asynchronous DMAs.
        self._host_tokens = torch.zeros((3, max_batch), dtype=torch.int64, pin_memory=True)
        self._host_lens = torch.ones(max_batch, dtype=torch.int32, pin_memory=True)
        self._host_tables = torch.zeros((max_batch, max_pages), dtype=torch.int32,
                                        pin_memory=True)
        self._copies_done: torch.cuda.Event | None = None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # The (padded batch, bucket) replayed last (an MTP head's graphs follow it).
        self.last_shape: tuple[int, int] | None = None
        # A hybrid model's state rows (slot -1: untouched, during capture too).
        self.state = (StaticStateInputs(max_batch, device)
                      if model.config.has_recurrent_state else None)

    def static_metadata(self, batch: int, bucket: int) -> AttentionMetadata:
        """The metadata every graph of this shape reads (its static inputs)."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            slot_mapping=self.slot_mapping[:batch],
            max_query_len=1,
            max_seq_len=bucket,
            # The kernels read lengths on the device; nothing on the host.
            query_start_loc_host=(),
            seq_lens_host=(),
            state_slots=self.state.slots[:batch] if self.state is not None else None,
            state_fresh=self.state.fresh[:batch] if self.state is not None else None,
            state_query_start_loc=(self.state.bounds[: batch + 1] if self.state is not None
                                   else None),
        )

    def _forward(self, batch: int, bucket: int) -> None:
        # Placeholder ids (tokens the step before sampled) are read on the device.
        input_ids = self.future.resolve(self.input_ids[:batch])
        hidden = self.model.forward(input_ids, self.positions[:batch],
                                    self.static_metadata(batch, bucket), self.kv_caches)
        if self.hidden_out is not None:
            self.hidden_out[:batch].copy_(hidden)
        self.memory.logits[:batch].copy_(self.model.compute_logits(hidden))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (batch size, bucket), largest first, into the shared pool."""
        # Warm up eagerly once at the largest shape: cuBLAS picks its
        # algorithms and creates its workspace outside the capture.
        self._forward(self.max_batch, self.buckets[-1])
        torch.cuda.synchronize(self.device)
        for batch in reversed(self.batch_sizes):
            for bucket in reversed(self.buckets):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.memory.pool):
                    self._forward(batch, bucket)
                self._graphs[(batch, bucket)] = graph
        torch.cuda.synchronize(self.device)

    def release(self) -> None:
        self._graphs.clear()

    @property
    def count(self) -> int:
        return len(self._graphs)

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def handles(self, inputs: StepInputs) -> bool:
        # A prompt row with images needs multimodal RoPE's table: eager.
        return (self.captured and inputs.is_decode and inputs.num_seqs <= self.max_batch
                and not inputs.media_chunks)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Replay the graph for a decode step; returns float32 logits [B, vocab]
        (a view of the static buffer: use it before the next replay)."""
        batch = inputs.num_seqs
        padded = next(size for size in self.batch_sizes if size >= batch)
        bucket = context_bucket(self.buckets, int(inputs.seq_lens.max()))
        if self._copies_done is not None:
            self._copies_done.synchronize()  # the mirrors are free again
        tokens = self._host_tokens.numpy()
        tokens[0, :batch] = inputs.input_ids
        tokens[1, :batch] = inputs.positions
        tokens[2, :batch] = inputs.slot_mapping
        tokens[:, batch:padded] = 0
        tokens[2, batch:padded] = -1
        lens = self._host_lens.numpy()
        lens[:batch] = inputs.seq_lens
        lens[batch:padded] = 1
        width = inputs.block_tables.shape[1]
        tables = self._host_tables.numpy()
        tables[:batch, :width] = inputs.block_tables
        tables[batch:padded, 0] = 0
        self._tokens.copy_(self._host_tokens, non_blocking=True)
        self.seq_lens[:padded].copy_(self._host_lens[:padded], non_blocking=True)
        self.block_tables[:padded, :width].copy_(self._host_tables[:padded, :width],
                                                 non_blocking=True)
        if self.state is not None:
            self.state.stage(inputs.state_slots, inputs.state_fresh, padded,
                             inputs.state_query_start_loc)
        self._copies_done = torch.cuda.Event()
        self._copies_done.record()
        self._graphs[(padded, bucket)].replay()
        self.last_shape = (padded, bucket)
        return self.memory.logits[:batch]

