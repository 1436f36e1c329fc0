"""Penalties over the tokens so far, kept on the device and applied to the
whole batch at once.

Each request with penalties (SamplingParams.has_penalties) holds a lane: a
row of `counts` (float32 [lanes, vocab], whole numbers: exact to 2^24, and
already the logits' type) and of `in_prompt` (bool [lanes, vocab]). Without
a window (penalty_last_n 0, OpenAI's rule) counts are the generated tokens'
and in_prompt marks the prompt's tokens, so the repetition penalty sees
prompt and output and presence/frequency output only. With a window of N
(llama.cpp's repeat_last_n) counts are those of the last N tokens of the
context and in_prompt stays empty: all three penalties read the window.
The numbers are those of the per-row formulas (repetition: positive logits
divided, negative multiplied; then logit -= count x frequency + (count > 0)
x presence), element for element: on a GPU over every entry of the rows,
with no sync; on the CPU only where a token was seen.

A lane is filled from the sequence's tokens the first time it is sampled
(and again whenever the lane no longer matches it: after its lane was given
to another request, or for another Sequence under the same request id). A
lane that holds the first of its sequence's tokens but not the newest (a
verify step's accepted drafts) counts those on top, one at a time as
sampling them would have.
After each draw the sampled tokens are added to their lanes with one
index_add for the batch, and a windowed lane loses the token that leaves its
window, so the state follows the sequence on the device and a penalty row
needs nothing from the host: it is sampled ahead of the step before like a
plain row. Its newest token may still be on the device: a placeholder
-(slot + 1) in its token ids, read through the `resolve` the model runner
passes (engine/execution/future_tokens.py), without waiting.

Speculative decoding (engine/sampling/verify.py): at a verify chunk's draft
positions, apply_ahead penalises with a copy of each lane's counts plus the
draft tokens the position's context holds (and minus those they push out of
a window); the lane itself only ever counts the tokens a row keeps, so a
rejected draft leaves nothing behind.

Memory: lanes x vocab x 5 bytes, allocated at the first penalty request and
grown LANE_STEP lanes at a time (a lane of a preempted request is taken
back first), dropped when no request holds a lane (so an engine asleep
holds none). Its most, for every lane, is reserved in the KV sizing
(engine/execution/gpu_memory.py, penalty_state_bytes): Qwen3's 151,936-token
vocabulary at 64 lanes is 46 MiB.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine.scheduling.sequence import SeqStatus, Sequence

# Lanes are added this many at a time.
LANE_STEP = 8
# Device bytes per lane per vocabulary entry: a float32 count and a bool.
BYTES_PER_ENTRY = 5

# Placeholder ids -> token ids, on the device, without a host sync.
Resolve = Callable[[torch.Tensor], torch.Tensor]


def penalty_state_bytes(lanes: int, vocab: int) -> int:
    """The most device memory PenaltyState takes with `lanes` requests at once."""
    return -(-lanes // LANE_STEP) * LANE_STEP * vocab * BYTES_PER_ENTRY


@dataclass
class _Lane:
    index: int
    seq: Sequence  # the Sequence it follows (a new one under the same id starts afresh)
    counted: int  # how many of seq's token ids the lane holds


class PenaltyState:
    def __init__(self, device: torch.device, sparse: bool | None = None) -> None:
        """sparse: touch only the entries of tokens seen (finding them syncs
        with the device); by default on the CPU, where it is several times
        faster and nothing waits."""
        self.device = device
        self.sparse = device.type == "cpu" if sparse is None else sparse
        self.counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None
        self._lanes: dict[str, _Lane] = {}
        self._free: list[int] = []

    @property
    def num_lanes(self) -> int:
        return 0 if self.counts is None else self.counts.shape[0]

    def free(self, request_id: str) -> None:
        """The request ended: its lane goes back, and the tensors when no lane is held."""
        lane = self._lanes.pop(request_id, None)
        if lane is None:
            return
        self._free.append(lane.index)
        if not self._lanes:
            # Later work queued on these tensors is ordered before any reuse
            # of their memory by torch's allocator (same stream).
            self.counts = self.in_prompt = None
            self._free = []

    def apply(self, logits: torch.Tensor, seqs: Seq[Sequence],
              resolve: Resolve | None = None) -> AppliedPenalties | None:
        """Penalise the rows of logits (float32 [N, vocab], row i for seqs[i])
        whose request has penalties, in place; the result's record() must
        then be given the batch's sampled tokens. None when no row has
        penalties. A finished sequence (its token is dropped) is left as is."""
        rows = _penalty_rows(seqs)
        if not rows:
            return None
        chosen = [seqs[row] for row in rows]
        lanes = self._take_lanes(chosen, logits.shape[1], resolve)
        return self._penalise(logits, rows, chosen, lanes, resolve)

    def apply_ahead(self, logits: torch.Tensor, seqs: Seq[Sequence],
                    ahead: Seq[Seq[int]] | None, resolve: Resolve | None = None) -> None:
        """Penalise, in place, rows of logits (row i for seqs[i]) whose
        position's context runs past its sequence's tokens by ahead[i] (a
        verify chunk's draft tokens up to row i's own): as apply() would
        once those tokens were sampled, without recording anything."""
        rows = _penalty_rows(seqs)
        if not rows:
            return
        assert ahead is not None, "penalty rows at draft positions need their draft tokens"
        chosen = [seqs[row] for row in rows]
        lanes = self._take_lanes(chosen, logits.shape[1], resolve)
        assert self.counts is not None
        index = _pairs(rows, [lane.index for lane in lanes], logits.device)
        counts = self.counts.index_select(0, index[1])
        # Row k of the copy: each draft token comes in; with a window, the
        # token it pushes out leaves (a draft token itself past the window).
        at: list[int] = []
        ids: list[int] = []
        signs: list[float] = []
        for k, (row, seq) in enumerate(zip(rows, chosen, strict=True)):
            extra = list(ahead[row])
            window = seq.params.penalty_last_n
            known = seq.num_tokens
            for j, token in enumerate(extra):
                at.append(k)
                ids.append(token)
                signs.append(1.0)
                leaving = known + j - window
                if window > 0 and leaving >= 0:
                    at.append(k)
                    ids.append(seq.token_ids[leaving] if leaving < known else extra[leaving - known])
                    signs.append(-1.0)
        if ids:
            where = _flat(at, ids, counts.shape[1], counts.device, resolve)
            counts.view(-1).index_add_(0, where, _values(signs, counts))
        self._penalise_rows(logits, index, chosen, counts)

    # ---- lanes ---------------------------------------------------------------

    def _take_lanes(self, seqs: list[Sequence], vocab: int,
                    resolve: Resolve | None) -> list[_Lane]:
        """The lane of each of seqs (one may come several times), holding all
        its tokens: filled afresh, or brought up to date."""
        if self.counts is not None and self.counts.shape[1] != vocab:
            raise ValueError(f"logits of {vocab} tokens, penalty counts of {self.counts.shape[1]}")
        taking = {id(seq) for seq in seqs}
        lanes: dict[int, _Lane] = {}
        stale: list[_Lane] = []
        behind: list[_Lane] = []
        for seq in seqs:
            if id(seq) in lanes:
                continue
            lane, holds_prefix = self._lane_for(seq, taking, vocab)
            lanes[id(seq)] = lane
            if not holds_prefix:
                stale.append(lane)
            elif lane.counted < seq.num_tokens:
                behind.append(lane)
        if stale:
            self._fill(stale, resolve)
        if behind:
            self._catch_up(behind, resolve)
        return [lanes[id(seq)] for seq in seqs]

    def _lane_for(self, seq: Sequence, taking: set[int], vocab: int) -> tuple[_Lane, bool]:
        """seq's lane, and whether it holds the first lane.counted of seq's
        tokens (tokens are only ever appended to a running sequence)."""
        lane = self._lanes.get(seq.request_id)
        if lane is not None:
            if lane.seq is seq and lane.counted <= seq.num_tokens:
                return lane, True
            lane.seq = seq
            return lane, False
        if not self._free and not self._evict(taking):
            self._grow(vocab)
        lane = _Lane(self._free.pop(), seq, 0)
        self._lanes[seq.request_id] = lane
        return lane, False

    def _evict(self, taking: set[int]) -> bool:
        """Free the lane of a request not in this batch and not running (a
        preempted one, refilled when it runs again); False if none."""
        for request_id, lane in self._lanes.items():
            if id(lane.seq) not in taking and lane.seq.status is not SeqStatus.RUNNING:
                del self._lanes[request_id]
                self._free.append(lane.index)
                return True
        return False

    def _grow(self, vocab: int) -> None:
        old = self.num_lanes
        counts = torch.zeros((old + LANE_STEP, vocab), dtype=torch.float32, device=self.device)
        in_prompt = torch.zeros((old + LANE_STEP, vocab), dtype=torch.bool, device=self.device)
        if self.counts is not None and self.in_prompt is not None:
            counts[:old].copy_(self.counts)
            in_prompt[:old].copy_(self.in_prompt)
        self.counts, self.in_prompt = counts, in_prompt
        self._free.extend(range(old + LANE_STEP - 1, old - 1, -1))

    def _fill(self, lanes: list[_Lane], resolve: Resolve | None) -> None:
        """Set each lane from its sequence's token ids (its newest one may be a placeholder)."""
        assert self.counts is not None and self.in_prompt is not None
        counted_ids: list[int] = []
        counted_lanes: list[int] = []
        prompt_ids: list[int] = []
        prompt_lanes: list[int] = []
        for lane in lanes:
            seq = lane.seq
            params = seq.params
            window = params.penalty_last_n
            if window > 0:
                counted = seq.token_ids[-window:]
            else:
                counted = seq.output_token_ids
                if params.repetition_penalty != 1.0:
                    prompt = seq.token_ids[: seq.num_prompt_tokens]
                    prompt_ids.extend(prompt)
                    prompt_lanes.extend([lane.index] * len(prompt))
            counted_ids.extend(counted)
            counted_lanes.extend([lane.index] * len(counted))
            lane.counted = seq.num_tokens
        which = torch.tensor([lane.index for lane in lanes], dtype=torch.int64)
        which = which.to(self.device, non_blocking=True)
        self.counts.index_fill_(0, which, 0)
        self.in_prompt.index_fill_(0, which, False)
        vocab = self.counts.shape[1]
        if counted_ids:
            where = _flat(counted_lanes, counted_ids, vocab, self.device, resolve)
            self.counts.view(-1).index_add_(0, where, torch.ones_like(where, dtype=torch.float32))
        if prompt_ids:
            # Prompt tokens are always known on the host.
            self.in_prompt.view(-1).index_fill_(0, _flat(prompt_lanes, prompt_ids, vocab,
                                                         self.device, None), True)

    def _catch_up(self, lanes: list[_Lane], resolve: Resolve | None) -> None:
        """Count the tokens each lane's sequence gained past lane.counted, as
        sampling them one at a time would have: each comes in, and with a
        window the token it pushes out leaves."""
        assert self.counts is not None
        at: list[int] = []
        ids: list[int] = []
        signs: list[float] = []
        for lane in lanes:
            seq = lane.seq
            window = seq.params.penalty_last_n
            for position in range(lane.counted, seq.num_tokens):
                at.append(lane.index)
                ids.append(seq.token_ids[position])
                signs.append(1.0)
                if 0 < window <= position:
                    at.append(lane.index)
                    ids.append(seq.token_ids[position - window])
                    signs.append(-1.0)
            lane.counted = seq.num_tokens
        where = _flat(at, ids, self.counts.shape[1], self.device, resolve)
        self.counts.view(-1).index_add_(0, where, _values(signs, self.counts))

    # ---- one batch -----------------------------------------------------------

    def _penalise(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence],
                  lanes: list[_Lane], resolve: Resolve | None) -> AppliedPenalties:
        assert self.counts is not None and self.in_prompt is not None
        device = logits.device
        index = _pairs(rows, [lane.index for lane in lanes], device)
        self._penalise_rows(logits, index, seqs, self.counts.index_select(0, index[1]))
        # Each windowed lane loses the token that leaves its window when the
        # sampled one comes in (if the window is full).
        leaving_lanes: list[int] = []
        leaving_ids: list[int] = []
        for seq, lane in zip(seqs, lanes, strict=True):
            lane.counted += 1
            window = seq.params.penalty_last_n
            if 0 < window <= seq.num_tokens:
                leaving_lanes.append(lane.index)
                leaving_ids.append(seq.token_ids[-window])
        leaving = (_flat(leaving_lanes, leaving_ids, self.counts.shape[1], device, resolve)
                   if leaving_ids else None)
        return AppliedPenalties(self.counts, index, leaving)

    def _penalise_rows(self, logits: torch.Tensor, index: torch.Tensor, seqs: list[Sequence],
                       counts: torch.Tensor) -> None:
        """Penalise logits' rows index[0] (of seqs) in place by counts (a
        copy, used up) and their lanes' (index[1]) in_prompt."""
        assert self.in_prompt is not None
        settings = torch.tensor([[s.params.repetition_penalty, s.params.frequency_penalty,
                                  s.params.presence_penalty] for s in seqs], dtype=torch.float32)
        settings = settings.to(logits.device, non_blocking=True).to(logits.dtype).T.unsqueeze(2)
        every_row = index.shape[1] == logits.shape[0]
        chosen = logits if every_row else logits.index_select(0, index[0])
        # A penalty no row of the batch has is skipped: it would change nothing.
        seen = (self.in_prompt.index_select(0, index[1])
                if any(s.params.repetition_penalty != 1.0 for s in seqs) else None)
        penalise = _penalise_sparse if self.sparse else _penalise_dense
        chosen = penalise(chosen, counts, seen, settings,
                          frequency=any(s.params.frequency_penalty for s in seqs),
                          presence=any(s.params.presence_penalty for s in seqs))
        if not every_row:
            logits.index_copy_(0, index[0], chosen)
        elif chosen is not logits:
            logits.copy_(chosen)


def _penalise_dense(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor | None,
                    settings: torch.Tensor, *, frequency: bool, presence: bool) -> torch.Tensor:
    """The penalised logits [P, vocab] from every entry of the rows: no host
    sync, a fixed number of passes (the device's way). counts: the rows'
    lanes' counts (a copy, used up); seen: their in_prompt rows (a copy),
    None when no row has a repetition penalty; settings [3, P, 1]."""
    present = counts > 0
    if seen is not None:
        seen.logical_or_(present)
        # As llama.cpp and transformers: a positive logit is divided by the
        # repetition penalty, a negative one multiplied.
        logits = torch.where(seen, torch.where(logits > 0, logits / settings[0],
                                               logits * settings[0]), logits)
    if frequency:
        logits = logits - counts.mul_(settings[1])
    if presence:
        logits = logits - torch.where(present, settings[2], 0.0)
    return logits


def _penalise_sparse(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor | None,
                     settings: torch.Tensor, *, frequency: bool, presence: bool) -> torch.Tensor:
    """_penalise_dense's numbers, computed only where a token was seen: the
    host's way, where finding those entries costs no sync. Writes logits."""
    present = counts > 0
    if seen is not None:
        at = seen.logical_or_(present).nonzero(as_tuple=True)
        values, factor = logits[at], settings[0, :, 0][at[0]]
        logits[at] = torch.where(values > 0, values / factor, values * factor)
    if frequency or presence:
        at = present.nonzero(as_tuple=True)
        values = logits[at]
        if frequency:
            values = values - counts[at] * settings[1, :, 0][at[0]]
        if presence:
            # (count > 0) x presence, for the present entries: presence itself.
            values = values - settings[2, :, 0][at[0]]
        logits[at] = values
    return logits


class AppliedPenalties:
    """One batch's penalty rows, waiting for their sampled tokens."""

    def __init__(self, counts: torch.Tensor, index: torch.Tensor, leaving: torch.Tensor | None):
        self._counts = counts
        self._index = index  # [2, P]: logits rows, their lanes
        self._leaving = leaving  # flat counts positions of tokens leaving a window

    def record(self, tokens: torch.Tensor) -> None:
        """tokens: int64 [N] on the device, the batch's sampled tokens; each
        penalty row's is counted in its lane (no host sync)."""
        vocab = self._counts.shape[1]
        rows, lanes = self._index
        where = lanes * vocab + tokens.index_select(0, rows)
        ones = torch.ones_like(where, dtype=self._counts.dtype)
        if self._leaving is not None:
            where = torch.cat((where, self._leaving))
            ones = torch.cat((ones, torch.full_like(self._leaving, -1, dtype=self._counts.dtype)))
        self._counts.view(-1).index_add_(0, where, ones)


def _penalty_rows(seqs: Seq[Sequence]) -> list[int]:
    """Rows of seqs with penalties; a finished sequence (its token is dropped) has none."""
    return [row for row, seq in enumerate(seqs)
            if seq.params.has_penalties and seq.status is not SeqStatus.FINISHED]


def _pairs(rows: list[int], lanes: list[int], device: torch.device) -> torch.Tensor:
    """int64 [2, P] on the device: logits rows, their lanes."""
    return torch.tensor([rows, lanes], dtype=torch.int64).to(device, non_blocking=True)


def _values(signs: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(signs, dtype=like.dtype).to(like.device, non_blocking=True)


def _flat(lanes: list[int], ids: list[int], vocab: int, device: torch.device,
          resolve: Resolve | None) -> torch.Tensor:
    """Positions lane * vocab + id in a flattened [lanes, vocab] tensor, on
    the device; a placeholder id is resolved there."""
    pairs = torch.tensor([lanes, ids], dtype=torch.int64).to(device, non_blocking=True)
    lane, token = pairs
    if min(ids) < 0:
        if resolve is None:
            raise RuntimeError("a penalty row's tokens hold a placeholder, and the sampler "
                               "was given no way to read it from the device")
        token = resolve(token)
    return lane * vocab + token
