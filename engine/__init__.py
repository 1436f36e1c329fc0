"""The Roundhouse engine: one process per loaded model, started by the router.

Three threads (ZMQ input, busy loop, ZMQ output), a pure-Python scheduler and
KV bookkeeping, and a model runner on torch (the CPU path) or CUDA kernels.
Grouped by job, one subpackage each: process/, scheduling/, kv/, execution/,
sampling/, models/, loader/ (docs/architecture.md, Engine internals).
"""
