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
"""

from __future__ import annotations

import logging
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
        self._matchers: dict[str, xgrammar.GrammarMatcher] = {}
        self._host = torch.empty(0)  # the reused host bitmask, grown on demand
        self._batch: xgrammar.BatchGrammarMatcher | None = None
        # Rows of the last fill() whose grammar allowed no token at all.
        self._stuck: set[str] = set()

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
        allows_any = bitmask[rows].any(dim=1).tolist()
        if not all(allows_any):
            # A grammar that allows nothing (it needs text this vocabulary cannot
            # spell): masking the row would leave no token to draw. The row is
            # left alone and the request fails in accept().
            self._stuck = {seqs[row].request_id for row, ok in zip(rows, allows_any, strict=True) if not ok}
            rows = [row for row, ok in zip(rows, allows_any, strict=True) if ok]
            if not rows:
                return None
        if self.device.type != "cpu":
            # The host buffer is written again only by the next step's fill(),
            # after this step's sampling has waited for the device.
            bitmask = bitmask.to(self.device, non_blocking=True)
        return TokenMask(bitmask, rows)

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

    def accept(self, seqs: Seq[Sequence], tokens: Seq[int]) -> Verdict:
        """Advance the matchers of seqs by the tokens sampled for them."""
        verdict = Verdict()
        matchers = self._matchers
        if not matchers:
            return verdict
        for seq, token in zip(seqs, tokens, strict=True):
            request_id = seq.request_id
            matcher = matchers.get(request_id)
            if matcher is None:
                continue
            if request_id in self._stuck:
                verdict.rejected[request_id] = (
                    "the grammar allows no token after the text generated so far: it needs "
                    "text that this model's vocabulary cannot spell")
            elif not matcher.accept_token(token):
                # The mask allowed it, so this is xgrammar's disagreement with itself.
                verdict.rejected[request_id] = f"the grammar rejected token {token}, which its mask allowed"
            elif matcher.is_terminated():
                verdict.completed.add(request_id)
        self._stuck.clear()
        return verdict
