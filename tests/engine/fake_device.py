"""A stand-in for the model runner that checks the pipeline's ordering rules.

FakeDevice answers EngineCore's calls (forward, sample, the future-token
buffer) like an asynchronous device would, with a toy model whose next token
depends on the whole context as the device's KV pages hold it: a page handed
to the wrong sequence, a KV write missed, or a placeholder read from the wrong
slot all change the tokens. It runs nothing until the host asks for a step's
tokens, as a GPU runs behind its host, and it asserts what the real device
relies on:
- a placeholder input id names a slot written by the launch just before;
- a half of the future buffer is written again only when no sequence the
  host still knows holds a placeholder into it (its tokens were taken);
- a step's tokens (one or two parts) are taken once and in launch order; `overlap` records how
  many launches had been made when each step's tokens were taken (one more
  than the step's own when the host worked behind the device).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.execution.future_tokens import FutureTokens
from engine.execution.model_runner import SampledTokens
from engine.execution.step_inputs import StepInputs, build_step_inputs
from engine.kv.host_tier import KVTransfers
from engine.sampling.token_mask import TokenMask
from engine.scheduling.scheduler import Scheduler, SchedulerOutput

VOCAB = 64


def next_token(context: list[int]) -> int:
    """The toy model: a token that depends on every token of the context and its order."""
    value = len(context)
    for token in context:
        value = (value * 31 + token) % 1_000_003
    return value % VOCAB


@dataclass
class FakeForward:
    inputs: StepInputs
    logits: object  # "rows" stand-in: the model's token per sampling row, once run
    launch: int
    scores: list[object] = field(default_factory=list)  # no prompt scoring here
    pooled: object = None  # nor embeddings
    verified: SampledTokens | None = None  # the model's token at each draft row


@dataclass
class FakeTokens:
    device: FakeDevice
    launch: int
    tokens: list[int] = field(default_factory=list)
    taken: bool = False

    def tolist(self) -> list[int]:
        assert not self.taken, "a step's tokens were taken twice"
        self.device.take(self.launch)
        self.taken = True
        return self.tokens

    def logprobs(self) -> list[None]:
        return [None] * len(self.tokens)


class FakeDevice:
    def __init__(self, scheduler: Scheduler, lanes: int) -> None:
        self.scheduler = scheduler
        self.device = torch.device("cpu")
        self.future = FutureTokens(lanes, self.device)
        self.kv: dict[int, int] = {}  # cache slot -> token id
        self.page_size = scheduler.kv.page_size
        self.launches = 0
        self.taken: list[int] = []
        self.overlap: list[tuple[int, int]] = []  # (launch taken, launches made by then)
        self.slot_writer: dict[int, int] = {}  # future slot -> launch that wrote it
        self.masks_seen: list[tuple[int, list[int]]] = []  # (launch, masked rows)
        self.forced_seen: list[tuple[int, int]] = []  # (launch, forced token)
        self.half_owner: dict[int, int] = {}  # first slot of a half -> launch writing it
        # ("sample", launch, rows) and ("take", launch, ()) in the order they happened.
        self.events: list[tuple[str, int, tuple[int, ...]]] = []
        self.verify_launches: list[int] = []  # launches that verified drafts

    # ---- EngineCore's calls -------------------------------------------------

    def forward(self, out: SchedulerOutput,
                draft_masks: Callable[[], TokenMask | None] | None = None) -> FakeForward:
        self.launches += 1
        inputs = build_step_inputs(out, self.page_size)
        ids = inputs.input_ids.copy()
        for i, token in enumerate(ids.tolist()):
            if token < 0:
                slot = -token - 1
                assert self.slot_writer.get(slot) == self.launches - 1, (
                    f"launch {self.launches} reads future slot {slot}, written by launch "
                    f"{self.slot_writer.get(slot)}, not by the launch just before")
                ids[i] = int(self.future.buffer[slot])
        for token, slot in zip(ids.tolist(), inputs.slot_mapping.tolist(), strict=True):
            self.kv[slot] = token
        rows = [self._model_token(inputs, row, seq_row) for row, seq_row in
                zip(inputs.sample_rows, self._rows_of(inputs, inputs.sample_rows), strict=True)]
        verified = None
        if inputs.draft_rows:
            self.verify_launches.append(self.launches)
            verified = SampledTokens([
                self._model_token(inputs, row, seq_row) for row, seq_row in
                zip(inputs.draft_rows, self._rows_of(inputs, inputs.draft_rows), strict=True)])
            mask = draft_masks() if draft_masks is not None else None
            assert mask is None, "the toy model has no grammar vocabulary"
        return FakeForward(inputs, rows if inputs.sample_rows else None, self.launches,
                           verified=verified)

    def _model_token(self, inputs: StepInputs, row: int, seq_row: int) -> int:
        """The toy model's token after flat row `row`: its context is every
        position up to that row's, as the sequence's pages hold it."""
        table = inputs.block_tables[seq_row]
        length = int(inputs.positions[row]) + 1
        context = [self.kv[int(table[pos // self.page_size]) * self.page_size
                          + pos % self.page_size] for pos in range(length)]
        return next_token(context)

    def sample(self, forward: FakeForward, first_slot: int, mask: TokenMask | None = None,
               rows: list[int] | None = None) -> FakeTokens:
        assert forward.launch == self.launches, "a step's sampling came after a later forward"
        tokens = FakeTokens(self, forward.launch)
        if forward.logits is None:
            return tokens
        model_tokens = list(forward.logits)  # type: ignore[call-overload]
        rows = list(range(len(model_tokens))) if rows is None else rows
        self.events.append(("sample", forward.launch, tuple(rows)))
        if self.half_owner.get(first_slot) != forward.launch:
            # The first sampling of this launch into this half: nobody may
            # still wait for a token an earlier launch left there.
            self.half_owner[first_slot] = forward.launch
            half = range(first_slot, first_slot + self.future.rows)
            for seq in (*self.scheduler.running, *self.scheduler.waiting):
                for token in seq.token_ids:
                    assert token >= 0 or -token - 1 not in half, (
                        f"future slots {half.start}.. written again while {seq!r} still "
                        f"waits for its token from slot {-token - 1}")
        chosen = [model_tokens[row] for row in rows]
        if mask is not None:
            self.masks_seen.append((forward.launch, list(mask.rows)))
            bits = mask.bitmask.numpy()
            for index in mask.rows:
                allowed = [t for t in range(VOCAB) if bits[index, t // 32] >> (t % 32) & 1]
                if chosen[index] not in allowed:
                    chosen[index] = allowed[0]
            self.forced_seen.extend((forward.launch, token) for _, token in mask.forced)
            for index, token in mask.forced:  # the sampler's last word
                chosen[index] = token
        for row, token in zip(rows, chosen, strict=True):
            self.future.buffer[first_slot + row] = token
            self.slot_writer[first_slot + row] = forward.launch
        tokens.tokens = chosen
        return tokens

    def device_bytes(self) -> int:
        return 0

    def forget(self, request_id: str) -> None:
        """The real runner drops a request's pooling state; the toy keeps none."""

    def after_sampling(self, out: object, step: object) -> None:
        """The real runner runs an MTP head here; the toy drafts with none."""

    def move_kv(self, transfers: KVTransfers) -> None:
        """Pages reused to the token: their leading slots copied, as the
        runner does before the step's forward pass (no host tier here)."""
        assert not transfers.stores and not transfers.loads, "the toy has no host tier"
        ps = self.page_size
        for source, target, num_tokens in transfers.copies:
            for offset in range(num_tokens):
                self.kv[target * ps + offset] = self.kv[source * ps + offset]

    # ---- checks -------------------------------------------------------------

    def take(self, launch: int) -> None:
        if self.taken and launch == self.taken[-1]:
            return  # the second part of a step sampled in two parts
        expected = self.taken[-1] + 1 if self.taken else 1
        assert launch == expected, f"launch {launch}'s tokens taken, expected launch {expected}'s"
        self.taken.append(launch)
        self.overlap.append((launch, self.launches))
        self.events.append(("take", launch, ()))

    @staticmethod
    def _rows_of(inputs: StepInputs, rows: list[int]) -> list[int]:
        """The sequence row of each of the flat rows."""
        ends = np.asarray(inputs.query_start_loc[1:]) - 1
        return [int(np.searchsorted(ends, row)) for row in rows]
