"""The KV pool's element type (--kv-dtype) and the scales of an fp8 pool.

"bf16" keeps K and V in the model's dtype (bfloat16 on a GPU, float32 on the
CPU by default). "fp8" keeps them in float8 e4m3 (torch.float8_e4m3fn): one
byte an element, so the same memory holds twice the tokens.

Scales: one per tensor, 1.0 for K and for V of every layer (vLLM's default
without calibration). A cache writer stores e4m3(x / scale), rounded to
nearest even and saturated at +-448 (e4m3's largest finite value); a reader
multiplies by the scale. With scale 1.0 a value in e4m3's normal range
(2^-6 .. 448) keeps 3 mantissa bits: a relative error of at most 2^-4
(half a unit in the last place); smaller magnitudes fall into subnormals
(steps of 2^-9, an absolute error of at most 2^-10), and magnitudes past 448
saturate. Keys after RMSNorm/RoPE and values of the models we serve sit well
inside that range. Per-tensor scales keep every page self-contained bytes:
page copies, the host and disk tiers, slot files and the sleep stash move
them as they are, with no side table of scales.
"""

from __future__ import annotations

import torch

from protocol.launch import KV_DTYPES

FP8_KV = torch.float8_e4m3fn
# The per-tensor scales of an fp8 pool (bf16 pools ignore them).
K_SCALE = 1.0
V_SCALE = 1.0


def kv_torch_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the KV pool's tensors for --kv-dtype and the model's dtype."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    return FP8_KV if kv_dtype == "fp8" else model_dtype


def check_fp8_supported(kv_dtype: str, device: torch.device, model_dtype: torch.dtype,
                        use_kernels: bool) -> None:
    """Refuse an fp8 pool that no attention op here reads: on a GPU only our
    kernels (CuPy, a bf16 model, head size 64/128/256) do; the CPU's
    reference ops quantize and dequantize in torch."""
    if kv_dtype != "fp8" or device.type == "cpu" or use_kernels:
        return
    raise ValueError(
        f"--kv-dtype fp8 on {device} is read by our CUDA kernels, which need CuPy, a bfloat16 "
        f"model (this one: {model_dtype}) and head size 64, 128 or 256: serve in bfloat16 "
        "with 'roundhouse[cuda13]' (or [cuda12]) installed, or use --kv-dtype bf16")


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as uint8 for a one-byte dtype (torch has no
    index_copy_ for float8 on the CPU; a byte copy is the same copy), else
    the tensor itself."""
    return tensor.view(torch.uint8) if tensor.dtype == FP8_KV else tensor
