"""How one request is sampled and why it finished."""

from __future__ import annotations

from typing import Literal

import msgspec

# "stop": an end-of-sequence or stop token (the router also reports "stop" when
# it matched a stop string and aborted); "length": max_tokens or the context
# ran out; "abort": the router asked; "error": the engine refused the request.
FinishReason = Literal["stop", "length", "abort", "error"]


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """Per-request sampling settings, already validated by the router.

    top_k <= 0 and top_p == 1.0 and min_p == 0.0 each mean "off";
    temperature == 0.0 means greedy.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
