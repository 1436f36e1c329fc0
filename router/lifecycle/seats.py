"""Device seats and device memory: the one authority on which models hold a
device, which wait for one, and which idle model makes room.

A model holds a seat from the moment its load or wake is granted until it is
UNLOADED or SLEEPING again (its lifecycle calls release()). Models that need a
seat wait in arrival order, one entry per model however many requests want
it. Two limits apply to the head of that queue:

- --models-max: the count of holders;
- device memory, per GPU: a ledger of what each holder holds there (the
  footprint its engine reported in Ready.memory, else the planned estimate;
  a sleeping model holds nothing), what other processes hold (the device's
  used memory less our holders', read from the probe when planning; kept
  from the last settled reading while one of ours is mid-transition, when
  its real use is unknown) and --device-headroom-mib.

A model planned by bytes goes to the candidate GPU (router/lifecycle/
placement.py: its pin, or every GPU for `auto`) where it fits with the fewest
evictions, ties going to the one with the most room left. When it does not
fit, idle holders of that GPU are evicted (put to sleep or unloaded: the
lifecycle's business, through the `evict` callback), least recently used
first, until it will; busy models are never chosen. A model that cannot fit
on any candidate even alone is refused at once (insufficient_device_memory),
with the numbers. CPU models, and every model on a host without GPUs, are
counted only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.errors import QueueTimeout, RouterError, Unavailable
from router.footprint import CUDA_CONTEXT_BYTES
from router.lifecycle.placement import Demand, DeviceNeeds, Placement, freed_bytes, held_bytes
from router.lifecycle.slot import ModelSlot, ModelState

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class Eviction:
    """Why a holder is asked to give its seat back."""

    reason: str  # "device_memory" or "models_max"
    for_model: str  # the model it makes room for
    gpu: int | None = None


@dataclass(frozen=True)
class DeviceBook:
    """One GPU's ledger as of the last probe (bytes)."""

    index: int
    name: str
    total_bytes: int
    free_bytes: int
    other_bytes: int
    headroom_bytes: int

    @property
    def capacity_bytes(self) -> int:
        """What our models may hold there together."""
        return max(self.total_bytes - self.other_bytes - self.headroom_bytes, 0)

    def describe(self) -> str:
        return (f"GPU {self.index} ({self.name}) has {self.capacity_bytes / GIB:.2f} GiB for "
                f"models ({self.total_bytes / GIB:.2f} GiB total, {self.other_bytes / GIB:.2f} "
                f"GiB held by other processes, {self.headroom_bytes / GIB:.2f} GiB headroom)")


@dataclass(frozen=True)
class _Option:
    """Placing the head of the queue on one GPU."""

    gpu: int
    victims: tuple[tuple[ModelSlot, str], ...]
    # Room comes back only once leaving models (or the victims) are gone.
    wait: bool
    room_now: int
    room_after: int


@dataclass(eq=False)
class _Request:
    slot: ModelSlot
    granted: asyncio.Future[None]
    # Requests (and POST /models/load calls) waiting on this entry.
    users: int = 0


class SeatArbiter:
    def __init__(self, limit: int, pending_timeout_ms: int, *,
                 start: Callable[[ModelSlot, Placement], bool],
                 evict: Callable[[ModelSlot, Eviction], None],
                 idle: Callable[[ModelSlot], bool],
                 needs: DeviceNeeds, headroom_bytes: int = 0):
        """limit: --models-max (0: no limit). start(slot, placement) begins
        the granted model's load or wake there and says False when the model
        is still settling (asked again on the next change); evict(slot, why)
        begins giving a seat back; idle(slot) says whether a holder may be
        evicted now. needs: each model's demand and the GPUs' memory."""
        self.limit = limit
        self._pending_timeout_ms = pending_timeout_ms
        self._start = start
        self._evict = evict
        self._idle = idle
        self._needs = needs
        self._headroom = headroom_bytes
        self._places: dict[ModelSlot, Placement] = {}
        # Holders whose sleep or unload is under way: their seat is coming back.
        self._leaving: set[ModelSlot] = set()
        self._books: dict[int, DeviceBook] = {}
        self._queue: list[_Request] = []
        self._pumping = False
        self._pump_again = False

    # ---- who holds a seat ---------------------------------------------------------

    @property
    def holders(self) -> frozenset[ModelSlot]:
        return frozenset(self._places)

    def holds(self, slot: ModelSlot) -> bool:
        return slot in self._places

    def books(self, probe: bool = True) -> list[tuple[DeviceBook, int]]:
        """Each GPU's ledger and the bytes our models hold or are planned to
        hold there (read afresh unless `probe` is False)."""
        if probe and self._needs.gpus:
            self._refresh()
        return [(book, self._resident(book.index)) for book in self._books.values()]

    @property
    def waiting(self) -> int:
        return len(self._queue)

    # ---- requests and releases ------------------------------------------------------

    async def request(self, slot: ModelSlot, deadline: float) -> None:
        """Wait in arrival order until `slot` holds a seat and its load or wake
        has begun. Raises QueueTimeout (models_busy) at the deadline."""
        if slot in self._places:
            return
        entry = next((r for r in self._queue if r.slot is slot), None)
        if entry is None:
            entry = _Request(slot, asyncio.get_running_loop().create_future())
            self._queue.append(entry)
        entry.users += 1
        self.reconsider()
        try:
            await asyncio.wait_for(asyncio.shield(entry.granted), max(deadline - time.monotonic(), 0))
        except TimeoutError:
            raise QueueTimeout(
                f"no room for model '{slot.id}': the seats (--models-max {self.limit}) "
                f"or the device memory it needs are held by busy models; waited "
                f"{self._pending_timeout_ms} ms for room", code="models_busy", retry_after=1,
            ) from None
        finally:
            entry.users -= 1
            if entry.users == 0 and entry in self._queue:
                # Nobody wants it any more: a model that leaves may unblock
                # the ones behind it.
                self._queue.remove(entry)
                self.reconsider()

    def release(self, slot: ModelSlot) -> None:
        """`slot` is UNLOADED or SLEEPING: its seat is free."""
        self._places.pop(slot, None)
        self._leaving.discard(slot)
        self.reconsider()

    def releasing(self, slot: ModelSlot) -> None:
        """`slot` began a sleep or unload: its seat is on its way back, so no
        other model is evicted for the same waiter meanwhile."""
        if slot in self._places:
            self._leaving.add(slot)

    def pick_victim(self) -> ModelSlot | None:
        """The least recently used holder that may be evicted now, if any."""
        idle = self._idle_lru()
        return idle[0] if idle else None

    def _idle_lru(self) -> list[ModelSlot]:
        idle = [s for s in self._places if s not in self._leaving and self._idle(s)]
        return sorted(idle, key=lambda s: s.last_used)

    def refuse_all(self, error: RouterError) -> None:
        """Every waiting model's requests get `error` (server shutdown)."""
        for entry in self._queue:
            if not entry.granted.done():
                entry.granted.set_exception(error)
                # Retrieved here: the users re-raise it, there may be none.
                entry.granted.exception()
        self._queue.clear()

    # ---- granting ---------------------------------------------------------------------

    def reconsider(self) -> None:
        """Grant seats in arrival order, evicting an idle model when all are
        taken. A change made inside (a state set by start or evict) calls
        back here; those calls fold into another round of this one."""
        if self._pumping:
            self._pump_again = True
            return
        self._pumping = True
        try:
            self._pump_again = True
            while self._pump_again:
                self._pump_again = False
                self._round()
        finally:
            self._pumping = False

    def _round(self) -> None:
        while self._queue:
            entry = self._queue[0]
            slot = entry.slot
            if slot in self._places:
                self._grant(entry)
                continue
            decision = self._plan(slot, self._needs.demand(slot))
            if isinstance(decision, RouterError):
                self._queue.remove(entry)
                if not entry.granted.done():
                    entry.granted.set_exception(decision)
                    entry.granted.exception()  # retrieved: its users re-raise it
                continue
            if decision is None:
                return  # room is on its way (or busy models hold it): asked again later
            self._places[slot] = decision
            if not self._start(slot, decision):
                del self._places[slot]
                return  # still settling (a sleep or unload); asked again when done
            self._grant(entry)

    # ---- planning -------------------------------------------------------------------

    def _plan(self, slot: ModelSlot, demand: Demand) -> Placement | RouterError | None:
        """Where the head of the queue goes now; None to wait (after starting
        the evictions that make room); an error when it can never fit."""
        if demand.refusal is not None:
            return Unavailable(f"model '{slot.id}' cannot be placed: {demand.refusal}",
                               code="insufficient_device_memory")
        if not demand.gpus:
            extra = self._count_victims([])
            if extra is None or not self._evict_all(slot, [(s, "models_max") for s in extra]):
                return None
            if self.limit and len(self._places) >= self.limit:
                return None  # a leaving model's seat is on its way
            return Placement(demand.engine_device)
        books = self._refresh()
        options: list[_Option] = []
        never: list[str] = []
        for gpu in demand.gpus:
            book = books.get(gpu)
            if book is None:
                never.append(f"GPU {gpu} did not answer the probe")
            elif demand.need_bytes > book.capacity_bytes:
                never.append(book.describe())
            else:
                option = self._option(gpu, book, demand)
                if option is not None:
                    options.append(option)
        if not options:
            if len(never) == len(demand.gpus):
                return self._refusal(slot, demand, never)
            return None  # models with requests in flight hold the room
        best = min(options, key=lambda o: (len(o.victims), -o.room_after))
        if not self._evict_all(slot, list(best.victims), best.gpu) or best.wait:
            return None
        planned = best.room_now if demand.fill else demand.need_bytes
        grant_mib = max(planned - demand.runtime_bytes, 0) // MIB
        return Placement(f"cuda:{best.gpu}", best.gpu, planned, grant_mib, demand.fill)

    def _option(self, gpu: int, book: DeviceBook, demand: Demand) -> _Option | None:
        """What placing the demand on this GPU takes; None when busy models
        hold too much of it (or too many seats) for now."""
        need = demand.need_bytes
        room = book.capacity_bytes - self._resident(gpu)
        coming = sum(freed_bytes(s, p) for s, p in self._places.items()
                     if p.gpu == gpu and s in self._leaving)
        victims: list[ModelSlot] = []
        freed = 0
        for candidate in self._idle_lru():
            if room + coming + freed >= need:
                break
            if self._places[candidate].gpu == gpu:
                victims.append(candidate)
                freed += freed_bytes(candidate, self._places[candidate])
        if room + coming + freed < need:
            return None
        extra = self._count_victims(victims)
        if extra is None:
            return None
        freed += sum(freed_bytes(s, self._places[s]) for s in extra if self._places[s].gpu == gpu)
        chosen = tuple([(s, "device_memory") for s in victims] + [(s, "models_max") for s in extra])
        seats_now = not self.limit or len(self._places) < self.limit
        return _Option(gpu, chosen, wait=room < need or not seats_now, room_now=room,
                       room_after=room + coming + freed - need)

    def _count_victims(self, chosen: list[ModelSlot]) -> list[ModelSlot] | None:
        """More holders to evict so that one more model fits under
        --models-max once the leaving ones and `chosen` are gone (least
        recently used first); None when too few are idle."""
        if not self.limit:
            return []
        after = len(self._places) - len(self._leaving) - len(chosen) + 1
        extra: list[ModelSlot] = []
        for candidate in self._idle_lru():
            if after <= self.limit:
                break
            if candidate not in chosen:
                extra.append(candidate)
                after -= 1
        return extra if after <= self.limit else None

    def _evict_all(self, slot: ModelSlot, victims: list[tuple[ModelSlot, str]],
                   gpu: int | None = None) -> bool:
        """Start the evictions; True when there were none to start."""
        for victim, reason in victims:
            self._leaving.add(victim)
            self._evict(victim, Eviction(reason, slot.id, gpu))
        return not victims

    def _held_on(self, gpu: int) -> int:
        return sum(held_bytes(s, p) for s, p in self._places.items() if p.gpu == gpu)

    def _resident(self, gpu: int) -> int:
        """What our processes hold on a GPU: the holders, plus the CUDA
        context each sleeping model's engine process keeps."""
        sleepers = sum(1 for s in self._needs.slots()
                       if s not in self._places and s.engine is not None
                       and s.placement is not None and s.placement.gpu == gpu)
        return self._held_on(gpu) + sleepers * CUDA_CONTEXT_BYTES

    def _refresh(self) -> dict[int, DeviceBook]:
        """Read the GPUs' memory now. What other processes hold is the used
        memory less our holders'; while one of ours there is loading, waking
        or leaving, its real use is unknown, so the last reading stands
        unless this one is higher."""
        for index, memory in self._needs.probe().items():
            ours = [s for s, p in self._places.items() if p.gpu == index]
            other = max(memory.used_bytes - self._resident(index), 0)
            previous = self._books.get(index)
            if previous is not None and not all(self._settled(s) for s in ours):
                other = max(other, previous.other_bytes)
            self._books[index] = DeviceBook(index, memory.name, memory.total_bytes,
                                            memory.free_bytes, other, self._headroom)
        return self._books

    def _settled(self, slot: ModelSlot) -> bool:
        return slot.state is ModelState.LOADED and slot not in self._leaving

    def _refusal(self, slot: ModelSlot, demand: Demand, never: list[str]) -> RouterError:
        tried = ", ".join(str(g) for g in demand.gpus)
        return Unavailable(
            f"model '{slot.id}' needs {demand.need_bytes / GIB:.2f} GiB of device memory "
            f"({demand.detail}) and cannot fit even alone: {'; '.join(never)} (tried GPU "
            f"{tried}). Lower its max-context, max-concurrency or kv-capacity, serve a smaller "
            "dtype, pin it to a larger GPU, or lower --device-headroom-mib",
            code="insufficient_device_memory")

    def _grant(self, entry: _Request) -> None:
        if entry in self._queue:
            self._queue.remove(entry)
        if not entry.granted.done():
            entry.granted.set_result(None)
