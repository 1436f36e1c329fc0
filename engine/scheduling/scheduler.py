"""Continuous batching with chunked prefill under a per-step token budget.

Each step, in this order:
1. every running sequence that is decoding gets one token (so a long prompt
   never stalls running streams for more than one chunk);
2. running sequences still prefilling get chunks from what budget is left;
3. waiting sequences are admitted in arrival order while there is a free
   lane, budget and KV (KVManager.try_admit); the first one that doesn't fit
   stops admission, so nobody is overtaken and starved.
When a decoding sequence needs a page and none is free, the most recently
admitted running sequence is preempted: its pages are released (full ones stay
in the prefix cache), and it goes back to the front of the queue, to be
recomputed from its prompt and the tokens it already produced.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterable
from dataclasses import dataclass, field

from engine.kv.kv_manager import KVManager
from engine.scheduling.sequence import SeqStatus, Sequence


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # tokens already in the cache before this step
    num_tokens: int

    @property
    def samples(self) -> bool:
        """This chunk reaches the sequence's newest token, so a token is sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

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
    ):
        self.kv = kv
        self.max_concurrency = max_concurrency
        self.max_batched_tokens = max_batched_tokens
        self.max_context = max_context
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_cached_tokens_total = 0

    # ---- queue -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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

        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or seq.is_prefilling:
                continue
            if not self._grow_or_preempt(seq, out):
                continue
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))
            budget -= 1

        for seq in self.running:
            if budget <= 0:
                break
            if seq.is_prefilling:
                # Admission gave a prefilling sequence pages for all its tokens.
                count = min(seq.num_uncomputed_tokens, budget)
                out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, count))
                budget -= count

        while self.waiting and budget > 0 and len(self.running) < self.max_concurrency:
            seq = self.waiting[0]
            first_admission = seq.num_output_tokens == 0 and not seq.block_table
            if not self.kv.try_admit(seq):
                break
            self.waiting.popleft()
            if first_admission:
                seq.num_cached_tokens = seq.num_computed_tokens
                self.num_cached_tokens_total += seq.num_cached_tokens
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            count = min(seq.num_uncomputed_tokens, budget)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, count))
            budget -= count
        if out.is_empty and self.has_work() and not self.running:
            # Cannot happen while max_context fits in the pool (kv_sizing
            # guarantees it); fail loudly rather than spin.
            raise RuntimeError(f"scheduler stalled: {self.waiting[0]!r} can never be admitted")
        return out

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
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def update(self, out: SchedulerOutput, sampled: list[int],
               completed: Container[str] = ()) -> list[Sequence]:
        """Apply a finished step: advance progress, append sampled tokens, and
        finish sequences; `completed` names requests whose grammar is complete,
        which stop whatever their token (ignore_eos too). Returns the
        sequences that got a token or finished."""
        changed: list[Sequence] = []
        tokens = iter(sampled)
        for chunk in out.chunks:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            self.kv.commit(seq)
            if not chunk.samples:
                continue
            token = next(tokens)
            seq.token_ids.append(token)
            changed.append(seq)
            reason = "stop" if seq.request_id in completed else self._finish_reason(seq, token)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
        return changed

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        # The router sends every stop token, the model's end-of-sequence ids
        # included (unless ignore_eos): the engine keeps no list of its own.
        if token in params.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_context:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.kv.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason  # type: ignore[assignment]
        del self._by_id[seq.request_id]

    def check_invariants(self) -> None:
        self.kv.check_invariants(self.running)
        assert len(self.running) <= self.max_concurrency
        for seq in self.running:
            assert seq.status is SeqStatus.RUNNING
            assert len(seq.block_table) >= self.kv.pages_for(seq.num_computed_tokens)
        for seq in self.waiting:
            assert seq.status is SeqStatus.WAITING and not seq.block_table
