"""Launching a kernel with Programmatic Dependent Launch (Hopper).

cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
lets the kernel start while the previous kernel of its stream still runs; the
kernel resolves the dependency itself (kernels/csrc/pdl.cuh: griddepcontrol).
In a captured CUDA graph the launch becomes a programmatic edge, so at replay
the kernel's CTAs are resident when its predecessor ends. CuPy's RawKernel
cannot pass launch attributes, so this calls the driver through ctypes.

Struct layouts and the attribute number are those of the CUDA 13.0 driver
API header /usr/local/cuda-13.0/include/cuda.h (CUDA_VERSION 13000),
checked there with offsetof/sizeof: CUlaunchConfig is 56 bytes (seven
unsigned ints, hStream at 32, attrs at 40, numAttrs at 48); CUlaunchAttribute
is 72 bytes (a 4-byte enum id, 4 bytes of pad, the 64-byte value union at 8);
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION is 6 and its value,
programmaticStreamSerializationAllowed, an int at the union's start.
tests/kernels/test_pdl.py asserts these numbers.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
CUDA_SUCCESS = 0


class LaunchAttributeValue(ctypes.Union):
    """CUlaunchAttributeValue: 64 bytes; some members hold pointers, so it is
    8-byte aligned in C (the uint64 member gives the ctypes copy the same)."""

    _fields_ = [
        ("pad", ctypes.c_char * 64),
        ("align", ctypes.c_uint64),
        ("programmatic_stream_serialization_allowed", ctypes.c_int),
    ]


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute."""

    _fields_ = [
        ("id", ctypes.c_int),  # CUlaunchAttributeID, a C enum (4 bytes)
        ("pad", ctypes.c_char * 4),
        ("value", LaunchAttributeValue),
    ]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [
        ("grid_x", ctypes.c_uint),
        ("grid_y", ctypes.c_uint),
        ("grid_z", ctypes.c_uint),
        ("block_x", ctypes.c_uint),
        ("block_y", ctypes.c_uint),
        ("block_z", ctypes.c_uint),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),  # CUstream
        ("attrs", ctypes.POINTER(LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


def _programmatic_attribute() -> ctypes.Array[LaunchAttribute]:
    attrs = (LaunchAttribute * 1)()
    attrs[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attrs[0].value.programmatic_stream_serialization_allowed = 1
    return attrs


# The one attribute every PDL launch passes; the driver only reads it.
_ATTRIBUTES = _programmatic_attribute()

# Kernel argument types by numpy dtype: the kernels' int, long long,
# unsigned pointers (uint64) and float parameters.
_ARGUMENT_TYPES: dict[np.dtype[Any], type[ctypes._SimpleCData[Any]]] = {
    np.dtype(np.int32): ctypes.c_int32,
    np.dtype(np.uint32): ctypes.c_uint32,
    np.dtype(np.int64): ctypes.c_int64,
    np.dtype(np.uint64): ctypes.c_uint64,
    np.dtype(np.float32): ctypes.c_float,
    np.dtype(np.float64): ctypes.c_double,
}


def kernel_params(args: Sequence[Any]) -> tuple[ctypes.Array[ctypes.c_void_p], list[Any]]:
    """cuLaunchKernelEx's kernelParams for numpy scalar args: an array of
    pointers, one per argument, each at a ctypes value of the argument's C
    type. Returns (array, values); keep values alive until the launch returns.
    TypeError for anything but a numpy scalar of a listed dtype: a Python
    int or float has no C width to go by."""
    values: list[Any] = []
    for index, arg in enumerate(args):
        ctype = _ARGUMENT_TYPES.get(arg.dtype) if isinstance(arg, np.generic) else None
        if ctype is None:
            raise TypeError(
                f"kernel argument {index} must be a numpy scalar of "
                f"{sorted(str(t) for t in _ARGUMENT_TYPES)}, got {type(arg).__name__} {arg!r}")
        values.append(ctype(arg.item()))
    params = (ctypes.c_void_p * max(len(values), 1))(*(ctypes.addressof(v) for v in values))
    return params, values


def launch_config(grid: Sequence[int], block: Sequence[int], shared_bytes: int,
                  stream: int) -> LaunchConfig:
    """A CUlaunchConfig with the programmatic-stream-serialization attribute."""
    gx, gy, gz = _dims(grid, "grid")
    bx, by, bz = _dims(block, "block")
    return LaunchConfig(gx, gy, gz, bx, by, bz, shared_bytes, stream,
                        ctypes.cast(_ATTRIBUTES, ctypes.POINTER(LaunchAttribute)), 1)


def _dims(dims: Sequence[int], name: str) -> tuple[int, int, int]:
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"{name} must have 1 to 3 dimensions, got {tuple(dims)}")
    padded = (*dims, 1, 1)[:3]
    return int(padded[0]), int(padded[1]), int(padded[2])


@functools.cache
def _driver() -> ctypes.CDLL:
    """libcuda, loaded on the first PDL launch (never on a CPU machine)."""
    driver = ctypes.CDLL("libcuda.so.1")
    driver.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    driver.cuLaunchKernelEx.restype = ctypes.c_int
    driver.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    driver.cuGetErrorName.restype = ctypes.c_int
    return driver


def error_name(driver: Any, result: int) -> str:
    """The CUresult's name (CUDA_ERROR_...), or its number where the driver has none."""
    name = ctypes.c_char_p()
    if driver.cuGetErrorName(result, ctypes.byref(name)) != CUDA_SUCCESS or not name.value:
        return f"CUresult {result}"
    return name.value.decode()


def launch(function: int, grid: Sequence[int], block: Sequence[int], args: Sequence[Any],
           stream: int, shared_bytes: int = 0, driver: Any = None) -> None:
    """Launch the CUfunction `function` on `stream` (a CUstream address) with
    programmatic stream serialization. args: numpy scalars (kernel_params).
    RuntimeError naming the driver's error when the launch is refused."""
    driver = driver if driver is not None else _driver()
    params, values = kernel_params(args)
    config = launch_config(grid, block, shared_bytes, stream)
    # values back the pointers in params; the driver copies the arguments
    # before it returns (into the graph node, when capturing).
    result = driver.cuLaunchKernelEx(ctypes.byref(config), function, params, None)
    del values
    if result != CUDA_SUCCESS:
        raise RuntimeError(
            f"cuLaunchKernelEx (programmatic dependent launch) failed: "
            f"{error_name(driver, result)} ({result})")
