"""Compute kernels: CUDA sources with thin Python wrappers, and the torch references.

`kernels.reference` holds the pure-torch implementation of every op the
models use. It is the CPU path of the engine and the ground truth that the
CUDA kernels are tested against. Each CUDA op is one source in `csrc/`,
compiled by CuPy (`cuda_build.py`) and called through a wrapper module of its
own (`norm`, `rope_cache`, `activation`, `decode_attention`,
`prefill_attention`, `sampling`, `skinny_gemm`) that checks its inputs before
launching on torch's current stream. Nothing here imports the rest of the
project.
"""
