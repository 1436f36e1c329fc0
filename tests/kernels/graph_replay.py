"""The check the GEMV kernels' wrappers share: out= calls captured in a CUDA
graph allocate nothing and, replayed after x changes in place, give the bits
an eager call gives."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def assert_replay_equals_eager(step: Callable[[], None], xs: dict[int, torch.Tensor],
                               outs: dict[int, torch.Tensor],
                               eager: Callable[[torch.Tensor], torch.Tensor],
                               new_x: Callable[[int, int], torch.Tensor],
                               seeds: Iterable[int]) -> None:
    """step: every out= call, outs[rows] from xs[rows]; eager(x): the same
    call without out=; new_x(rows, seed): fresh input of that many rows."""
    step()  # compile and create the cuBLAS handle outside the capture
    torch.cuda.synchronize()
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations, \
        "an out= call allocated memory"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in seeds:
        for rows, x in xs.items():
            x.copy_(new_x(rows, seed + rows))
            outs[rows].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for rows, x in xs.items():
            assert torch.equal(outs[rows], eager(x)), f"replay differs from eager at M={rows}"
