"""What runs each step, decided in one place.

`core` is the busy loop (drain commands, schedule, run one step, publish
outputs); `scheduler` packs decode rows and prefill chunks under the token
budget, admits waiting requests and preempts under KV pressure; `sequence` is
one request as the scheduler sees it. Pure Python: tensors belong to
engine/execution/.
"""
