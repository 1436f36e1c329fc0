"""Setting up a hybrid model's recurrent state: its pools, its checkpoints,
and the engine options it cannot honour yet.

Called by bootstrap before the step whose memory sizes the KV pool is
measured, so on a GPU the pools are already out of the free memory that the
KV budget is read from.
"""

from __future__ import annotations

import dataclasses
import logging

import psutil
import torch

from engine.execution.recurrent_state import RecurrentStatePools, state_row_bytes
from engine.kv.kv_sizing import HostKvPlan
from engine.loader import LoadedModel
from protocol import EngineOptions

log = logging.getLogger(__name__)

# A hybrid model's host tier gives this share of its bytes to state
# checkpoints, the rest to KV pages.
HOST_CHECKPOINT_SHARE = 0.5

# Checkpoints take at most this share of the memory free for them (the
# device's after the weights; on the CPU, of the RAM available), so that a
# large --ctx-checkpoints on a large model cuts checkpoints, not the KV pool.
CHECKPOINT_MEMORY_SHARE = 0.125


def attach_recurrent_state(loaded: LoadedModel, config: EngineOptions, device: torch.device,
                           dtype: torch.dtype) -> RecurrentStatePools | None:
    """The state pools of a hybrid model (None for any other), attached to it:
    one row per lane and --ctx-checkpoints per lane for checkpoints, fewer
    when those would take more than CHECKPOINT_MEMORY_SHARE of the memory."""
    model = loaded.config
    if not model.has_recurrent_state:
        return None
    row = state_row_bytes(model, dtype)
    lanes = config.max_concurrency
    # Speculative decoding keeps a backup of each lane's state (a rejected
    # draft puts it back): a second row per lane.
    backups = config.spec != "none"
    fixed_rows = lanes * (2 if backups else 1)
    wanted = config.ctx_checkpoints * lanes
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] - fixed_rows * row
    else:
        free = psutil.virtual_memory().available - fixed_rows * row
    fits = max(int(free * CHECKPOINT_MEMORY_SHARE) // row, 0)
    checkpoints = min(wanted, fits)
    if checkpoints < wanted:
        log.warning("--ctx-checkpoints %d: %d checkpoints of %.1f MiB would take more than "
                    "%d%% of the free memory; keeping %d", config.ctx_checkpoints, wanted,
                    row / 2**20, round(CHECKPOINT_MEMORY_SHARE * 100), checkpoints)
    pools = RecurrentStatePools(model, lanes=lanes, checkpoints=checkpoints, device=device,
                                dtype=dtype, backups=backups)
    loaded.model.attach_state(pools)  # type: ignore[attr-defined]
    log.info("recurrent state: %d linear-attention layers, %.2f MiB a sequence; %d lane rows%s "
             "and %d checkpoints, %.1f MiB", len(pools.linear_layers), row / 2**20, lanes,
             " (and as many backups for speculative decoding)" if backups else "",
             checkpoints, pools.nbytes / 2**20)
    return pools


def without_disk_tier(config: EngineOptions, architecture: str) -> bool:
    """Whether the disk KV tier asked for is left off: its pages alone cannot
    resume a hybrid model's prefix, and it keeps no state checkpoints yet
    (logged once)."""
    if not config.disk_kv_path:
        return False
    log.warning("--disk-kv-path: %s keeps recurrent state that the disk KV tier does not "
                "hold yet; the disk tier is off for this model (the host tier keeps its "
                "state checkpoints)", architecture)
    return True


def share_host_tier(plan: HostKvPlan, pools: RecurrentStatePools) -> HostKvPlan:
    """Give HOST_CHECKPOINT_SHARE of the host tier's bytes to host checkpoint
    rows (allocated here) and the rest to its KV pages: a prefix resumes only
    with both. Returns the pages' plan."""
    if not plan.num_slots:
        return plan
    row = pools.row_bytes
    rows = int(plan.total_bytes * HOST_CHECKPOINT_SHARE) // row
    pools.allocate_host(rows)
    slots = (plan.total_bytes - rows * row) // plan.page_bytes
    log.info("host memory ledger: %d recurrent-state checkpoints, %.1f MiB, of the host "
             "tier's %.1f MiB", rows, rows * row / 2**20, plan.total_bytes / 2**20)
    return dataclasses.replace(plan, num_slots=slots)
