"""Compute kernels: CUDA sources with thin Python wrappers, and the torch references.

`kernels.reference` holds the pure-torch implementation of every op the
models use. It is the CPU path of the engine and the ground truth that the
CUDA kernels are tested against. Nothing here imports the rest of the project.
"""
