"""Greedy verification of a draft.

A row with a draft of k tokens runs as a chunk of 1 + k positions: its
newest known token, then the draft. The target's token after position i is
the argmax of that position's logits (for position 0 the sampler's own
greedy pick). Draft token i is accepted while every token before it was,
and it equals the target's token after position i; the target's token after
the last accepted position comes free. So a step yields 1..k+1 tokens, each
exactly what plain greedy decoding would have produced.
"""

from __future__ import annotations

from collections.abc import Sequence


def accept_greedy(first: int, draft: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens a verify chunk yields: first (the target's token after the
    chunk's first position), then targets[i] (its token after draft[i]) for
    as long as each draft token matched the target's token before it."""
    assert len(targets) == len(draft), "one target token per draft position"
    tokens = [first]
    for guess, target in zip(draft, targets, strict=True):
        if tokens[-1] != guess:
            break
        tokens.append(target)
    return tokens
