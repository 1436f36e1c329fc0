"""CUDA graphs of steps with prompt chunks, up to a couple of thousand tokens.

While requests keep arriving, most steps a server runs are mixed: every
decoding row plus a new prompt's chunk. Run eagerly, such a step launches
each kernel from the host one at a time; measured on the H200 at the
Qwen3-0.6B shape (tests/perf/profile_mixed_step.py), 64 decode rows plus a
130-token prompt took 8.2 ms of host time to launch 3.1 ms of GPU work, and
every stream waited for it. So these steps replay graphs too.

A graph is captured per padded token count (16, 24, 32, 48, 64, ... up to
CHUNK_GRAPH_MAX_TOKENS or the step budget if smaller) for every lane at once:
the batch is laid out in static buffers of `lanes` sequences, the unused ones
with no query rows and no cached tokens, so the prefill attention kernel's
blocks for them return at once; padding tokens write no KV (slot -1). The
grid of the attention kernel is sized by the padded token count, an upper
bound of any sequence's query length. Each graph ends with the logits of the
sampled rows (gathered through a static index buffer) in the static logits
buffer it shares with the decode graphs (engine/execution/cuda_graphs.py),
and captures into their memory pool: graphs never run at the same time, and
none leaves anything in the pool that outlives its replay.

Longer steps run eagerly: there the GPU's time exceeds the host's launches,
and padding would cost real work. With graphs off (--no-cuda-graph) the
same padded steps run eagerly, so both compute the same numbers (another
padding, or another attention kernel shape, would round differently).
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

# Steps with prompt chunks up to this many tokens replay graphs. At the
# Qwen3-0.6B shape an eager step of 2,048 tokens already keeps the GPU about
# as busy as its launches keep the host.
CHUNK_GRAPH_MAX_TOKENS = 2048
_SMALLEST = 16


def chunk_graph_tokens(max_step_tokens: int) -> int:
    """The most tokens a captured step with prompt chunks holds (0: none is
    captured, the scheduler's steps being single tokens)."""
    largest = min(max_step_tokens, CHUNK_GRAPH_MAX_TOKENS)
    return largest if largest > 1 else 0


def chunk_token_sizes(max_tokens: int) -> list[int]:
    """Padded token counts to capture: 16, 24, 32, 48, 64, 96, ... (two a
    doubling, so padding costs at most half of a step) and max_tokens."""
    sizes = {max_tokens}
    size = _SMALLEST
    while size < max_tokens:
        sizes.add(size)
        if size + size // 2 < max_tokens:
            sizes.add(size + size // 2)
        size *= 2
    return sorted(sizes)


class ChunkGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[KVCache],
        future: FutureTokens,
        memory: GraphMemory | None,
        *,
        lanes: int,
        max_tokens: int,
        max_context: int,
        page_size: int,
        device: torch.device,
        hidden_out: torch.Tensor | None = None,
    ) -> None:
        """hidden_out: as DecodeGraphs' (the padded step's rows)."""
        self.model = model
        self.kv_caches = kv_caches
        self.future = future
        self.memory = memory
        self.hidden_out = hidden_out
        self.lanes = lanes
        self.sizes = chunk_token_sizes(chunk_graph_tokens(max_tokens))
        self.max_context = max_context
        self.device = device
        largest = self.sizes[-1]
        max_pages = -(-max_context // page_size)
        kw = {"device": device}
        # Token ids, positions and slots side by side, so one copy moves them.
        self._tokens = torch.zeros((3, largest), dtype=torch.int64, **kw)
        self.input_ids, self.positions, self.slot_mapping = self._tokens
        self.slot_mapping.fill_(-1)
        # Every lane's bounds: unused lanes own no query rows and no tokens.
        self.query_start_loc = torch.zeros(lanes + 1, dtype=torch.int32, **kw)
        self.seq_lens = torch.zeros(lanes, dtype=torch.int32, **kw)
        self.block_tables = torch.zeros((lanes, max_pages), dtype=torch.int32, **kw)
        self.sample_rows = torch.zeros(lanes, dtype=torch.int64, **kw)
        self._host_tokens = torch.zeros((3, largest), dtype=torch.int64, pin_memory=True)
        self._host_bounds = torch.zeros(2 * lanes + 1, dtype=torch.int32, pin_memory=True)
        self._host_tables = torch.zeros((lanes, max_pages), dtype=torch.int32, pin_memory=True)
        self._host_rows = torch.zeros(lanes, dtype=torch.int64, pin_memory=True)
        self._copies_done: torch.cuda.Event | None = None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # A hybrid model's state rows, one per lane (slot -1: untouched).
        self.state = (StaticStateInputs(lanes, device)
                      if model.config.has_recurrent_state else None)

    def _forward(self, size: int) -> torch.Tensor:
        """The float32 logits [lanes, vocab] of the sampled rows (padded)."""
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping[:size],
            # An upper bound of every lane's query rows: it sizes the grid.
            max_query_len=size,
            max_seq_len=self.max_context,
            query_start_loc_host=(),
            seq_lens_host=(),
            state_slots=self.state.slots if self.state is not None else None,
            state_fresh=self.state.fresh if self.state is not None else None,
        )
        input_ids = self.future.resolve(self.input_ids[:size])
        hidden = self.model.forward(input_ids, self.positions[:size], meta, self.kv_caches)
        if self.hidden_out is not None:
            self.hidden_out[:size].copy_(hidden)
        return self.model.compute_logits(hidden.index_select(0, self.sample_rows))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into the shared pool. The static
        inputs describe no work (no rows, no KV writes) while this runs."""
        memory = self.memory
        assert memory is not None, "capturing needs the graphs' shared memory"
        # Eagerly once at the largest size: cuBLAS picks its algorithms and
        # makes its workspace outside the capture.
        self._forward(self.sizes[-1])
        torch.cuda.synchronize(self.device)
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory.pool):
                memory.logits[: self.lanes].copy_(self._forward(size))
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def release(self) -> None:
        self._graphs.clear()

    @property
    def count(self) -> int:
        return len(self._graphs)

    def handles(self, inputs: StepInputs) -> bool:
        return (not inputs.is_decode
                and inputs.num_tokens <= self.sizes[-1] and inputs.num_seqs <= self.lanes
                and len(inputs.sample_rows) <= self.lanes and not inputs.media_chunks)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Replay the graph for a step with prompt chunks (or, never captured,
        run the same padded step eagerly: with graphs off a step computes the
        numbers it would with them on); returns the float32 logits of its
        sampled rows [S, vocab] (a view of the static buffer once captured:
        use it before the next replay)."""
        tokens, batch = inputs.num_tokens, inputs.num_seqs
        size = next(s for s in self.sizes if s >= tokens)
        if self._copies_done is not None:
            self._copies_done.synchronize()  # the mirrors are free again
        host = self._host_tokens.numpy()
        host[0, :tokens] = inputs.input_ids
        host[1, :tokens] = inputs.positions
        host[2, :tokens] = inputs.slot_mapping
        host[:2, tokens:size] = 0
        host[2, tokens:size] = -1
        bounds = self._host_bounds.numpy()
        lanes = self.lanes
        bounds[: batch + 1] = inputs.query_start_loc
        bounds[batch + 1 : lanes + 1] = tokens  # unused lanes: no query rows
        bounds[lanes + 1 : lanes + 1 + batch] = inputs.seq_lens
        bounds[lanes + 1 + batch :] = 0  # and no cached tokens
        width = inputs.block_tables.shape[1]
        self._host_tables.numpy()[:batch, :width] = inputs.block_tables
        rows = self._host_rows.numpy()
        count = len(inputs.sample_rows)
        rows[:count] = inputs.sample_rows
        rows[count:] = 0
        self._tokens.copy_(self._host_tokens, non_blocking=True)
        self.query_start_loc.copy_(self._host_bounds[: lanes + 1], non_blocking=True)
        self.seq_lens.copy_(self._host_bounds[lanes + 1 :], non_blocking=True)
        # Rows past this step's lanes keep stale page ids: with no tokens,
        # nothing reads them.
        self.block_tables[:batch, :width].copy_(self._host_tables[:batch, :width],
                                                non_blocking=True)
        self.sample_rows.copy_(self._host_rows, non_blocking=True)
        if self.state is not None:
            self.state.stage(inputs.state_slots, inputs.state_fresh, self.lanes)
        self._copies_done = torch.cuda.Event()
        self._copies_done.record()
        if not self._graphs:
            return self._forward(size)[:count]
        self._graphs[size].replay()
        assert self.memory is not None
        return self.memory.logits[:count]
