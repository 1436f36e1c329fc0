"""Continuous batching with chunked prefill under a per-step token budget.

Each step, in this order:
1. every running sequence that is decoding gets one token (so a long prompt
   never stalls running streams for more than one chunk);
2. running sequences still prefilling get chunks from what budget is left;
3. waiting sequences are admitted in arrival order while there is a free
   lane, budget and KV (KVManager.try_admit); the first one that doesn't fit
   stops admission, so nobody is overtaken and starved. One whose prefix is
   being read back from the disk tier waits aside meanwhile (it fit when
   its reads began) and takes its place in the order again once they end.
When a decoding sequence needs a page and none is free, the most recently
admitted running sequence is preempted: its pages are released (full ones stay
in the prefix cache), and it goes back to the front of the queue, to be
recomputed from its prompt and the tokens it already produced.

The engine runs one step ahead of its results (engine/scheduling/core.py), so
a step is scheduled while the one before it is still on the device. Hence a
step's lifecycle here has three calls:
- schedule() plans the step and counts its tokens as computed at once (the
  step will run; the device orders its KV writes before any later reader);
- add_pending_tokens() gives each sampling chunk's sequence a placeholder for
  the token the device will sample: -(slot + 1), naming the slot of the
  device's future-token buffer that will hold it (engine/execution/future_tokens.py).
  The next step may already feed that placeholder to the model;
- complete() puts the sampled tokens in place of their placeholders, registers
  full pages in the prefix cache and finishes sequences.
Between add_pending_tokens() and complete() the scheduler knows everything
about a sequence except its newest token: it does not schedule a sequence
whose pending token is its last by length (max_tokens or the context). A
sequence preempted meanwhile may be admitted again at once: a prefix lookup
never hashes a sequence's last token, and its recompute reads the pending
token from the device like a decode step would. A sequence that turns out to
have stopped may have been scheduled once more; that step's work for it is
dropped (complete() skips finished sequences).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv.kv_manager import KVManager, takes_hits
from engine.kv.state_checkpoints import RowCopy
from engine.sampling.draft_cost import DraftCosts
from engine.sampling.draft_length import MIN_GAIN, DraftAcceptance, DraftLength, expected_kept
from engine.sampling.drafter import Drafter, DraftRow, may_draft
from engine.sampling.verify import accept_drafts
from engine.scheduling.lanes import Lanes
from engine.scheduling.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from protocol import SamplingParams


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # tokens already in the cache before this step
    num_tokens: int
    # This chunk reaches the sequence's newest token, so a token is sampled;
    # decided when the chunk is made (None: work it out from seq now).
    samples: bool = None  # type: ignore[assignment]
    # Where the sampled token goes in seq.token_ids (add_pending_tokens()).
    token_index: int = -1
    # Prompt positions [first, last) whose next token's log probabilities this
    # step computes (SamplingParams.prompt_logprobs), or None.
    scored: tuple[int, int] | None = None
    # Tokens guessed after the newest known one (engine/sampling/drafter.py):
    # the chunk computes them too, and complete() keeps those the target
    # agrees with; `accepted` counts them once it has.
    draft: list[int] = field(default_factory=list)
    accepted: int = 0
    # A hybrid model's recurrent-state row for this sequence (its lane), or -1.
    state_slot: int = -1

    def __post_init__(self) -> None:
        if self.samples is None:
            # A request scoring its prompt with max_tokens 0 samples nothing.
            self.samples = (self.start + self.num_tokens == self.seq.num_tokens
                            and self.seq.params.max_tokens > 0)


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Hybrid models: recurrent-state rows to copy (src, dst), in order, before
    # the step's forward pass (checkpoints of sequences that left their lane,
    # then resumes from checkpoints) and after it (checkpoints of this step's
    # chunks). See engine/kv/state_checkpoints.py.
    state_copies_before: list[RowCopy] = field(default_factory=list)
    state_copies_after: list[RowCopy] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self,
        kv: KVManager,
        max_concurrency: int,
        max_batched_tokens: int,
        max_context: int,
        drafter: Drafter | None = None,
        draft_tokens: int = 0,
        max_verify_rows: int = 0,
        recurrent_state: bool = False,
        checkpoint_every: int = 0,
        state_backup_row: int = -1,
        greedy_drafts_only: bool = False,
    ):
        self.kv = kv
        # A hybrid model: each running sequence's recurrent state lives in
        # the row of its lane; with kv.checkpoints, rows are saved at a
        # prompt's last token but one, every checkpoint_every prompt tokens
        # (0: never) and where a sequence leaves its lane, and restored where
        # a prompt resumes (engine/kv/state_checkpoints.py).
        self.recurrent_state = recurrent_state
        self.checkpoint_every = checkpoint_every
        # Under speculative decoding, lane i's state is copied to row
        # state_backup_row + i before a step verifies its drafts; a rejected
        # draft puts it back and recomputes the accepted tokens (-1: none).
        self.state_backup_row = state_backup_row
        self.num_state_rollbacks = 0
        # Checkpoints of sequences that finished since the last step: copied
        # before the next one, whatever runs in their lanes then.
        self._saves_before: list[RowCopy] = []
        # Speculative decoding (off: None): decode rows that may draft (greedy
        # or sampled, see may_draft) whose tokens are all on the host get up
        # to draft_tokens guesses verified per step.
        self.drafter = drafter if draft_tokens > 0 else None
        self.draft_tokens = draft_tokens
        # Batch-invariant mode: only greedy rows draft. A greedy row's
        # verified tokens are the argmaxes plain decoding takes; a sampled
        # row's would come from the speculative sampling rule, whose draws
        # depend on the draft lengths, which depend on the batch.
        self.greedy_drafts_only = greedy_drafts_only
        # The most tokens a verify step may hold (0: no bound): the decode
        # rows the runner's graphs take (engine/execution/step_inputs.py). A
        # larger one, or one beside prompt chunks, runs eagerly, and there
        # drafts cost more than they give; so they are left out.
        self.max_verify_rows = max_verify_rows
        # Steps scheduled: the clock switched-off rows probe again by
        # (engine/sampling/draft_length.py), the same for every row.
        self.clock = 0
        # Every row's verified positions: where a new row's draft length starts.
        self.draft_acceptance = DraftAcceptance()
        # What drafting costs here, measured from the engine's step times
        # (EngineCore._account): what every row's draft length weighs.
        self.draft_costs = DraftCosts()
        # The clock's step the step gate last passed (_drafts_pay).
        self._gate_passed_at = -1
        # The engine's cut of a row's draft (EngineCore sets it): before the
        # first token its grammar refuses, or a position whose token a
        # reasoning budget forces; None: drafts are kept whole.
        self.cut_draft: Callable[[Sequence, list[int]], list[int]] | None = None
        self.max_concurrency = max_concurrency
        self.max_batched_tokens = max_batched_tokens
        self.max_context = max_context
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_cached_tokens_total = 0
        # Which lane (llama.cpp's slot) each running sequence holds.
        self.lanes = Lanes(max_concurrency)

    # ---- queue -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def wants_drafts(self) -> bool:
        """Whether a running decode row may draft in the next step: it can
        only once every token of it is on the host, so the engine completes
        the step in flight before scheduling (engine/scheduling/core.py).
        Rows whose drafts do not pay are switched off for a while
        (engine/sampling/draft_length.py), so the loop overlaps again; so
        are all while the costs' calibration pauses drafting
        (engine/sampling/draft_cost.py)."""
        if self.drafter is None or self.draft_costs.pauses(self.clock + 1):
            return False
        return self._may_verify_next() and self._drafts_pay(self.clock + 1)

    def _drafting_rows(self, now: int) -> list[Sequence]:
        """The running decode rows whose drafts the step the clock calls now may carry."""
        return [seq for seq in self.running
                if not seq.is_prefilling and self._may_draft(seq.params)
                and seq.draft_length is not None and seq.draft_length.allows(now)]

    def _may_draft(self, params: SamplingParams) -> bool:
        return may_draft(params) and (params.greedy or not self.greedy_drafts_only)

    def _drafts_pay(self, now: int) -> bool:
        """Whether any row drafts in the step the clock calls now, after the
        step gate. Each row weighs its own draft with the fixed cost shared
        by the rows that drafted last time; but that cost is the whole
        step's (on a GPU, chiefly the overlap it and the step after it
        lose), so rows that draft now and then, a few at a time, paid it
        each time for a row's worth of tokens: on the H200 at the 0.6B
        shape, batch 32, with 30% of drafts wrong, 9-14% slower than plain
        (within 4% with this gate: docs/performance.md). So the step's drafts
        are weighed together: the tokens every row expects to keep against
        the whole fixed cost and the verified positions, and where they do
        not pay by MIN_GAIN the rows are switched off as a row whose own
        drafts do not pay is: they probe after their back-off, on the same
        steps of the clock, and drafting resumes where the probes are kept
        together. A probe always passes: what it is worth is what it tells
        (draft_length.py). Refused here, from wants_drafts, the drafts cost
        the loop nothing: it keeps its overlap. A step is weighed once: the
        verdict for wants_drafts holds for _add_drafts (the host's time of a
        drafting step is what drafting costs on a GPU)."""
        if self._gate_passed_at == now:
            return True
        rows = self._drafting_rows(now)
        if not rows:
            return False
        lengths: list[DraftLength] = [seq.draft_length for seq in rows]  # type: ignore[misc]
        if any(length.probes(now) for length in lengths):
            self._gate_passed_at = now
            return True
        verify_cost = self.draft_costs.costs[0]
        fixed = self.draft_costs.step_shares
        batch = len(self.running) - self.num_prefilling
        room = self.max_verify_rows - batch if self.max_verify_rows else 1 << 30
        max_context = self.max_context
        gain = 0.0
        tokens = 0
        for seq, length in zip(rows, lengths, strict=True):
            k = min(length.length, seq.params.max_tokens - seq.num_output_tokens - 1,
                    max_context - seq.num_tokens - 1, room - tokens)
            if k > 0:
                gain += expected_kept(length.acceptance, k)
                tokens += k
        if tokens and batch + gain >= MIN_GAIN * (batch + fixed + verify_cost * tokens):
            self._gate_passed_at = now
            return True
        for length in lengths:
            length.switch_off(now)
        return False

    @property
    def num_prefilling(self) -> int:
        return sum(1 for seq in self.running if seq.is_prefilling)

    def abort(self, request_ids: Iterable[str]) -> list[Sequence]:
        aborted = []
        for request_id in request_ids:
            seq = self._by_id.get(request_id)
            if seq is None:
                continue
            if seq.status is SeqStatus.RUNNING:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
            self._finish(seq, "abort")
            aborted.append(seq)
        return aborted

    # ---- one step ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_batched_tokens
        self.clock += 1
        out.state_copies_before, self._saves_before = self._saves_before, []

        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or seq.is_prefilling:
                continue
            if seq.num_uncomputed_tokens == 0:
                # A prompt scored to its end (max_tokens 0): it finishes when
                # its last step completes.
                continue
            if seq.num_output_tokens and self._ends_by_length(seq):
                # Its newest token, still on the device, is its last. (A
                # prompt being scored has no output: its last prompt token
                # still needs computing.)
                continue
            if not self._grow_or_preempt(seq, out):
                continue
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))
            budget -= 1
        if self.drafter is not None:
            budget = self._add_drafts(out, budget)

        for seq in self.running:
            if budget <= 0:
                break
            if seq.is_prefilling:
                # Admission gave a prefilling sequence pages for all its tokens.
                count = self._chunk_tokens(seq, budget)
                out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, count))
                budget -= count

        # Disk reads done meanwhile; a request whose restore ended may go in.
        self.kv.poll_restores()
        while self.waiting and budget > 0 and len(self.running) < self.max_concurrency:
            # The first in arrival order whose lane is free: one pinned to a
            # busy lane (id_slot) waits for it without holding up the rest,
            # and so does one whose prefix is being read from disk.
            seq = next((s for s in self.waiting if self.lanes.can_admit(s)
                        and not self.kv.is_restoring(s)), None)
            if seq is None:
                break
            first_admission = seq.num_output_tokens == 0 and not seq.block_table
            if not self.kv.try_admit(seq):
                if self.kv.is_restoring(seq):
                    continue  # its disk reads just started (KVManager.try_admit)
                break
            self.waiting.remove(seq)
            lane = self.lanes.assign(seq)
            if seq.state_restore is not None:
                host, index = seq.state_restore
                row = index if host else self._checkpoint_row(index)
                out.state_copies_before.append(RowCopy(row, lane, src_host=host))
                seq.state_restore = None
            if first_admission:
                seq.num_cached_tokens = seq.num_computed_tokens
                self.num_cached_tokens_total += seq.num_cached_tokens
            if self.drafter is not None and seq.draft_length is None:
                # At admission, not arrival: a row that starts switched off
                # probes on the clock's next back-off boundary from here,
                # with the rows admitted near it, however long it queued.
                seq.draft_length = DraftLength(self.draft_tokens, self.draft_acceptance,
                                               self.clock, self.draft_costs)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            count = self._chunk_tokens(seq, budget)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, count))
            budget -= count
        if out.is_empty and self.has_work() and not self.running and not self.kv.restoring:
            # Cannot happen while max_context fits in the pool (kv_sizing
            # guarantees it); fail loudly rather than spin.
            raise RuntimeError(f"scheduler stalled: {self.waiting[0]!r} can never be admitted")
        for chunk in out.chunks:
            seq = chunk.seq
            end = chunk.start + chunk.num_tokens
            if seq.params.prompt_logprobs >= 0:
                # Each position scores the prompt token after it, once (a
                # recompute after a preemption scores nothing again).
                first = max(chunk.start, seq.num_prompt_scored)
                last = min(end, seq.num_prompt_tokens - 1)
                if last > first:
                    chunk.scored = (first, last)
                    seq.num_prompt_scored = last
            # Computed as far as the scheduler is concerned: the device runs
            # this step before any later one reads these pages.
            seq.num_computed_tokens = end
            if self.recurrent_state:
                chunk.state_slot = self.lanes.index_of(seq)
                if chunk.draft:
                    assert self.state_backup_row >= 0, "drafts without state backups"
                    out.state_copies_before.append(
                        RowCopy(chunk.state_slot, self.state_backup_row + chunk.state_slot))
                if self._checkpoints_at(chunk):
                    self._save_state(seq, end, chunk.state_slot, out.state_copies_after)
        self.kv.unpin_copy_sources()
        return out

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> int:
        """Give the step's decode rows that may draft their guesses, within
        the token budget left after every decode row got its token and within
        the pages the pool can give without preempting; returns the budget
        left. A draft never runs past max_tokens or the context: all of it
        and the free token after it must fit. Each row drafts at most its
        DraftLength's limit, which learns from what the row's drafts keep."""
        assert self.drafter is not None
        if self.draft_costs.pauses(self.clock):
            return budget  # plain steps to measure (engine/sampling/draft_cost.py)
        if self.max_verify_rows:
            if not self._may_verify_next():
                return budget
            budget = min(budget, self.max_verify_rows - len(out.chunks))
        if not self._drafts_pay(self.clock):
            return budget
        batched = self._propose_batch(out, budget) if hasattr(self.drafter, "propose_batch") \
            else None
        for chunk in self._draft_order(out):
            if budget <= 0:
                break
            seq = chunk.seq
            control = seq.draft_length
            if control is None or not self._drafts_now(seq):
                continue
            limit = min(self._draft_limit(seq), budget)
            if batched is not None:
                draft = batched.get(seq.request_id, [])[: max(limit, 0)]
            else:
                draft = self.drafter.propose(seq.token_ids, limit) if limit > 0 else []
            if draft and self.cut_draft is not None:
                draft = self.cut_draft(seq, draft)
            if limit > 0 and not draft:
                # Nothing to guess, yet the step ran without overlap for it.
                control.record(0, 0, self.clock)
            if draft and self.kv.try_grow(seq, chunk.start + 1 + len(draft)):
                chunk.draft = draft
                chunk.num_tokens += len(draft)
                budget -= len(draft)
        return budget

    def _draft_order(self, out: SchedulerOutput) -> list[ScheduledChunk]:
        """The step's rows in the order they take the draft budget: from a
        row that moves on by one every step. A budget that runs out before
        the last row (a verify step's max_verify_rows) then leaves different
        rows without a draft each step; in running order the same rows would
        always draft and the rest, one token a step dearer than a plain one,
        would finish last and hold the batch's end back."""
        chunks = out.chunks
        if len(chunks) < 2:
            return chunks
        first = self.clock % len(chunks)
        return chunks[first:] + chunks[:first]

    def _drafts_now(self, seq: Sequence) -> bool:
        """Whether seq's decode row may take a draft this step: its request
        drafts at all and every token of it is on the host."""
        return (seq.draft_length is not None and self._may_draft(seq.params)
                and not seq.has_pending_token)

    def _may_verify_next(self) -> bool:
        """Whether the next step may verify drafts: no prompt chunk will run
        beside them (none prefilling, none waiting for a free lane) and its
        decode rows leave room under max_verify_rows."""
        if not self.max_verify_rows:
            return True
        # A request admitted in the same step would run its prompt chunk
        # beside the drafts, within the verify step's budget (a few tokens
        # where it would have had the whole step's): admission goes first.
        admits = bool(self.waiting) and len(self.running) < self.max_concurrency
        return (len(self.running) < self.max_verify_rows and not admits
                and not any(seq.is_prefilling for seq in self.running))

    def _draft_limit(self, seq: Sequence) -> int:
        """The most draft tokens seq may take: its DraftLength's limit, and
        all of the draft and the free token after it within max_tokens and
        the context."""
        assert seq.draft_length is not None
        return min(seq.draft_length.limit(self.clock),
                   seq.params.max_tokens - seq.num_output_tokens - 1,
                   self.max_context - seq.num_tokens - 1)

    def _propose_batch(self, out: SchedulerOutput, budget: int) -> dict[str, list[int]]:
        """A batch drafter's drafts (a draft model's: all rows in one pass per
        position) for the rows _add_drafts asks, by request id, each within
        the budget left if every row before it takes its whole draft."""
        rows: list[DraftRow] = []
        for chunk in self._draft_order(out):
            seq = chunk.seq
            if budget <= 0:
                break
            if not self._drafts_now(seq):
                continue
            limit = min(self._draft_limit(seq), budget)
            # A drafter that writes K/V in the target's pages (an MTP head)
            # needs them for the whole verify step before it drafts.
            if limit > 0 and getattr(self.drafter, "needs_pages", False) \
                    and not self.kv.try_grow(seq, chunk.start + 1 + limit):
                continue
            if limit > 0:
                rows.append(DraftRow(seq.request_id, seq.token_ids, limit,
                                     lane=self.lanes.index_of(seq), pages=seq.block_table))
                budget -= limit
        drafts = self.drafter.propose_batch(rows) if rows else []  # type: ignore[union-attr]
        return {row.key: draft for row, draft in zip(rows, drafts, strict=True)}

    # ---- recurrent state (hybrid models) ---------------------------------------

    def _chunk_tokens(self, seq: Sequence, budget: int) -> int:
        """The tokens of seq's next prompt chunk. With state checkpoints, a
        prompt of more than a page ends its prefill one token early, so a
        checkpoint holds the state just before its last token: the deepest
        point a later request with the same prompt can resume from (its last
        token is always computed)."""
        count = min(seq.num_uncomputed_tokens, budget)
        if (self._checkpointing and count == seq.num_uncomputed_tokens
                and count > 1 and seq.num_output_tokens == 0
                and seq.num_prompt_tokens > self.kv.page_size and takes_hits(seq.params)):
            count -= 1
        return count

    def _checkpoints_at(self, chunk: ScheduledChunk) -> bool:
        """Whether the state after this (prompt) chunk is saved."""
        seq, end = chunk.seq, chunk.start + chunk.num_tokens
        if (not self._checkpointing or chunk.num_tokens < 2 or chunk.draft
                or not takes_hits(seq.params)):
            return False
        if seq.num_output_tokens == 0 and end == seq.num_prompt_tokens - 1:
            return True  # cut there by _chunk_tokens
        return 0 < self.checkpoint_every <= end - seq.last_checkpoint

    @property
    def _checkpointing(self) -> bool:
        return self.kv.checkpoints is not None and self.kv.checkpoints.count > 0

    def _checkpoint_row(self, index: int) -> int:
        return self.max_concurrency + index

    def _save_state(self, seq: Sequence, length: int, lane: int,
                    copies: list[RowCopy]) -> None:
        """Queue a copy of lane's state, which holds seq's first `length`
        tokens by the time the copy runs, to a checkpoint keyed by them
        (unless one holds them already, or one of them is still on the device)."""
        checkpoints = self.kv.checkpoints
        if checkpoints is None or not 0 < length <= seq.num_tokens:
            return
        tokens = seq.token_ids[:length]
        if min(tokens) < 0:
            return
        index, moved = checkpoints.save(checkpoints.key(tokens, length, seq.block_hashes))
        seq.last_checkpoint = length
        if moved is not None:
            # The checkpoint that made room goes to a host row first.
            copies.append(RowCopy(self._checkpoint_row(moved[0]), moved[1], dst_host=True))
        if index is not None:
            copies.append(RowCopy(lane, self._checkpoint_row(index)))

    def _checkpoint_leaving(self, seq: Sequence, copies: list[RowCopy]) -> None:
        """seq leaves its lane (finished, aborted or preempted): save its state
        where it got to, for a later turn of its conversation (or its own
        readmission) to resume from."""
        if (self._checkpointing and seq.status is SeqStatus.RUNNING
                and takes_hits(seq.params) and seq.num_computed_tokens > seq.last_checkpoint):
            self._save_state(seq, seq.num_computed_tokens, self.lanes.index_of(seq), copies)

    def _ends_by_length(self, seq: Sequence) -> bool:
        """seq's tokens so far (a pending one included) reach max_tokens or the context."""
        return seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_context

    def _grow_or_preempt(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Find a page for seq's next token, preempting the newest sequences.

        Returns False when seq itself had to be preempted.
        """
        while not self.kv.try_grow(seq, seq.num_computed_tokens + 1):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._checkpoint_leaving(seq, out.state_copies_before)
        self.running.remove(seq)
        self.lanes.release(seq, finished=False)
        self.kv.free(seq)
        if seq.media is not None:
            # Its images are encoded again if it must compute them again: a
            # waiting sequence holds no device memory.
            seq.media.encoded.clear()
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def add_pending_tokens(self, out: SchedulerOutput, first_slot: int,
                           rows: Container[int] | None = None) -> None:
        """The step's sampling has been launched (for all its sampling chunks,
        or for those whose index among them is in rows): each such chunk's
        sequence gets a placeholder for its token, sampling chunk i's naming
        future slot first_slot + i."""
        row = 0
        for chunk in out.chunks:
            if not chunk.samples:
                continue
            # (A sequence that finished meanwhile gets no placeholder: this
            # step's work for it is dropped.)
            if (rows is None or row in rows) and chunk.seq.status is not SeqStatus.FINISHED:
                chunk.token_index = chunk.seq.num_tokens
                chunk.seq.token_ids.append(-(first_slot + row + 1))
            row += 1

    def complete(self, out: SchedulerOutput, sampled: list[int],
                 completed: Container[str] = (), verified: Iterable[int] = ()
                 ) -> list[ScheduledChunk]:
        """Apply a step whose tokens are known: each sampled token replaces its
        placeholder, full pages go to the prefix cache, and sequences finish;
        `completed` names requests whose grammar is complete, which stop
        whatever their token (ignore_eos too). Sequences that finished (or were
        aborted) since this step was scheduled are skipped. Returns the
        chunks whose sequence got a token (at seq.token_ids[chunk.token_index]),
        or finished without one (a prompt scored with max_tokens 0: token_index
        -1). `verified` holds the target's tokens at the step's draft
        positions, in chunk order (engine/sampling/verify.py): a chunk with a
        draft gets its accepted tokens after the sampled one
        (seq.token_ids[chunk.token_index : chunk.token_index + 1 +
        chunk.accepted]), and its cache is cut back to them."""
        changed: list[ScheduledChunk] = []
        tokens = iter(sampled)
        targets = iter(verified)
        for chunk in out.chunks:
            token = next(tokens) if chunk.samples else None
            row_targets = [next(targets) for _ in chunk.draft]
            seq = chunk.seq
            if seq.status is SeqStatus.FINISHED:
                continue
            if token is not None:
                seq.token_ids[chunk.token_index] = token
            reason = None
            if chunk.draft and token is not None:
                reason = self._accept_draft(chunk, token, row_targets,
                                            seq.request_id in completed)
            if seq.status is SeqStatus.RUNNING:
                # Every token the cache holds is known now (the next step's
                # input is this step's sample), so full pages can be hashed.
                self.kv.commit(seq)
            if token is None:
                if (seq.params.max_tokens == 0 and seq.status is SeqStatus.RUNNING
                        and chunk.start + chunk.num_tokens >= seq.num_prompt_tokens):
                    # The prompt is scored; nothing was to be generated.
                    self.running.remove(seq)
                    self._finish(seq, "length")
                    changed.append(chunk)
                continue
            changed.append(chunk)
            if not chunk.draft:
                reason = ("stop" if seq.request_id in completed
                          else self._finish_reason(seq, token, chunk.token_index + 1))
            if reason is not None:
                # A step scheduled after this one may have given it a placeholder.
                del seq.token_ids[chunk.token_index + 1 + chunk.accepted:]
                if seq.status is SeqStatus.RUNNING:
                    self.running.remove(seq)
                else:
                    self.waiting.remove(seq)  # preempted while this step ran
                self._finish(seq, reason)
        return changed

    def _accept_draft(self, chunk: ScheduledChunk, token: int, targets: list[int],
                      grammar_done: bool = False) -> str | None:
        """Append the draft tokens the target agrees with after token (the
        chunk's sampled one), up to the first that ends the sequence, and cut
        its computed tokens back to them. Returns why it ends, or None.
        grammar_done: the row's grammar ended with the last token the step
        emitted (never before: no draft holds a token that ends it)."""
        seq = chunk.seq
        # A row drafts only with every token on the host, and nothing is
        # scheduled for it before this step completes: its placeholder is last.
        assert chunk.token_index == seq.num_tokens - 1, "a drafted row got another placeholder"
        reason = self._finish_reason(seq, token, seq.num_tokens)
        emitted = accept_drafts(token, chunk.draft, targets)
        for extra in emitted[1:]:
            if reason is not None:
                break
            seq.token_ids.append(extra)
            chunk.accepted += 1
            reason = self._finish_reason(seq, extra, seq.num_tokens)
        if grammar_done and chunk.accepted == len(emitted) - 1:
            reason = "stop"  # as for a plain row: the grammar's end outranks the length
        if seq.draft_length is not None:
            seq.draft_length.record(len(chunk.draft), chunk.accepted, self.clock)
        if seq.status is SeqStatus.RUNNING:
            # The cache holds K/V for the chunk's first token and the accepted
            # drafts; the rejected positions past them are written over later.
            seq.num_computed_tokens = chunk.start + 1 + chunk.accepted
            if self.recurrent_state and chunk.accepted < len(chunk.draft):
                # The recurrent state went through the rejected drafts too and
                # cannot be cut back: the state from before the step returns
                # and the next step computes the kept tokens again (their K/V
                # come out the same; the recurrent kernels do not depend on
                # how a sequence's tokens are split into steps).
                lane = chunk.state_slot
                self._saves_before.append(RowCopy(self.state_backup_row + lane, lane))
                seq.num_computed_tokens = chunk.start
                self.num_state_rollbacks += 1
            self.kv.trim(seq)
        return reason

    def update(self, out: SchedulerOutput, sampled: list[int],
               completed: Container[str] = ()) -> list[ScheduledChunk]:
        """A step whose tokens are known as soon as it runs (no step in flight)."""
        self.add_pending_tokens(out, 0)
        return self.complete(out, sampled, completed)

    def _finish_reason(self, seq: Sequence, token: int, num_tokens: int) -> str | None:
        """Why seq ends with token, its num_tokens-th token (None: it goes on)."""
        params = seq.params
        # The router sends every stop token, the model's end-of-sequence ids
        # included (unless ignore_eos): the engine keeps no list of its own.
        if token in params.stop_token_ids:
            return "stop"
        if num_tokens - seq.num_prompt_tokens >= params.max_tokens or num_tokens >= self.max_context:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._checkpoint_leaving(seq, self._saves_before)
        self.lanes.release(seq, finished=True)
        self.kv.free(seq)
        if hasattr(self.drafter, "forget"):
            self.drafter.forget(seq.request_id)  # type: ignore[union-attr]  # its draft KV
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason  # type: ignore[assignment]
        del self._by_id[seq.request_id]

    def check_invariants(self) -> None:
        self.kv.check_invariants(self.running)
        if self.kv.checkpoints is not None:
            self.kv.checkpoints.check_invariants()
        assert len(self.running) <= self.max_concurrency
        for seq in self.running:
            assert seq.status is SeqStatus.RUNNING
            assert len(seq.block_table) >= self.kv.pages_for(seq.num_computed_tokens)
        for seq in self.waiting:
            assert seq.status is SeqStatus.WAITING and not seq.block_table
