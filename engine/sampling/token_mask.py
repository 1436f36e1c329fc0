"""A step's grammar masks, applied to the logits rows they belong to.

The bitmask is xgrammar's: int32 words, bit j of word w set when token
32 * w + j is allowed. On CUDA, xgrammar's kernel applies it. On the CPU,
xgrammar's kernel writes -inf one forbidden token at a time, with a branch per
token: cheap when a grammar forbids few tokens (0.02 ms for a row of 151,936
logits inside a JSON string, one thread) but 0.33-0.46 ms when it forbids
most of them (after "{") or a scattered lot ([a-z ]*). Those rows take
another way: each byte of the mask is looked up in a table of eight 0 / -inf
biases and the row is added to them, branch-free, about 0.06 ms a row
whatever the mask. Counting a row's allowed tokens to choose costs 0.014 ms.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

# Row b: the 8 bits of byte b, lowest first.
_BYTE_BITS = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
_POPCOUNT = _BYTE_BITS.sum(dim=1).int()
# 0.0 where the token is allowed, -inf where it is forbidden (x + -inf is -inf
# for any finite x).
_BIASES = torch.where(_BYTE_BITS == 1, 0.0, float("-inf"))
# Rows forbidding at most this many tokens go to xgrammar's kernel, which then
# costs no more than the biases (about 3 ns a forbidden token).
_FEW_FORBIDDEN = 16384


@dataclass(frozen=True, slots=True)
class TokenMask:
    """Which tokens the grammar rows of one step's logits may take."""

    bitmask: torch.Tensor  # int32 [n, ceil(vocab / 32)] on the logits' device; row i for logits row i
    rows: list[int]  # the logits rows to mask; the others stay untouched
    # (logits row, token): rows whose token is forced (engine/sampling/forced_tokens.py).
    forced: tuple[tuple[int, int], ...] = ()

    def apply(self, logits: torch.Tensor) -> None:
        """Set the disallowed logits of the grammar rows to -inf, in place."""
        if not self.rows:
            return
        if logits.device.type == "cpu":
            apply_on_host(logits, self.bitmask, self.rows)
        else:
            import xgrammar

            xgrammar.apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=logits.shape[1],
                                                 indices=self.rows)

    def window(self, first: int, count: int) -> TokenMask | None:
        """The mask of logits rows first..first + count - 1, renumbered from
        0 (a verify step's draft rows get their logits a slice at a time);
        None when none of them is masked. Forced tokens are not carried."""
        rows = [row - first for row in self.rows if first <= row < first + count]
        if not rows:
            return None
        return TokenMask(self.bitmask[first : first + count], rows)

    def force(self, logits: torch.Tensor) -> None:
        """Leave each forced row one finite logit, its token's, in place. The
        sampler calls it last, after logit_bias and penalties, so that no bias
        (not even a ban) and no grammar can outvote a forced token."""
        if not self.forced:
            return
        rows = torch.tensor([row for row, _ in self.forced], device=logits.device)
        tokens = torch.tensor([token for _, token in self.forced], device=logits.device)
        logits.index_fill_(0, rows, float("-inf"))
        logits[rows, tokens] = 0.0


def apply_on_host(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """xgrammar.apply_token_bitmask_inplace for CPU tensors, the cheaper way per row."""
    import xgrammar

    assert sys.byteorder == "little" and bitmask.dtype == torch.int32
    vocab = logits.shape[1]
    packed = bitmask[rows].view(torch.uint8)
    allowed = _POPCOUNT.index_select(0, packed.view(-1).int()).view(len(rows), -1).sum(dim=1)
    few_forbidden = (allowed >= vocab - _FEW_FORBIDDEN).tolist()
    kernel_rows = [row for row, few in zip(rows, few_forbidden, strict=True) if few]
    if kernel_rows:
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=kernel_rows)
    biased = [i for i, few in enumerate(few_forbidden) if not few]  # positions in rows
    if not biased:
        return
    # Byte k of a little-endian word holds its tokens 8k..8k+7, so looking the
    # bytes up in order lays the biases out in token order.
    biases = _BIASES.to(logits.dtype).index_select(0, packed[biased].view(-1).int())
    biases = biases.view(len(biased), -1)[:, :vocab]
    for bias, i in zip(biases, biased, strict=True):
        logits[rows[i]].add_(bias)
