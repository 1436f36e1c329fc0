"""Multimodal RoPE (Qwen2.5-VL, Qwen3-VL): three position axes per token.

Every token has a temporal, a height and a width position. A text token's
three are equal and advance by one per token; an image's merged patches
(its image-pad tokens, row-major over the merged grid) share the temporal
position and take their row and column offsets from where the image starts,
and the text after the image resumes at start + max(rows, cols). So a prompt
with images has fewer distinct positions than tokens: every token after it
(decode included) sits at its index + delta on all three axes, delta <= 0,
the same for all three, which the ordinary one-position RoPE serves.

Each rotary frequency takes its angle from one axis: contiguous sections of
the frequencies (Qwen2.5-VL: mrope_section [t, h, w]) or an interleaved
t, h, w, t, h, w... assignment with the leftover high frequencies on t
(Qwen3-VL). mrope_rope_table gathers those angles from the model's ordinary
cos/sin table into one row per token, so the attention ops and kernels, which
read rope_cache[positions[t]], run unchanged with positions = arange(T).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# A merged image grid in patches, before the spatial merge, as the image
# processor reports it (image_grid_thw): (frames, rows, cols).
Grid = tuple[int, int, int]


def mrope_positions(token_ids: Sequence[int], image_grids: Sequence[Grid], image_token_id: int,
                    merge_size: int) -> tuple[torch.Tensor, int]:
    """(int64 [3, T] positions of a prompt's tokens, delta) as transformers'
    get_rope_index gives them for images. Each image is the next
    t * (h / merge) * (w / merge) image tokens, in the order of image_grids;
    ValueError when the prompt's image tokens do not match the grids. delta:
    the position of a token after the prompt minus its index (one past the
    largest position, minus T)."""
    columns: list[torch.Tensor] = []
    grids = iter(image_grids)
    index, start, count, images = 0, 0, len(token_ids), 0
    while index < count:
        if token_ids[index] != image_token_id:
            end = index
            while end < count and token_ids[end] != image_token_id:
                end += 1
            columns.append(torch.arange(start, start + end - index).expand(3, -1))
            start += end - index
            index = end
            continue
        grid = next(grids, None)
        if grid is None:
            raise ValueError(f"image token at {index} beyond the {len(image_grids)} images' tokens")
        frames, rows, cols = grid[0], grid[1] // merge_size, grid[2] // merge_size
        size = frames * rows * cols
        if index + size > count or any(token != image_token_id
                                       for token in token_ids[index:index + size]):
            raise ValueError(f"image {images} at token {index} needs {size} image tokens "
                             f"(grid {tuple(grid)}, merge {merge_size})")
        t, h, w = torch.meshgrid(torch.arange(frames), torch.arange(rows), torch.arange(cols),
                                 indexing="ij")
        columns.append(torch.stack((t, h, w)).reshape(3, -1) + start)
        start += max(grid[1], grid[2]) // merge_size
        index += size
        images += 1
    if next(grids, None) is not None:
        raise ValueError(f"{len(image_grids)} image grids for fewer images in the prompt")
    if not columns:
        return torch.zeros(3, 0, dtype=torch.int64), 0
    positions = torch.cat(columns, dim=1)
    return positions, int(positions.max()) + 1 - count


def frequency_axes(mrope_section: Sequence[int], interleaved: bool) -> torch.Tensor:
    """int64 [sum(mrope_section)]: the position axis (0 t, 1 h, 2 w) of each
    rotary frequency, as transformers' Qwen2.5-VL (contiguous sections, the
    i-th on axis i % 3) or Qwen3-VL (interleaved: frequency f is h where
    f % 3 == 1 and f < 3 * sections[1], w where f % 3 == 2 and f < 3 *
    sections[2], else t) assigns them."""
    half = sum(mrope_section)
    if not interleaved:
        return torch.cat([torch.full((n,), i % 3, dtype=torch.int64)
                          for i, n in enumerate(mrope_section)])
    freq = torch.arange(half)
    axes = torch.zeros(half, dtype=torch.int64)
    axes[(freq % 3 == 1) & (freq < 3 * mrope_section[1])] = 1
    axes[(freq % 3 == 2) & (freq < 3 * mrope_section[2])] = 2
    return axes


def mrope_rope_table(positions3: torch.Tensor, rope_cache: torch.Tensor,
                     mrope_section: Sequence[int], interleaved: bool) -> torch.Tensor:
    """The [T, D] cos|sin rows of a step's tokens under multimodal RoPE.

    positions3: int64 [3, T] (mrope_positions' columns of the step's tokens;
    a text token's are its position three times, and its row then equals
    rope_cache[position]); rope_cache: the model's [max_positions, D] table
    (kernels/reference.py build_rope_cache: cos of the D/2 frequencies, then
    sin). Row t, frequency f takes rope_cache's cos and sin of f at token t's
    position on f's axis: the same rounded values transformers computes.
    Pass it as the step's rope table with positions = arange(T).
    """
    half = rope_cache.shape[-1] // 2
    axes = frequency_axes(mrope_section, interleaved)
    if axes.numel() != half:
        raise ValueError(f"mrope_section {list(mrope_section)} covers {axes.numel()} "
                         f"frequencies; the rope table has {half}")
    device = rope_cache.device
    # rows[t, f]: token t's position on frequency f's axis.
    rows = positions3.to(device).index_select(0, axes.to(device)).T
    cols = torch.arange(half, device=device).expand_as(rows)
    return torch.cat((rope_cache[rows, cols], rope_cache[rows, cols + half]), dim=-1)
