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
