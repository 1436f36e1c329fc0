"""Where each patch sits: rotary positions, attention segments and windows.

Everything here is computed on the host from the images' (t, h, w) grids
(Python ints the router sent), once per tower call, and moved to the device
as index tensors, so no layer ever synchronises with the device to learn a
length.

Patch order: the processor (patches.py) emits each image's patches in
merge-block order (block row, block column, row in block, column in block),
so the merge_size**2 patches of one output token are consecutive.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

Grid = tuple[int, int, int]  # (t, h, w) in patches


def patch_positions(grids: Sequence[Grid], merge: int) -> torch.Tensor:
    """[num_patches, 2] long: each patch's (row, column) in its image, in
    merge-block order, the same for every frame of a clip."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        # (block row, row in block, block col, col in block) -> merge-block order
        rows = rows.permute(0, 2, 1, 3).reshape(-1)
        cols = cols.permute(0, 2, 1, 3).reshape(-1)
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def frame_lengths(grids: Sequence[Grid]) -> list[int]:
    """Patches per attention segment when attention spans a whole frame."""
    return [h * w for t, h, w in grids for _ in range(t)]


def window_order(grids: Sequence[Grid], merge: int, window_tokens: int
                 ) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's attention windows: square tiles of window_tokens x
    window_tokens output tokens (merge blocks), cut from each frame's top-left
    corner, the right and bottom ones partial where the grid does not divide.

    Returns (order, lengths): order [num_tokens] long lists the output tokens
    window by window (frames in turn, windows row-major, tokens row-major in a
    window), as transformers' get_vision_window_index does; lengths are the
    windows' sizes in patches, in that order.
    """
    order: list[torch.Tensor] = []
    lengths: list[int] = []
    start = 0
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        index = torch.arange(start, start + t * rows * cols).view(t, rows, cols)
        start += t * rows * cols
        win_rows, win_cols = -(-rows // window_tokens), -(-cols // window_tokens)
        padded = F.pad(index, (0, win_cols * window_tokens - cols, 0, win_rows * window_tokens - rows),
                       value=-1)
        tiles = padded.view(t, win_rows, window_tokens, win_cols, window_tokens)
        tiles = tiles.permute(0, 1, 3, 2, 4).reshape(t * win_rows * win_cols, -1)
        kept = tiles >= 0
        order.append(tiles[kept])
        lengths.extend((kept.sum(dim=1) * merge * merge).tolist())
    return torch.cat(order), lengths


class Segments:
    """Attention confined to consecutive runs of patches (an image's frame, or
    one window), with the runs grouped by length so that one batched
    attention call covers every run of a length: [runs, heads, length, dim]
    with no mask. A batch of images has a handful of distinct lengths (the
    full windows and the partial ones at the right and bottom edges; the
    images' own sizes), so a layer makes a handful of calls, where one call
    per run would be hundreds at 1024 x 1024 and one call with a
    block-diagonal mask would compute every pair of patches (and lose the
    flash kernel, which takes no mask)."""

    def __init__(self, lengths: Sequence[int], device: torch.device | str) -> None:
        starts: dict[int, list[int]] = {}
        offset = 0
        for length in lengths:
            starts.setdefault(length, []).append(offset)
            offset += length
        self.total = offset
        # Per length: [runs, length] indices of the patches of each run.
        self.groups = [
            (torch.tensor(firsts).view(-1, 1) + torch.arange(length).view(1, -1)).to(device)
            for length, firsts in starts.items()
        ]
        # One run covering everything needs no gather or scatter.
        self.whole = len(lengths) == 1
