"""MTP drafting: the checkpoint's multi-token-prediction head guesses each
row's next tokens from the target's own hidden states (--spec mtp;
engine/models/mtp_head.py says what the head computes).

The head's attention layer needs K/V at every position of a sequence, as a
decoder layer does, so the head runs after every target step over all of the
step's rows (observe(), called by the model runner once the step's tokens are
sampled, before the next step is launched): row i feeds the target's final
hidden state h_i and the token at i + 1, which for a prompt row is the next
prompt token, for a decode row the token just sampled there, and for a
verify step's rows the target's tokens (right wherever the draft before was
accepted; the rows past the accepted ones write K/V that a later step writes
again). Those tokens may still be on the device: they are read through the
future-token buffer and the verify step's target tensor, so nothing waits.
The head's K/V lives in a pool of its own with the target pool's page ids,
so a sequence's page table serves both and the head needs no bookkeeping of
its own. Its output at each sequence's last few rows is kept per lane.

propose_batch() then drafts from the kept output at the position before the
newest token: lm_head gives the first guess; each further guess feeds the
head's own output and the guess before at the next position (its K/V written
in pages the scheduler grew for the verify step, and written again by the
step that verifies it). All rows draft together, one head pass per draft
position, and the drafts are read back once.

Drafts are greedy guesses, so engine/sampling/verify.py's exact rule keeps
every emitted token as without speculation. What the head keeps is only ever
a guess: pages restored from the host or disk tier, or kept through a sleep,
hold no head K/V for their positions, which only lowers acceptance there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.execution.attention_metadata import AttentionMetadata
from engine.execution.cuda_graphs import DecodeGraphs
from engine.execution.future_tokens import FutureTokens
from engine.execution.graph_memory import collector_paused
from engine.execution.mtp_graphs import MTPGraphs
from engine.execution.step_inputs import DeviceInputs, StepInputs
from engine.models import CausalLM
from engine.sampling.drafter import DraftRow
from engine.scheduling.scheduler import SchedulerOutput

KVCache = tuple[torch.Tensor, torch.Tensor]

# A row with no known next token (a request that finished meanwhile): the
# head runs it but writes no K/V there.
_UNKNOWN = 0


@dataclass
class _Chain:
    """A drafting round's inputs on the device (MTPDrafter._chain_inputs)."""

    kept: torch.Tensor  # int64 [B]: each row's kept output row
    positions: torch.Tensor  # int64 [S, B]: chain step s's positions
    slots: torch.Tensor  # int64 [S, B]
    lengths: torch.Tensor  # int32 [S, B]
    tables: torch.Tensor  # int32 [B, pages]
    query_start: torch.Tensor  # int32 [B + 1]: one row each
    host_lengths: np.ndarray

    def metadata(self, step: int) -> AttentionMetadata:
        lengths = self.host_lengths[step]
        return AttentionMetadata(
            query_start_loc=self.query_start, seq_lens=self.lengths[step],
            block_tables=self.tables, slot_mapping=self.slots[step], max_query_len=1,
            max_seq_len=int(lengths.max()),
            query_start_loc_host=tuple(range(len(lengths) + 1)),
            seq_lens_host=tuple(lengths.tolist()))


class MTPDrafter:
    # The scheduler grows a row's pages for its whole verify step before
    # asking for its draft: the head writes K/V at the draft positions.
    needs_pages = True

    def __init__(self, model: CausalLM, *, num_pages: int, page_size: int, lanes: int,
                 max_tokens: int, vocab_limit: int, device: torch.device) -> None:
        """model: the target, its MTP head added (model.mtp); num_pages of
        page_size: the target's pool, whose page ids index the head's K/V;
        lanes: the scheduler's; max_tokens: the longest draft."""
        head = getattr(model, "mtp", None)
        if head is None:
            raise ValueError("MTP drafting needs the model's MTP head (load with with_mtp)")
        self.model = model
        self.head = head
        self.num_pages = num_pages
        self.page_size = page_size
        self.lanes = lanes
        self.max_tokens = max_tokens
        self.vocab_limit = vocab_limit
        self.device = device
        self.dtype = model.embed_tokens.dtype
        # A verify step's rows of a lane: its newest token and the draft.
        self.kept_rows = 1 + max_tokens
        self.kv: KVCache | None = None
        self.kept: torch.Tensor | None = None
        # Lane -> (position of kept row 0, rows kept).
        self._kept_at: dict[int, tuple[int, int]] = {}
        self._inputs = DeviceInputs(device)
        # The head's graphs over decode steps (enable_graphs).
        self.graphs_on = False
        self.graphs: MTPGraphs | None = None
        self._allocate()

    def _allocate(self) -> None:
        config = self.model.config
        shape = (self.num_pages, self.page_size, config.num_kv_heads, config.head_dim)
        kw = {"dtype": self.dtype, "device": self.device}
        self.kv = (torch.zeros(shape, **kw), torch.zeros(shape, **kw))  # type: ignore[arg-type]
        self.kept = torch.zeros((self.lanes * self.kept_rows, config.hidden_size), **kw)  # type: ignore[arg-type]
        self._kept_at.clear()

    @property
    def kv_bytes(self) -> int:
        if self.kv is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.kv)

    @staticmethod
    def kv_bytes_per_token(model: CausalLM, dtype: torch.dtype) -> int:
        """The head's K/V per token: one attention layer's."""
        return 2 * model.config.kv_size * dtype.itemsize

    # ---- after every target step ---------------------------------------------

    @torch.inference_mode()
    def observe(self, out: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor,
                future: FutureTokens, targets: torch.Tensor | None,
                decode_graphs: DecodeGraphs | None = None) -> None:
        """Run the head over a step's rows (see the module's docstring).
        hidden: the target's final hidden states of the step's rows; targets:
        a verify step's target tokens at its draft rows (StepInputs.draft_rows);
        decode_graphs: the decode graphs if the step replayed one (its rows'
        hidden states in their hidden_out): the head replays its own graph
        of that shape (engine/execution/mtp_graphs.py)."""
        assert self.kv is not None and self.kept is not None, "observe() while asleep"
        if not out.chunks:
            return
        next_ids = np.full(inputs.num_tokens, _UNKNOWN, dtype=np.int64)
        known = np.zeros(inputs.num_tokens, dtype=bool)
        kept_rows: list[int] = []
        kept_slots: list[int] = []
        row = 0
        for chunk in out.chunks:
            seq, count = chunk.seq, chunk.num_tokens
            tokens = seq.token_ids
            if seq.params.pooling is not None:
                row += count  # an embedding's prompt: nothing to draft after it
                continue
            if chunk.draft:
                # Row 0's next token is the sampled one (its placeholder);
                # the draft rows' come from the targets, filled in below.
                if chunk.start + 1 < len(tokens):
                    next_ids[row] = tokens[chunk.start + 1]
                    known[row] = True
                known[row + 1 : row + count] = True
            else:
                ends = min(chunk.start + count + 1, len(tokens))
                following = tokens[chunk.start + 1 : ends]
                next_ids[row : row + len(following)] = following
                known[row : row + len(following)] = True
            if chunk.state_slot >= 0:
                keep = min(count, self.kept_rows)
                first = row + count - keep
                kept_rows.extend(range(first, first + keep))
                kept_slots.extend(range(chunk.state_slot * self.kept_rows,
                                        chunk.state_slot * self.kept_rows + keep))
                self._kept_at[chunk.state_slot] = (chunk.start + count - keep, keep)
            row += count
        count, drafts = inputs.num_tokens, len(inputs.draft_rows)
        if decode_graphs is not None and self.graphs_on:
            # One copy moves the ids and every index list.
            self._inputs.begin()
            packed = self._inputs.tensor("mtp", np.concatenate(
                [next_ids, np.asarray(inputs.draft_rows, dtype=np.int64),
                 np.asarray(kept_rows, dtype=np.int64), np.asarray(kept_slots, dtype=np.int64)]))
            self._inputs.end()
            ids = future.resolve(packed[:count])
            if targets is not None and drafts:
                ids.index_copy_(0, packed[count : count + drafts], targets)
            graphs = self._graphs_for(decode_graphs)
            graphs.ids[:count].copy_(ids)
            result = graphs.run(count)
            rows_t = packed[count + drafts : count + drafts + len(kept_rows)]
            slots_t = packed[count + drafts + len(kept_rows):]
        else:
            # Rows with no known next token write no K/V (the graphs' rows
            # are a decode step's: a finished request's row, at most).
            slots = np.where(known, inputs.slot_mapping, -1)
            step = StepInputs(
                input_ids=next_ids, positions=inputs.positions, slot_mapping=slots,
                query_start_loc=inputs.query_start_loc, seq_lens=inputs.seq_lens,
                block_tables=inputs.block_tables, sample_rows=[], sample_seqs=[])
            ids, positions, meta = self._inputs.metadata(step)
            ids = future.resolve(ids)
            if targets is not None and drafts:
                ids = ids.index_copy(0, self._tensor(inputs.draft_rows), targets)
            result = self._head(ids, hidden, positions, meta)
            rows_t, slots_t = self._tensor(kept_rows), self._tensor(kept_slots)
        if kept_rows:
            self.kept.index_copy_(0, slots_t, result.index_select(0, rows_t))

    def _graphs_for(self, decode_graphs: DecodeGraphs) -> MTPGraphs:
        """The head's graphs of these decode graphs, captured on first use
        (new decode graphs come with every wake)."""
        if self.graphs is None or self.graphs.decode is not decode_graphs:
            assert decode_graphs.hidden_out is not None, "decode graphs without hidden_out"
            self.graphs = MTPGraphs(self._graph_head, decode_graphs, decode_graphs.hidden_out)
            with collector_paused():
                self.graphs.capture()
        return self.graphs

    def _graph_head(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
        return self._head(ids, hidden, positions, meta)

    def enable_graphs(self, decode_graphs: DecodeGraphs | None) -> None:
        """Run the head's pass over decode steps from CUDA graphs (captured
        now, so the first request does not wait for them)."""
        self.graphs_on = decode_graphs is not None
        if decode_graphs is not None:
            self._graphs_for(decode_graphs)

    def _head(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata) -> torch.Tensor:
        model = self.model
        assert self.kv is not None
        return self.head(ids, hidden.to(self.dtype), positions, meta, self.kv,
                         model.embed_tokens, model.rope_cache, model.ops)

    def _tensor(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    # ---- drafting --------------------------------------------------------------

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The Drafter protocol's call for a sequence the engine does not run:
        the head drafts only from a running sequence's hidden states, so none."""
        return []

    @torch.inference_mode()
    def propose_batch(self, rows: list[DraftRow]) -> list[list[int]]:
        """Up to row.max_tokens greedy guesses after each row's tokens; a row
        whose hidden state at its position before the newest is not kept (it
        has not run a step since its lane changed hands) gets none."""
        drafts: list[list[int]] = [[] for _ in rows]
        active: list[tuple[int, DraftRow, int]] = []  # (index, row, kept row)
        for index, row in enumerate(rows):
            position = len(row.token_ids) - 2
            kept = self._kept_at.get(row.lane)
            if row.max_tokens < 1 or kept is None or position < 0:
                continue
            first, count = kept
            if not 0 <= position - first < count:
                continue
            reach = position + row.max_tokens - 1  # the last position the chain writes
            if reach // self.page_size >= len(row.pages):
                continue  # the scheduler could not grow its pages for the verify step
            active.append((index, row, row.lane * self.kept_rows + position - first))
        if not active:
            return drafts
        assert self.kept is not None
        longest = max(row.max_tokens for _, row, _ in active)
        chain = self._chain_inputs(active, longest)
        hidden = self.kept.index_select(0, chain.kept)
        guess = self._greedy(hidden)
        guesses = [guess]
        for step in range(1, longest):
            hidden = self._head(guess, hidden, chain.positions[step - 1], chain.metadata(step - 1))
            guess = self._greedy(hidden)
            guesses.append(guess)
        table = torch.stack(guesses, dim=1).tolist()
        for (index, row, _), guessed in zip(active, table, strict=True):
            drafts[index] = guessed[: row.max_tokens]
        return drafts

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.compute_logits(hidden)
        return logits[:, : self.vocab_limit].argmax(dim=-1)

    def _chain_inputs(self, active: list[tuple[int, DraftRow, int]], longest: int) -> _Chain:
        """Every drafting position's inputs, moved to the device at once:
        chain step s feeds each row's newest guess at its position before the
        newest token + s, a decode row of its own; rows past their own draft
        length write nothing and attend to one token (position 0)."""
        count, steps = len(active), max(longest - 1, 1)
        positions = np.zeros((steps, count), dtype=np.int64)
        slots = np.full((steps, count), -1, dtype=np.int64)
        lengths = np.ones((steps, count), dtype=np.int32)
        tables = np.zeros((count, max(len(row.pages) for _, row, _ in active)), dtype=np.int32)
        for i, (_, row, _) in enumerate(active):
            tables[i, : len(row.pages)] = row.pages
            for step in range(1, row.max_tokens):
                position = len(row.token_ids) - 2 + step
                page = int(tables[i, position // self.page_size])
                positions[step - 1, i] = position
                slots[step - 1, i] = page * self.page_size + position % self.page_size
                lengths[step - 1, i] = position + 1
        kept = np.array([kept for _, _, kept in active], dtype=np.int64)
        inputs = self._inputs
        inputs.begin()
        chain = _Chain(
            kept=inputs.tensor("chain_kept", kept),
            positions=inputs.tensor("chain_positions", positions),
            slots=inputs.tensor("chain_slots", slots),
            lengths=inputs.tensor("chain_lengths", lengths),
            tables=inputs.tensor("chain_tables", tables),
            query_start=inputs.tensor("chain_query_start", np.arange(count + 1, dtype=np.int32)),
            host_lengths=lengths)
        inputs.end()
        return chain

    # ---- lifetime ----------------------------------------------------------------

    def forget(self, key: str) -> None:
        """A sequence ended: nothing is kept by request (its lane's rows are
        overwritten by the lane's next sequence)."""

    def sleep(self) -> None:
        """Give the head's K/V up with the engine's device memory (the weights
        are the model's, stashed with it)."""
        self.kv = None
        self.kept = None
        self.graphs = None  # they point at the K/V tensors
        self._kept_at.clear()

    def wake(self) -> None:
        if self.kv is None:
            self._allocate()
