"""Tokens the engine writes into a running sequence in place of sampled ones:
the end of a reasoning block whose budget is spent, and what must follow the
block (a forced tool call's opener). One mechanism for both
(protocol.ReasoningBudget says what a request asks for).

Per request, a plan: the block is open at the first output token; the model
may write `budget` tokens in it. Output token k is forced when
- the model did not close the block among its first `budget` tokens and k
  falls in the run end_ids + after_ids that starts at index `budget`, or
- the model closed the block itself, its close ending at index c, and k
  falls in the run after_ids that starts at c + 1.

Whether token k is forced depends on tokens still on the device while the
step that samples it is scheduled (engine/scheduling/core.py runs one step
ahead): the model may have closed the block with the token before. So a row
that might be forced is a row that needs host tokens: it is sampled after the
step before completed, like a grammar row, and its forced token is decided
then from known tokens alone. A row certain to be free (before the budget,
no after_ids, or the plan done) is sampled at once. The forced token goes
through sampling like any other: the sampler, after logit_bias, penalties
and grammar masks, leaves the row one finite logit, the forced token's
(TokenMask.forced), so greedy and sampled rows draw it alike, on the host or
on the device, and its log probabilities are the model's own.

Why not a grammar (the way a forced tool call's structure is held): a
grammar sees text, not a count of tokens, and the budget is a count.

Speculative decoding (engine/sampling/verify.py): the target's token at a
draft position counts only while the draft tokens before it were accepted,
so whether it is forced follows from the known tokens and the draft. A draft
is cut before the first position whose token would be forced (cut_draft):
the forced run is sampled one step at a time, as without drafts.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

import torch

from engine.sampling.token_mask import TokenMask
from engine.scheduling.sequence import SeqStatus, Sequence
from protocol import ReasoningBudget


def check_budget(spec: ReasoningBudget, vocab_size: int) -> str | None:
    """Why a request's reasoning budget cannot be used, or None."""
    if spec.budget < -1:
        return f"the reasoning budget must be -1 (no limit) or a token count, got {spec.budget}"
    if not spec.close_ids:
        return "a reasoning budget needs close_ids, the tokens that close the block"
    if spec.budget >= 0 and not spec.end_ids:
        return "a reasoning budget needs end_ids, the tokens forced when it is spent"
    for name, ids in (("close_ids", spec.close_ids), ("end_ids", spec.end_ids),
                      ("after_ids", spec.after_ids)):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            return f"reasoning {name} token id {bad} is outside the vocabulary (0..{vocab_size - 1})"
    return None


@dataclass(slots=True)
class _Plan:
    spec: ReasoningBudget
    # Output tokens already searched for the model's own close.
    scanned: int = 0
    # Once decided: the output index where the forced run starts, and the run.
    start: int = -1
    run: tuple[int, ...] = ()
    # Nothing more will be forced.
    done: bool = False

    def may_force(self, index: int) -> bool:
        """Whether output token `index` might be forced, on what the host
        knows now (the token before it may still be on the device)."""
        if self.start >= 0:
            if index >= self.start + len(self.run):
                self.done = True
                return False
            return True
        budget = self.spec.budget
        # While the block is open, the token before may be its close, which
        # after_ids follow at once; without them only the budget forces.
        return bool(self.spec.after_ids) or 0 <= budget <= index

    def forced(self, tokens: list[int], first: int) -> int | None:
        """The token the output tokens[first:] must go on with; all known.
        (Indices, not a slice: the sequence's tokens are not copied per step.)"""
        index = len(tokens) - first
        if self.start < 0:
            self._decide(tokens, first)
        if self.start < 0 or index < self.start:
            return None
        if index >= self.start + len(self.run):
            self.done = True
            return None
        return self.run[index - self.start]

    def _decide(self, tokens: list[int], first: int) -> None:
        spec = self.spec
        close = spec.close_ids
        count = len(tokens) - first
        # The model's own close counts within its budget only: from there on
        # the tokens are the forced run's (which holds the delimiter too).
        limit = count if spec.budget < 0 else min(count, spec.budget)
        # A close may end at `scanned`, begun in tokens searched before.
        at = max(self.scanned - len(close) + 1, 0)
        while at + len(close) <= limit:
            if tokens[first + at:first + at + len(close)] == close:
                self._start(at + len(close), spec.after_ids)
                return
            at += 1
        self.scanned = limit
        if 0 <= spec.budget <= count:
            self._start(spec.budget, [*spec.end_ids, *spec.after_ids])

    def _start(self, start: int, run: list[int]) -> None:
        self.start, self.run = start, tuple(run)
        if not run:
            self.done = True


class ForcedTokens:
    """The forced-token plans of the running requests that have one."""

    def __init__(self) -> None:
        self._plans: dict[str, _Plan] = {}

    def __len__(self) -> int:
        return len(self._plans)

    def admit(self, request_id: str, spec: ReasoningBudget) -> None:
        if spec.budget >= 0 or spec.after_ids:
            self._plans[request_id] = _Plan(spec)

    def forget(self, request_id: str) -> None:
        self._plans.pop(request_id, None)

    def needs_host(self, seq: Sequence) -> bool:
        """Whether seq's next token (the one this step samples) might be
        forced: then it is sampled once the step before has completed."""
        plan = self._plans.get(seq.request_id)
        if plan is None or plan.done:
            return False
        return plan.may_force(seq.num_output_tokens)

    def cut_draft(self, seq: Sequence, draft: list[int]) -> list[int]:
        """draft up to the first position whose token would be forced: token
        i of the draft is followed by output token num_output_tokens + i + 1,
        forced or not as if draft tokens up to i were the model's. Tried on a
        copy of the plan; every token of seq is known."""
        plan = self._plans.get(seq.request_id)
        if plan is None or plan.done or not draft:
            return draft
        trial = replace(plan)
        tokens = list(seq.token_ids)
        for kept, token in enumerate(draft):
            tokens.append(token)
            if trial.forced(tokens, seq.num_prompt_tokens) is not None:
                return draft[:kept]
        return draft

    def force(self, mask: TokenMask | None, seqs: Seq[Sequence]) -> TokenMask | None:
        """mask (for rows sampled by seqs, row i by seqs[i]; None: no grammar
        row) with the forced tokens of these rows added. Called once the step
        before has completed: every token of seqs is known."""
        if not self._plans:
            return mask
        forced: list[tuple[int, int]] = []
        for row, seq in enumerate(seqs):
            plan = self._plans.get(seq.request_id)
            if plan is None or plan.done or seq.status is SeqStatus.FINISHED:
                continue
            assert not seq.has_pending_token, f"{seq!r} is forced before its tokens are known"
            token = plan.forced(seq.token_ids, seq.num_prompt_tokens)
            if token is not None:
                forced.append((row, token))
        if not forced:
            return mask
        if mask is None:
            return TokenMask(torch.empty(0, dtype=torch.int32), [], tuple(forced))
        return TokenMask(mask.bitmask, mask.rows, tuple(forced))
