"""Compiling our CUDA sources with CuPy and launching them on torch's stream.

Each op's source is one file in kernels/csrc/. `load_kernel` compiles it the
first time a process asks (NVRTC, for the GPU's own architecture, so sm_90 on
Hopper) and CuPy keeps the compiled module on disk (CUPY_CACHE_DIR), so a
second engine start does not compile again.

`launch` puts a kernel on torch's current stream. That is what makes our
kernels and torch's (cuBLAS GEMMs, elementwise ops) run in order, and what
lets torch.cuda.graph capture them: during a capture the current stream is
the capturing one. Arguments are passed as plain numbers (pointers as
uint64), so a launch allocates nothing and costs a few microseconds of host
time; no CuPy array is ever made.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

SOURCE_DIR = Path(__file__).parent / "csrc"

# NVRTC options common to every module. No fast-math: exp and division must
# round as the references do, and attention softmax already uses exp2f.
# Flush-to-zero is on all the same: CuPy appends -ftz=true after these options
# (cupy.cuda.compiler._compile_with_cache_cuda), so float32 arithmetic,
# comparisons and libdevice math (expf, logf, rsqrtf) read and write
# subnormals (|x| < 2^-126) as +-0 where torch keeps them. bf16/fp16
# instructions and inline PTX without .ftz are unaffected. Never build a
# float32 that may be subnormal from integer bits (e4m3 as the float bits of
# value * 2^-120 lost its subnormal codes): widen through fp16 (cvt.f32.f16).
# Elsewhere only values that pass through magnitudes below 2^-126 change.
_OPTIONS = ("--std=c++17",)


def cuda_available() -> bool:
    """True when kernels can run here: a CUDA device and CuPy to compile for it."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _module(source: str, device_index: int) -> Any:
    import cupy

    major, minor = torch.cuda.get_device_capability(device_index)
    code = (SOURCE_DIR / source).read_text()
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(
            code=code,
            options=(*_OPTIONS, f"--gpu-architecture=sm_{major}{minor}", f"-I{SOURCE_DIR}"),
        )
        module.compile()
    return module


@functools.cache
def load_kernel(source: str, name: str, device_index: int) -> Any:
    """The kernel `name` (declared extern "C") of kernels/csrc/<source>."""
    import cupy

    with cupy.cuda.Device(device_index):
        return _module(source, device_index).get_function(name)


@functools.cache
def _external_stream(pointer: int, device_index: int) -> Any:
    import cupy

    return cupy.cuda.ExternalStream(pointer, device_index)


def ptr(tensor: torch.Tensor) -> np.uint64:
    """A tensor's device address as a kernel argument."""
    return np.uint64(tensor.data_ptr())


def launch(
    kernel: Any,
    grid: Sequence[int],
    block: Sequence[int],
    args: Sequence[Any],
    device: torch.device,
    shared_bytes: int = 0,
) -> None:
    """Run kernel on torch's current stream of device. args must already be
    numpy scalars of the parameter types (np.int32, np.float32, ptr(...))."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)
    kernel(
        tuple(grid),
        tuple(block),
        tuple(args),
        shared_mem=shared_bytes,
        stream=_external_stream(stream.cuda_stream, index),
    )


def set_max_dynamic_shared(kernel: Any, nbytes: int) -> None:
    """Allow a kernel more than 48 KiB of dynamic shared memory."""
    if kernel.max_dynamic_shared_size_bytes < nbytes:
        kernel.max_dynamic_shared_size_bytes = nbytes


def check_cuda_tensor(
    name: str,
    tensor: torch.Tensor,
    *,
    dtype: torch.dtype,
    ndim: int,
    device: torch.device | None = None,
) -> None:
    """Raise a ValueError unless tensor is a contiguous CUDA tensor of dtype and
    rank ndim (on device, when given): kernels index raw memory."""
    if not tensor.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got one on {tensor.device}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")


def device_index_of(tensor: torch.Tensor) -> int:
    """The CUDA device index a tensor lives on ("cuda" means the current one)."""
    return tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def tensors_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes a and b span (first to last element) intersect."""
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end = a_start + a.numel() * a.element_size()
    b_end = b_start + b.numel() * b.element_size()
    return a_start < b_end and b_start < a_end


def check_row_strided_out(out: torch.Tensor, rows: int, n: int, device: torch.device) -> int:
    """Validate a GEMV output: bf16 [rows, n] on device whose rows are
    contiguous, possibly a column range of a wider matrix (row stride >= n,
    as when a weight's row segments write their columns of one output).
    Returns the row stride in elements."""
    if not out.is_cuda or out.device != device:
        raise ValueError(f"out must be a CUDA tensor on {device}, got one on {out.device}")
    if out.dtype != torch.bfloat16:
        raise ValueError(f"out must be torch.bfloat16, got {out.dtype}")
    if tuple(out.shape) != (rows, n):
        raise ValueError(f"out must be {(rows, n)}, got {tuple(out.shape)}")
    row_stride, column_stride = out.stride()
    if (column_stride != 1 and n > 1) or (row_stride < n and rows > 1):
        raise ValueError(f"out's rows must be contiguous and not overlap, got strides {out.stride()}")
    return row_stride if rows > 1 else n


def check_gemv_x(x: torch.Tensor, max_rows: int) -> tuple[int, int]:
    """A GEMV kernel's activations: contiguous bf16 [M, K] with 1 <= M <=
    max_rows, 16-byte aligned (its rows are read 16 bytes at a time).
    Returns (M, K); ValueError otherwise."""
    check_cuda_tensor("x", x, dtype=torch.bfloat16, ndim=2)
    rows, k = x.shape
    if not 1 <= rows <= max_rows:
        raise ValueError(f"x must have 1 to {max_rows} rows, got {rows}")
    if x.data_ptr() % 16:
        raise ValueError("x must start at a 16-byte aligned address")
    return rows, k


def gemv_out(out: torch.Tensor | None, rows: int, n: int, x: torch.Tensor,
             inputs: tuple[torch.Tensor, ...], names: str) -> tuple[torch.Tensor, int]:
    """A GEMV kernel's output and its row stride: bf16 [rows, n] allocated
    on x's device when None, else checked (check_row_strided_out) and
    refused where it overlaps any of inputs ("out must not overlap <names>")."""
    if out is None:
        return torch.empty((rows, n), dtype=torch.bfloat16, device=x.device), n
    stride = check_row_strided_out(out, rows, n, x.device)
    if any(row_strided_out_overlaps(out, stride, tensor) for tensor in inputs):
        raise ValueError(f"out must not overlap {names}")
    return out, stride


def row_strided_out_overlaps(out: torch.Tensor, row_stride: int, tensor: torch.Tensor) -> bool:
    """Whether a [rows, n] output with this row stride spans any byte of tensor."""
    start = out.data_ptr()
    end = start + ((out.shape[0] - 1) * row_stride + out.shape[1]) * out.element_size()
    t_start = tensor.data_ptr()
    t_end = t_start + tensor.numel() * tensor.element_size()
    return start < t_end and t_start < end
