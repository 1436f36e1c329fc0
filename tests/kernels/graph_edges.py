"""How many of a captured CUDA graph's edges are programmatic (Programmatic
Dependent Launch), read through the driver: the GPU checks of kernels/pdl.py
use it to tell a graph that overlaps its kernels from one that only
launches them in order.

cuGraphGetEdges_v2 and CUgraphEdgeData (from_port, to_port, type: one byte
each, then 5 reserved; 8 bytes) as in the CUDA 13.0 cuda.h."""

from __future__ import annotations

import ctypes

import torch

_CUDA_SUCCESS = 0
_CUDA_ERROR_LOSSY_QUERY = 402


class _EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte),
                ("type", ctypes.c_ubyte), ("reserved", ctypes.c_ubyte * 5)]


def _get_edges() -> ctypes._CFuncPtr:
    function = ctypes.CDLL("libcuda.so.1").cuGraphGetEdges_v2
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.POINTER(ctypes.c_size_t)]
    function.restype = ctypes.c_int
    return function


def edge_counts(graph: torch.cuda.CUDAGraph) -> tuple[int, int]:
    """(all edges, programmatic edges) of a graph captured with
    keep_graph=True. Programmatic: a non-default edge type or an upstream
    port other than full completion (CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC,
    CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC / _LAUNCH_ORDER)."""
    get_edges = _get_edges()
    raw = ctypes.c_void_p(graph.raw_cuda_graph())
    count = ctypes.c_size_t(0)
    result = get_edges(raw, None, None, None, ctypes.byref(count))
    if result not in (_CUDA_SUCCESS, _CUDA_ERROR_LOSSY_QUERY):
        raise RuntimeError(f"cuGraphGetEdges_v2 (count) failed: CUresult {result}")
    total = count.value
    if total == 0:
        return 0, 0
    sources = (ctypes.c_void_p * total)()
    targets = (ctypes.c_void_p * total)()
    data = (_EdgeData * total)()
    result = get_edges(raw, sources, targets, data, ctypes.byref(count))
    if result != _CUDA_SUCCESS:
        raise RuntimeError(f"cuGraphGetEdges_v2 failed: CUresult {result}")
    edges = data[: count.value]
    return count.value, sum(1 for edge in edges if edge.type != 0 or edge.from_port != 0)
