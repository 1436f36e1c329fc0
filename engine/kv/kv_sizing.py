"""How many KV pages the engine allocates, and the context it can serve."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil

log = logging.getLogger(__name__)

# On the CPU path the KV pool lives in RAM; by default it takes at most this
# share of the memory available at start-up, capped at CPU_KV_CAP_BYTES.
CPU_KV_SHARE = 0.25
CPU_KV_CAP_BYTES = 1 << 30


@dataclass(frozen=True)
class KvPlan:
    num_pages: int
    page_size: int
    max_context: int
    bytes_per_token: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token


# kv_capacity_tokens values with a meaning of their own.
KV_FROM_NEED = 0
KV_FILL = -1


def plan_kv(
    *,
    page_size: int,
    bytes_per_token: int,
    trained_context: int,
    requested_context: int,
    requested_capacity: int,
    max_concurrency: int,
    prefix_cache_tokens: int = 0,
    device_budget_bytes: int | None = None,
) -> KvPlan:
    """Size the pool from what the lanes can use and what memory allows.

    What the lanes can use is max_concurrency full contexts plus
    prefix_cache_tokens for cached prefixes; more would never be touched at
    once. requested_capacity: KV_FROM_NEED (0) sizes the pool to that need,
    within the memory given; KV_FILL (-1) takes all the memory given (a model
    alone on its GPU keeps conversations cached that way); a token count is
    taken as is and must fit.

    On the CPU the memory given is a quarter of what is available, capped at
    1 GiB, and never less than one full context. On a GPU it is
    device_budget_bytes (engine/execution/gpu_memory.py: the free memory, or the
    router's grant, less the activations, the graphs and the headroom).
    """
    if requested_context > trained_context:
        raise ValueError(
            f"--max-context {requested_context} is beyond the model's trained context of "
            f"{trained_context} tokens; positions past it have no rotary table"
        )
    max_context = requested_context or trained_context
    need = max_concurrency * max_context + prefix_cache_tokens
    if device_budget_bytes is not None:
        return _plan_on_device(page_size, bytes_per_token, max_context, requested_capacity,
                               need, device_budget_bytes)
    if requested_capacity > 0:
        capacity = requested_capacity
        if capacity < max_context:
            log.warning(
                "KV capacity %d tokens is below the context %d: serving a context of %d",
                capacity, max_context, capacity,
            )
            max_context = capacity
    else:
        budget = min(psutil.virtual_memory().available * CPU_KV_SHARE, CPU_KV_CAP_BYTES)
        fits = int(budget // bytes_per_token)
        wanted = fits if requested_capacity == KV_FILL else min(fits, need)
        capacity = max(max_context, wanted)
    num_pages = -(-capacity // page_size)
    return KvPlan(num_pages, page_size, max_context, bytes_per_token)


def _plan_on_device(page_size: int, bytes_per_token: int, max_context: int,
                    requested_capacity: int, need: int, budget_bytes: int) -> KvPlan:
    fits_pages = max(budget_bytes, 0) // (bytes_per_token * page_size)
    if requested_capacity > 0:
        num_pages = -(-requested_capacity // page_size)
        if num_pages > fits_pages:
            raise ValueError(
                f"--kv-capacity {requested_capacity} tokens needs "
                f"{num_pages * page_size * bytes_per_token / 2**30:.2f} GiB of device memory, but "
                f"only {max(budget_bytes, 0) / 2**30:.2f} GiB is left after the weights, the "
                f"largest step's activations, the CUDA graphs and the headroom: lower "
                f"--kv-capacity, --max-batched-tokens or --kv-headroom-mib, or use auto"
            )
    elif requested_capacity == KV_FILL:
        num_pages = fits_pages
    else:
        num_pages = min(fits_pages, -(-need // page_size))
    if num_pages < 1:
        raise ValueError(
            f"no device memory is left for the KV cache ({budget_bytes / 2**20:.0f} MiB after "
            "the weights, activations, CUDA graphs and headroom): use a GPU with more free "
            "memory, a smaller model, a lower --max-batched-tokens or --kv-headroom-mib"
        )
    capacity = num_pages * page_size
    if capacity < max_context:
        log.warning("the KV pool holds %d tokens, less than the context %d: serving a context "
                    "of %d", capacity, max_context, capacity)
        max_context = capacity
    return KvPlan(num_pages, page_size, max_context, bytes_per_token)


# The host tier (--host-kv-mib) leaves this much host memory alone: the larger
# of a share of the total and a floor, for the router, the OS and other models.
HOST_RESERVE_SHARE = 0.25
HOST_RESERVE_FLOOR_BYTES = 4 << 30
HOST_KV_AUTO = -1


@dataclass(frozen=True)
class HostKvPlan:
    num_slots: int  # pages the host tier holds (0: off)
    page_bytes: int
    # The most the tier may take: available host memory less the reserve.
    limit_bytes: int
    # A size was asked for and the limit cut it down.
    capped: bool = False

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.page_bytes


def plan_host_kv(asked_mib: int, page_bytes: int, available_bytes: int,
                 total_bytes: int) -> HostKvPlan:
    """Pages of the host tier: asked_mib MiB (HOST_KV_AUTO: no bound of its
    own), never more than the host memory available less a reserve of
    max(25% of the total, 4 GiB), so the tier cannot push the machine into
    swap. 0 asks for no tier."""
    reserve = max(int(total_bytes * HOST_RESERVE_SHARE), HOST_RESERVE_FLOOR_BYTES)
    limit = max(available_bytes - reserve, 0)
    if asked_mib == 0:
        return HostKvPlan(0, page_bytes, limit)
    asked = limit if asked_mib == HOST_KV_AUTO else asked_mib * 2**20
    granted = min(asked, limit)
    return HostKvPlan(granted // page_bytes, page_bytes, limit, capped=granted < asked)
