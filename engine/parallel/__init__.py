"""Tensor parallelism: one model split across ranks over torch.distributed.

tensor_parallel.py: the rank and its process group (TensorParallel), the
collectives the model calls, joining a group. sharding.py: which part of each
checkpoint tensor a rank holds (ShardPlan) and the rank's view of the config.
"""

from engine.parallel.sharding import Shard, ShardedSlot, ShardPlan
from engine.parallel.tensor_parallel import (
    SINGLE_RANK,
    TensorParallel,
    join_tensor_parallel,
    leave_tensor_parallel,
)

__all__ = ["SINGLE_RANK", "Shard", "ShardPlan", "ShardedSlot", "TensorParallel",
           "join_tensor_parallel", "leave_tensor_parallel"]
