"""Grammar-constrained decoding: one xgrammar matcher per request that has a
grammar, the token masks of each step, and the tokens the matchers accept.

Per step, for the rows that sample a token:
1. fill(): each grammar row's matcher writes the tokens it allows into a host
   bitmask, which goes to the logits' device;
2. the sampler applies it to those logits rows (disallowed -> -inf) first;
3. accept(): each matcher takes its sampled token. A matcher that took its
   stop token has terminated: the sequence finishes with "stop".

The engine fills a step's masks while the device runs that step's forward
pass (engine/scheduling/core.py): the mask of a step needs the token of the
step before, so it cannot be filled earlier. Several grammar rows are filled
side by side by xgrammar's own threads (BatchGrammarMatcher), which work
without the GIL.

A preempted sequence keeps its matcher: the tokens it already produced stay
accepted, and its recompute samples the token after them, which is exactly
the matcher's state.

Speculative decoding (engine/sampling/verify.py): a grammar row's draft is
cut before the first token its grammar refuses, or the first that would end
it (cut_draft), so every draft token can be accepted in turn. The mask of
draft position i is the matcher's after draft tokens 1..i (fill_drafts: each
taken, the mask filled, then all rolled back), which is the real state
whenever the target's token there counts: only while every draft token
before it was accepted. Once the step is verified, accept() takes the row's
emitted tokens, the sampled one, the accepted drafts and the free one after
them. xgrammar's matchers roll back without limit (max_rollback_tokens is
deprecated and unbounded since 0.2), so no room need be reserved per draft.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.sampling.token_mask import TokenMask
from engine.scheduling.sequence import Sequence
from protocol import GrammarSpec, GrammarVocab

if TYPE_CHECKING:
    import xgrammar

    from engine.sampling.grammar_compiler import GrammarCompiler

log = logging.getLogger(__name__)

# Threads that fill a step's masks side by side: the engine's host has few
# cores to spare beside the busy loop and the I/O threads.
FILL_THREADS = 4

_NO_VOCAB = ("this engine has no grammar vocabulary: the router must send GrammarVocab before "
             "the first request with a grammar")


class GrammarError(Exception):
    """A grammar that cannot be used; the message is meant for the client."""


class GrammarCompileError(GrammarError):
    """The request's grammar itself is wrong (it does not compile)."""


@dataclass(slots=True)
class Verdict:
    """What the matchers made of one step's tokens."""

    # The grammar is complete (its stop token was taken): finish with "stop".
    completed: set[str] = field(default_factory=set)
    # request id -> why the grammar could not go on (a request error).
    rejected: dict[str, str] = field(default_factory=dict)


class EngineGrammar:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self._compiler: GrammarCompiler | None = None
        self._vocab_error: str | None = None
        # The vocabulary's special tokens: no grammar takes one, and xgrammar
        # logs a warning each time one is offered (cut_draft checks first).
        self._special: frozenset[int] = frozenset()
        self._matchers: dict[str, xgrammar.GrammarMatcher] = {}
        self._host = torch.empty(0)  # the reused host bitmask, grown on demand
        self._batch: xgrammar.BatchGrammarMatcher | None = None
        # Rows of the last fill() whose grammar allowed no token at all.
        self._stuck: set[str] = set()
        # The page-locked host bitmask of verify steps' draft rows: apart from
        # _host, which the same step's fill() writes while this one may still
        # be on its way to the device.
        self._draft_host = torch.empty(0)
        # Request id -> the first emitted token index (1: after the first draft
        # token) drawn without a mask in the last fill_drafts(): its grammar
        # allowed nothing there.
        self._draft_stuck: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._matchers)

    def set_vocab(self, vocab: GrammarVocab) -> None:
        """Build the compiler for the router's vocabulary (a later vocabulary
        replaces it; running requests keep their compiled grammars)."""
        # Imported on first use: xgrammar loads transformers (about half a
        # second), which an engine that never sees a grammar need not pay for.
        from engine.sampling.grammar_compiler import GrammarCompiler

        try:
            self._compiler = GrammarCompiler(vocab, vocab_size=self.vocab_size)
        except Exception as exc:  # there is no request to answer; later grammars are refused
            self._compiler = None
            self._vocab_error = f"the grammar vocabulary was refused: {exc}"
            log.error("%s", self._vocab_error)
            return
        self._vocab_error = None
        self._special = frozenset(self._compiler.tokenizer_info.special_token_ids)
        log.info("grammar vocabulary: %d tokens, %s", len(vocab.tokens), vocab.vocab_type)
        if self.device.type == "cuda":
            self._warm_up()

    def _warm_up(self) -> None:
        # The CUDA mask kernel is a Triton JIT kernel: compile it now rather
        # than in the middle of the first grammar request's step.
        logits = torch.zeros((1, self.vocab_size), dtype=torch.float32, device=self.device)
        words = (self.vocab_size + 31) // 32
        TokenMask(torch.full((1, words), -1, dtype=torch.int32, device=self.device), [0]).apply(logits)

    def admit(self, request_id: str, spec: GrammarSpec) -> None:
        """Compile spec (or take it from the cache) and give the request a
        matcher. Raises GrammarError for a grammar that cannot be used.

        NOTE: compiling runs on the busy loop (a large schema takes tens of
        milliseconds); a host thread could compile while steps go on."""
        import xgrammar

        if self._compiler is None:
            raise GrammarError(self._vocab_error or _NO_VOCAB)
        compiled = self._compiler.compile(spec)
        self._matchers[request_id] = xgrammar.GrammarMatcher(compiled)

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def fill(self, seqs: Seq[Sequence]) -> TokenMask | None:
        """The mask for a step whose sampled rows belong to seqs (row i to
        seqs[i]); None when none of them has a grammar."""
        matchers = self._matchers
        if not matchers:
            return None
        rows = [row for row, seq in enumerate(seqs) if seq.request_id in matchers]
        if not rows:
            return None
        host = self._host_rows(len(seqs))
        if len(rows) == 1:
            matchers[seqs[rows[0]].request_id].fill_next_token_bitmask(host, rows[0])
        else:
            self._batch_matcher().batch_fill_next_token_bitmask(
                [matchers[seqs[row].request_id] for row in rows], host, indices=rows)
        bitmask = host[: len(seqs)]
        allows_any = _allows_any(bitmask, rows)
        if not all(allows_any):
            # A grammar that allows nothing (it needs text this vocabulary cannot
            # spell): masking the row would leave no token to draw. The row is
            # left alone and the request fails in accept().
            self._stuck = {seqs[row].request_id for row, ok in zip(rows, allows_any, strict=True) if not ok}
        # The host buffer is written again only by the next step's fill(),
        # after this step's sampling has waited for the device.
        return self._device_mask(bitmask, rows, allows_any)

    def cut_draft(self, seq: Sequence, draft: list[int]) -> list[int]:
        """draft up to the first token seq's grammar refuses, or would end on
        (its stop token): a draft token after a refused one could never be
        accepted, and a position after the grammar's end has no mask. Tries
        the tokens on the matcher and rolls them back."""
        matcher = self._matchers.get(seq.request_id)
        if matcher is None or not draft:
            return draft
        taken = 0
        for token in draft:
            if token in self._special or not matcher.accept_token(token):
                break
            taken += 1
            if matcher.is_terminated():
                break
        kept = taken - 1 if taken and matcher.is_terminated() else taken
        if taken:
            matcher.rollback(taken)
        return draft[:kept]

    def fill_drafts(self, drafted: Seq[tuple[Sequence, Seq[int]]]) -> TokenMask | None:
        """The mask of a verify step's draft rows: one row per draft token, in
        the order of drafted (each drafting row's sequence and its draft, as
        cut by cut_draft); the row of draft token i holds the mask after
        tokens 1..i. None when no drafting row has a grammar. Each matcher
        takes its draft a token at a time, its row filled after each, and is
        rolled back to its real state.

        NOTE: filled one after another, not side by side as fill() does: a
        mask after a few JSON tokens costs microseconds, and handing k rounds
        of them to xgrammar's threads cost 3 to 7 times as much on a
        two-core host (0.6-1.0 ms against 0.08-0.17 ms for a round of 4)."""
        self._draft_stuck.clear()
        host: torch.Tensor | None = None
        # (draft row, request id, emitted token index drawn there).
        filled: list[tuple[int, str, int]] = []
        first = 0
        for seq, draft in drafted:
            matcher = self._matchers.get(seq.request_id)
            if matcher is not None and draft:
                if host is None:
                    host = self._draft_rows(sum(len(d) for _, d in drafted))
                for index, token in enumerate(draft):
                    accepted = matcher.accept_token(token)
                    assert accepted, "cut_draft let through a token the grammar refuses"
                    matcher.fill_next_token_bitmask(host, first + index)
                    filled.append((first + index, seq.request_id, index + 1))
                matcher.rollback(len(draft))
            first += len(draft)
        if host is None:
            return None
        rows = [row for row, _, _ in filled]
        bitmask = host[:first]
        allows_any = _allows_any(bitmask, rows)
        if not all(allows_any):
            # As in fill(): such a row is left unmasked, and accept() fails the
            # request if the token drawn there is emitted.
            for (_, request_id, index), ok in zip(filled, allows_any, strict=True):
                if not ok:
                    self._draft_stuck.setdefault(request_id, index)
        # Written again only by a later verify step's fill_drafts(): that
        # step is scheduled after this one's targets reached the host.
        return self._device_mask(bitmask, rows, allows_any)

    def _device_mask(self, bitmask: torch.Tensor, rows: list[int],
                     allows_any: list[bool]) -> TokenMask | None:
        """The mask of the rows whose grammar allows some token (the others
        go unmasked), on its way to the device; None if no row is left."""
        rows = [row for row, ok in zip(rows, allows_any, strict=True) if ok]
        if not rows:
            return None
        if self.device.type != "cpu":
            bitmask = bitmask.to(self.device, non_blocking=True)
        return TokenMask(bitmask, rows)

    def _draft_rows(self, count: int) -> torch.Tensor:
        if self._draft_host.shape[0] < count:
            capacity = 1 << (count - 1).bit_length()
            words = (self.vocab_size + 31) // 32
            self._draft_host = torch.empty((capacity, words), dtype=torch.int32,
                                           pin_memory=self.device.type == "cuda")
        return self._draft_host

    def _batch_matcher(self) -> xgrammar.BatchGrammarMatcher:
        if self._batch is None:
            import xgrammar

            self._batch = xgrammar.BatchGrammarMatcher(max_threads=FILL_THREADS)
        return self._batch

    def _host_rows(self, count: int) -> torch.Tensor:
        if self._host.shape[0] < count:
            capacity = 1 << (count - 1).bit_length()
            words = (self.vocab_size + 31) // 32
            # Page-locked for CUDA so the copy to the device can be asynchronous.
            self._host = torch.empty((capacity, words), dtype=torch.int32,
                                     pin_memory=self.device.type == "cuda")
        return self._host

    def accept(self, seqs: Seq[Sequence], tokens: Seq[int],
               drafted: Mapping[str, Seq[int]] | None = None) -> Verdict:
        """Advance the matchers of seqs by the tokens sampled for them, and a
        verify step's rows by the tokens emitted after their sampled one
        (drafted: request id -> its accepted draft tokens and the free one)."""
        verdict = Verdict()
        matchers = self._matchers
        if not matchers:
            return verdict
        for seq, token in zip(seqs, tokens, strict=True):
            request_id = seq.request_id
            matcher = matchers.get(request_id)
            if matcher is None:
                continue
            after = drafted.get(request_id, ()) if drafted else ()
            stuck_at = 0 if request_id in self._stuck else self._draft_stuck.get(request_id, -1)
            for index, emitted in enumerate((token, *after)):
                if index == stuck_at:
                    verdict.rejected[request_id] = (
                        "the grammar allows no token after the text generated so far: it needs "
                        "text that this model's vocabulary cannot spell")
                elif not matcher.accept_token(emitted):
                    # The mask allowed it, so this is xgrammar's disagreement with itself.
                    verdict.rejected[request_id] = (f"the grammar rejected token {emitted}, which "
                                                    "its mask allowed")
                elif matcher.is_terminated():
                    # Only a row's last emitted token can end its grammar:
                    # cut_draft keeps the tokens that would out of drafts.
                    verdict.completed.add(request_id)
                else:
                    continue
                break
        self._stuck.clear()
        self._draft_stuck.clear()
        return verdict


def _allows_any(bitmask: torch.Tensor, rows: list[int]) -> list[bool]:
    """Whether each of the rows of a host bitmask allows some token. All rows
    are reduced and the wanted ones picked on the host: indexing the rows
    first (bitmask[rows]) costs 10-20 ms on a two-core host with two torch
    threads, against microseconds for the reduction."""
    allows = bitmask.any(dim=1).tolist()
    return [allows[row] for row in rows]
