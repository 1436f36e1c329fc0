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

Programmatic Dependent Launch (kernels/pdl.py, kernels/csrc/pdl.cuh): a
kernel that its source declares PDL-aware (a `// pdl-aware: <glob> ...`
line naming its kernels) is launched with the programmatic-stream-
serialization attribute when the switch is on (ROUNDHOUSE_PDL, default on,
"0" off; set_pdl), the GPU is Hopper or newer, and the current stream is
capturing a CUDA graph. Eager launches always take CuPy's path.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kernels import pdl

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


# A kernels/csrc header included by a source: `#include "name"`.
_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", re.MULTILINE)
# A source's PDL-aware kernels: `// pdl-aware: <glob> [<glob> ...]`.
_PDL_DECLARATION = re.compile(r"^[ \t]*//[ \t]*pdl-aware:(.*)$", re.MULTILINE)


def source_text(source: str) -> str:
    """kernels/csrc/<source> with its local headers pasted in (each once,
    #line directives keeping compiler messages' file names and lines).
    NOTE: CuPy's compile cache is keyed on the source text alone; a header
    left to -I would be served stale from the cache after it changed."""
    return _pasted(source, (SOURCE_DIR / source).read_text(), {source})


def _pasted(name: str, text: str, seen: set[str]) -> str:
    def paste(match: re.Match[str]) -> str:
        header = match.group(1)
        if not (SOURCE_DIR / header).is_file():
            raise FileNotFoundError(f'{name} includes "{header}", not in {SOURCE_DIR}')
        if header in seen:
            return ""
        seen.add(header)
        # Pasted once, so its include guard would only draw a warning.
        body = _PRAGMA_ONCE.sub("", (SOURCE_DIR / header).read_text())
        line = text.count("\n", 0, match.end()) + 2  # the line after the include
        return f'#line 1 "{header}"\n{_pasted(header, body, seen)}\n#line {line} "{name}"'

    return _LOCAL_INCLUDE.sub(paste, text)


@functools.cache
def pdl_kernel_patterns(source: str) -> tuple[str, ...]:
    """The globs of the kernels kernels/csrc/<source> declares PDL-aware."""
    text = (SOURCE_DIR / source).read_text()
    return tuple(glob for line in _PDL_DECLARATION.findall(text) for glob in line.split())


def declared_pdl_aware(source: str, name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, glob) for glob in pdl_kernel_patterns(source))


@functools.cache
def _module(source: str, device_index: int) -> Any:
    import cupy

    major, minor = torch.cuda.get_device_capability(device_index)
    code = source_text(source)
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(
            code=code,
            options=(*_OPTIONS, f"--gpu-architecture=sm_{major}{minor}", f"-I{SOURCE_DIR}"),
        )
        module.compile()
    return module


# Kernels whose source declares them PDL-aware (they wait before reading
# their inputs; kernels/csrc/pdl.cuh). Cached kernels live for the process.
_PDL_KERNELS: set[Any] = set()


@functools.cache
def load_kernel(source: str, name: str, device_index: int) -> Any:
    """The kernel `name` (declared extern "C") of kernels/csrc/<source>."""
    import cupy

    with cupy.cuda.Device(device_index):
        kernel = _module(source, device_index).get_function(name)
    if declared_pdl_aware(source, name):
        _PDL_KERNELS.add(kernel)
    return kernel


def pdl_from_environment() -> bool:
    """ROUNDHOUSE_PDL: PDL in captured graphs unless it is "0"."""
    return os.environ.get("ROUNDHOUSE_PDL", "1") != "0"


# The switch. It applies to launches, so a graph keeps the mode it was
# captured with.
_pdl_on = pdl_from_environment()


def set_pdl(enabled: bool) -> bool:
    """Turn PDL launches on or off for later captures; returns the previous
    setting (A/B runs in one process: capture, flip, capture again)."""
    global _pdl_on
    previous, _pdl_on = _pdl_on, bool(enabled)
    return previous


def pdl_enabled() -> bool:
    return _pdl_on


def is_pdl_aware(kernel: Any) -> bool:
    return kernel in _PDL_KERNELS


@functools.cache
def _pdl_capable(device_index: int) -> bool:
    # griddepcontrol needs sm_90; pdl.cuh compiles it out below that.
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def uses_pdl(kernel: Any, device_index: int) -> bool:
    """Whether launch() puts kernel on the stream with PDL: switch on,
    kernel PDL-aware, a Hopper-or-newer GPU, and a graph being captured.
    (torch asks the current device's stream; were that another device's,
    the answer could be wrong either way, and either way the launch is
    correct: PDL-aware kernels wait for their inputs whenever they start.)"""
    return (_pdl_on and kernel in _PDL_KERNELS and torch.cuda.is_current_stream_capturing()
            and _pdl_capable(device_index))


@functools.cache
def _function_pointer(kernel: Any) -> int:
    """The CUfunction of a CuPy RawKernel (call inside its device's context)."""
    return int(kernel.kernel.ptr)


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
    if uses_pdl(kernel, index):
        import cupy

        with cupy.cuda.Device(index):
            pdl.launch(_function_pointer(kernel), grid, block, args, stream.cuda_stream,
                       shared_bytes)
        return
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
