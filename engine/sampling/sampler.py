"""Turns the last-position logits of a batch into one token per row.

Grammar rows first lose the tokens their grammar forbids (a TokenMask, see
engine/sampling/grammar.py), then rows with a logit_bias get it added, then
rows with penalties get them, for the whole batch at once from counts kept
on the device (engine/sampling/penalty_state.py). A row whose token is forced
(engine/sampling/forced_tokens.py) is left one finite logit after the
penalties, so it draws that token whatever it is sampled with. Greedy rows
take the argmax. Sampled rows apply temperature, then top-k, top-p and min-p
on one sorted copy of the batch, and draw from what is left. A request with a
seed draws from its own generator, so its tokens do not depend on which other
requests share the batch.

On CUDA with our kernels (use_kernel), the truncation and the draw run in one
kernel for the whole batch (kernels/sampling.py): each row draws from a
counter-based random stream keyed by the request's seed and its count of
output tokens, so again a request's tokens do not depend on its batch. A
request without a seed gets one from the engine's seeded generator.

final_logprobs gives the distribution a row drew from, for the rows that ask
for it (SamplingParams.logprobs_mode "processed", llama.cpp's
post_sampling_probs); engine/sampling/processed_logprobs.py puts it in place
of the raw one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.sampling.penalty_state import AppliedPenalties, PenaltyState, Resolve
from engine.scheduling.sequence import Sequence
from kernels.reference import sampling_survivors
from kernels.sampling import sample_tokens

if TYPE_CHECKING:
    from engine.sampling.token_mask import TokenMask


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, use_kernel: bool = False,
                 deterministic: bool = False):
        """deterministic (--deterministic): the reference path cuts and draws
        each sampled row on its own, so no torch op sees the other rows (the
        kernel's blocks are per row already)."""
        self.device = device
        self.use_kernel = use_kernel
        self.deterministic = deterministic
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)
        self._seeded: dict[str, torch.Generator] = {}
        # The kernel path: unseeded requests' seeds come from here.
        self._seed_source = torch.Generator().manual_seed(seed)
        self._kernel_seeds: dict[str, int] = {}
        self.penalties = PenaltyState(device)

    def forget(self, request_id: str) -> None:
        self._seeded.pop(request_id, None)
        self._kernel_seeds.pop(request_id, None)
        self.penalties.free(request_id)

    def _kernel_seed(self, seq: Sequence) -> int:
        if seq.params.seed is not None:
            # The kernel takes a signed 64-bit seed; keep the same bits.
            return seq.params.seed - (1 << 64) if seq.params.seed >= 1 << 63 else seq.params.seed
        seed = self._kernel_seeds.get(seq.request_id)
        if seed is None:
            seed = int(torch.randint(-(2**62), 2**62, (), generator=self._seed_source))
            self._kernel_seeds[seq.request_id] = seed
        return seed

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self._shared
        generator = self._seeded.get(seq.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seq.params.seed)
            self._seeded[seq.request_id] = generator
        return generator

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: Seq[Sequence], mask: TokenMask | None = None,
               resolve: Resolve | None = None) -> list[int]:
        """logits: float32 [N, vocab], row i belongs to seqs[i]; mask, if any,
        is applied first, so penalties and truncation see only allowed tokens.
        resolve reads placeholder token ids from the device (the model
        runner's FutureTokens.resolve): a penalty row's newest token may be one."""
        if self.use_kernel:
            return self.sample_on_device(logits, seqs, mask, resolve).tolist()
        if mask is not None:
            mask.apply(logits)
        self._apply_bias(logits, seqs)
        penalised = self._penalise(logits, seqs, resolve)
        if mask is not None:
            mask.force(logits)  # last: a forced token outvotes bias and penalties
        result = logits.argmax(dim=-1)
        sampled_rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            chosen = self._draw(logits.index_select(0, rows), [seqs[i] for i in sampled_rows])
            result.index_copy_(0, rows, chosen)
        if penalised is not None:
            penalised.record(result)
        return result.tolist()

    @torch.inference_mode()
    def sample_on_device(self, logits: torch.Tensor, seqs: Seq[Sequence],
                         mask: TokenMask | None = None, resolve: Resolve | None = None
                         ) -> torch.Tensor:
        """The kernel path: int64 [N] tokens on the device, nothing waited for.
        Each row's random stream is keyed by its count of output tokens, a
        token still on the device (a placeholder) included, so a row draws
        the same number whether or not the step before has reached the host."""
        if mask is not None:
            mask.apply(logits)
        self._apply_bias(logits, seqs)
        penalised = self._penalise(logits, seqs, resolve)
        if mask is not None:
            mask.force(logits)  # last: a forced token outvotes bias and penalties
        if all(seq.params.greedy for seq in seqs):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample_with_kernel(logits, seqs)
        if penalised is not None:
            penalised.record(tokens)
        return tokens

    @torch.inference_mode()
    def draw_targets(self, logits: torch.Tensor, seqs: Seq[Sequence],
                     positions: Seq[int], mask: TokenMask | None = None, *,
                     ahead: Seq[Seq[int]] | None = None, resolve: Resolve | None = None
                     ) -> torch.Tensor:
        """Speculative verification (engine/sampling/verify.py): int64 [D] on
        the device, one token per draft position drawn from the row's final
        distribution (the argmax for a greedy row). mask, if any, holds the
        grammar rows' masks, one per draft position (EngineGrammar.fill_drafts),
        applied first as in sample(); then each row's logit bias and
        penalties, in place, the penalty counts taking in ahead[i]: the draft
        tokens row i's context holds past its sequence's tokens
        (PenaltyState.apply_ahead).
        positions[i] is the output index of row i's token: the kernel keys
        the row's random stream by it, as it keys a plain decode step's; the
        reference path draws from the request's generator, in row order."""
        if mask is not None:
            mask.apply(logits)
        self._apply_bias(logits, seqs)
        self.penalties.apply_ahead(logits, seqs, ahead, resolve)
        if self.use_kernel:
            if all(seq.params.greedy for seq in seqs):
                return logits.argmax(dim=-1)
            return self._sample_with_kernel(logits, seqs, positions)
        result = logits.argmax(dim=-1)
        sampled_rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            chosen = self._draw(logits.index_select(0, rows), [seqs[i] for i in sampled_rows])
            result.index_copy_(0, rows, chosen)
        return result

    def _sample_with_kernel(self, logits: torch.Tensor, seqs: Seq[Sequence],
                            positions: Seq[int] | None = None) -> torch.Tensor:
        params = [seq.params for seq in seqs]
        if positions is None:
            positions = [seq.num_output_tokens for seq in seqs]
        # A greedy row is a row with temperature 0: the kernel takes its argmax.
        host = torch.tensor([[0.0 if p.greedy else p.temperature, p.top_p, p.min_p]
                             for p in params], dtype=torch.float32)
        ints = torch.tensor([[p.top_k, self._kernel_seed(seq), position]
                             for p, seq, position in zip(params, seqs, positions, strict=True)],
                            dtype=torch.int64)
        device = logits.device
        floats = host.to(device, non_blocking=True).T.contiguous()
        ints = ints.to(device, non_blocking=True).T.contiguous()
        return sample_tokens(logits.contiguous(), floats[0], ints[0].to(torch.int32).contiguous(),
                             floats[1], floats[2], ints[1], ints[2])

    @staticmethod
    def _apply_bias(logits: torch.Tensor, seqs: Seq[Sequence]) -> None:
        # A bias is fixed for the whole request, so it needs no host work per
        # step: a step sampled before the previous one's tokens reach the host
        # applies it too.
        for row, seq in enumerate(seqs):
            bias = seq.params.logit_bias
            if not bias:
                continue
            ids = torch.tensor(list(bias), device=logits.device)
            values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
            logits[row, ids] += values

    def _penalise(self, logits: torch.Tensor, seqs: Seq[Sequence],
                  resolve: Resolve | None) -> AppliedPenalties | None:
        # Read from and recorded into device state: a penalty row needs no
        # token from the host, so it is sampled ahead like a plain row.
        return self.penalties.apply(logits, seqs, resolve)

    def final_logprobs(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        """float32 [N, vocab]: the log of the distribution each row drew its
        token from, for logits as sample() leaves them (masked, biased and
        penalised in place): after temperature, top-k, top-p and min-p, cut
        tokens -inf and the survivors renormalised; a greedy row is one-hot
        at its argmax (log 1 = 0). The kernel path reports the survivors of
        kernels.reference.sampling_survivors, the kernel's own rule."""
        if self.use_kernel:
            return _kernel_final_logprobs(logits, seqs)
        final = torch.full_like(logits, -math.inf)
        final.scatter_(1, logits.argmax(dim=-1, keepdim=True), 0.0)
        sampled_rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            cut = self._cut(logits.index_select(0, rows), [seqs[i] for i in sampled_rows])
            kept = cut.scaled.masked_fill(cut.drop, -math.inf).log_softmax(dim=-1)
            final.index_copy_(0, rows, torch.empty_like(kept).scatter_(1, cut.order, kept))
        return final

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        if self.deterministic and len(seqs) > 1:
            return torch.cat([self._draw(logits[row:row + 1].clone(), [seq])
                              for row, seq in enumerate(seqs)])
        cut = self._cut(logits, seqs)
        probs = cut.probs.masked_fill(cut.drop, 0.0)
        picks = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        for row, seq in enumerate(seqs):
            picks[row] = torch.multinomial(probs[row], 1, generator=self._generator(seq))[0]
        return cut.order.gather(1, picks.unsqueeze(1)).squeeze(1)

    @staticmethod
    def _cut(logits: torch.Tensor, seqs: list[Sequence]) -> _Cut:
        """Temperature, then top-k, top-p and min-p on one sorted copy of the rows."""
        device = logits.device
        vocab = logits.shape[1]
        temperature = torch.tensor([s.params.temperature for s in seqs], device=device)
        logits = logits / temperature.unsqueeze(1)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)

        top_k = torch.tensor(
            [s.params.top_k if s.params.top_k > 0 else vocab for s in seqs], device=device
        )
        drop = ranks >= top_k.unsqueeze(1)
        top_p = torch.tensor([s.params.top_p for s in seqs], device=device)
        # Keep the smallest prefix whose mass reaches top_p: a token is dropped
        # when the mass before it already does.
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
        min_p = torch.tensor([s.params.min_p for s in seqs], device=device)
        drop |= probs < min_p.unsqueeze(1) * probs[:, :1]
        drop[:, 0] = False  # the most likely token always survives
        return _Cut(sorted_logits, probs, order, drop)


class _Cut(NamedTuple):
    """Rows sorted by scaled logit, most likely first."""

    scaled: torch.Tensor  # logits / temperature, sorted
    probs: torch.Tensor  # their softmax
    order: torch.Tensor  # token id at each sorted position
    drop: torch.Tensor  # True where top-k, top-p or min-p cut the token


def _kernel_final_logprobs(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    # The rows' settings as _sample_with_kernel passes them (greedy: temperature 0).
    device = logits.device
    params = [seq.params for seq in seqs]
    temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params],
                               dtype=torch.float32).to(device)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int32).to(device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).to(device)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32).to(device)
    keep = sampling_survivors(logits, temperature, top_k, top_p, min_p)
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return (logits / scale.unsqueeze(1)).masked_fill(~keep, -math.inf).log_softmax(dim=-1)
