"""Lanes: llama.cpp's slots, as the scheduler's running set numbered.

The engine runs at most max_concurrency sequences at once; each running
sequence holds one lane, 0..max_concurrency-1, from admission until it
finishes or is preempted (the lowest free lane, or the one its request pinned
with llama.cpp's id_slot). A lane remembers the token ids of the sequence it
last ran, so GET /slots can show its prompt and POST /slots/{id}?action=save
knows which pages to write (engine/scheduling/slot_actions.py).

A request pinned to a lane waits until that lane is free, as llama.cpp defers
a task whose slot is busy; requests behind it that may take any lane are
admitted meanwhile.

Pure bookkeeping: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.scheduling.sequence import Sequence
from protocol import LaneState, SamplingParams


@dataclass
class Lane:
    running: Sequence | None = None
    # The sequence it ran last (or runs): its tokens known on the host.
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    params: SamplingParams | None = None


class Lanes:
    def __init__(self, count: int):
        self.lanes = [Lane() for _ in range(count)]
        self._held: dict[str, int] = {}  # request id -> the lane it runs in
        self._pinned: dict[str, int] = {}  # request id -> the lane it asked for

    def __len__(self) -> int:
        return len(self.lanes)

    def pin(self, request_id: str, lane: int) -> None:
        """The request runs only in this lane (llama.cpp's id_slot)."""
        if not 0 <= lane < len(self.lanes):
            raise ValueError(f"Invalid slot ID: {lane} (this model has {len(self.lanes)} "
                             f"slots, 0..{len(self.lanes) - 1})")
        self._pinned[request_id] = lane

    def busy(self, lane: int) -> bool:
        return self.lanes[lane].running is not None

    def can_admit(self, seq: Sequence) -> bool:
        """Whether a lane seq may take is free (the scheduler also counts lanes)."""
        pinned = self._pinned.get(seq.request_id)
        if pinned is not None:
            return not self.busy(pinned)
        return any(lane.running is None for lane in self.lanes)

    def assign(self, seq: Sequence) -> int:
        """Give an admitted seq its lane."""
        index = self._pinned.get(seq.request_id)
        if index is None:
            index = next(i for i, lane in enumerate(self.lanes) if lane.running is None)
        lane = self.lanes[index]
        assert lane.running is None, f"lane {index} is taken by {lane.running!r}"
        lane.running = seq
        lane.request_id = seq.request_id
        lane.num_prompt_tokens = seq.num_prompt_tokens
        lane.params = seq.params
        lane.token_ids = []
        self._held[seq.request_id] = index
        return index

    def index_of(self, seq: Sequence) -> int:
        """The lane a running seq holds."""
        return self._held[seq.request_id]

    def release(self, seq: Sequence, *, finished: bool) -> None:
        """seq leaves its lane (finished, aborted or preempted); the lane keeps
        its tokens (a pending placeholder dropped). A finished request's pin
        is forgotten; a preempted one keeps it for its next admission."""
        index = self._held.pop(seq.request_id, None)
        if finished:
            self._pinned.pop(seq.request_id, None)
        if index is None:
            return
        lane = self.lanes[index]
        lane.running = None
        lane.token_ids = [token for token in seq.token_ids if token >= 0]

    def set_tokens(self, index: int, token_ids: list[int]) -> None:
        """A restored (or erased: []) session becomes the lane's."""
        lane = self.lanes[index]
        lane.request_id = ""
        lane.params = None
        lane.token_ids = list(token_ids)
        lane.num_prompt_tokens = len(token_ids)

    def tokens(self, index: int) -> list[int]:
        """The tokens of the sequence the (idle) lane last ran."""
        return self.lanes[index].token_ids

    def states(self) -> list[LaneState]:
        out = []
        for index, lane in enumerate(self.lanes):
            seq = lane.running
            if seq is not None:
                out.append(LaneState(index, True, seq.request_id,
                                     [t for t in seq.token_ids if t >= 0], seq.num_prompt_tokens,
                                     seq.num_computed_tokens, seq.params))
            else:
                out.append(LaneState(index, False, lane.request_id, list(lane.token_ids),
                                     lane.num_prompt_tokens, len(lane.token_ids), lane.params))
        return out
