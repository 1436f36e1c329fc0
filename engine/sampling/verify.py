"""Verification of a draft: greedy and sampled rows alike.

A row with a draft of k tokens runs as a chunk of 1 + k positions: its
newest known token, then the draft. The target's token after position i is
drawn from the row's final distribution p_i there (Sampler.draw_targets:
after temperature, top-k, top-p and min-p; the argmax for a greedy row); for
position 0 it is the sampler's own pick. Draft token i is accepted while
every token before it was, and it equals the target's token after the
position before it; the target's token after the last accepted position
comes free. So a step yields 1..k+1 tokens.

For a deterministic drafter (the n-gram drafter proposes each token with
probability 1) this is the standard speculative sampling rule: with x drawn
from p, P(x = d) = p(d) is the probability of accepting draft token d, and on
a rejection x is distributed as p with d removed and renormalised, the
residual max(p - q, 0) normalised for a one-hot q; after k acceptances the
bonus token is drawn from p at the last position. Each emitted token is
therefore distributed exactly as without speculation; a greedy row's is
exactly plain greedy decoding's token. (A drafter with a proper distribution
q, a draft model, needs the general rule with q: a later stage.)
"""

from __future__ import annotations

from collections.abc import Sequence


def accept_drafts(first: int, draft: Sequence[int], targets: Sequence[int]) -> list[int]:
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
