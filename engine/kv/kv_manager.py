"""Which pages each sequence holds, prefix reuse, and admission reservations.

Admission reserves pages for a sequence's tokens plus a bounded output window
(EngineOptions.output_window); `outstanding` counts reserved pages not yet
allocated, and new admissions only take what is left after them, so a running
sequence can always grow within its window. Growing past the window takes
unreserved free pages; when there are none the scheduler preempts.

With a host tier (engine/kv/host_tier.py), pages the device evicts are copied
to host memory, and admission continues past the device's prefix hits into
the host tier: each page found there gets a fresh device page, a queued copy
from the host, and a place in the device prefix cache at once (the copy runs
before the next forward pass, the first that can read it).

With a disk tier behind it (engine/kv/disk_tier.py), the pages the host tier
evicts are written to files, and the lookup goes on into the disk after the
host. Whether a request fits is decided from the disk's index alone, before
anything is read: a request that cannot be admitted yet reads nothing and
moves no host page however many steps it waits. Once it fits, try_admit
starts reading those pages into host slots off the engine's loop
(engine/kv/disk_restore.py) and refuses it for now: it waits, skipped by
admission (is_restoring), until they are read or its restore deadline
passes, and is then admitted with the pages read, copied on to the device
as host pages are; the pages not read are computed. A restore starts only
where it is expected to end sooner than computing the same tokens, from
the read and prefill rates measured so far (engine/kv/restore_cost.py);
else the prefix is admitted at once up to its first disk page, the rest
computed, and counted as a skipped restore (disk_kv_skipped).

Each admission's cached tokens are counted once, in the tier that served
them (a page read from the disk is the disk's hit, not the host's too), and
only where the scheduler counts num_cached_tokens (before a sequence's first
token), so the tiers' hit tokens and the partial ones add up to it.

Where the whole pages end, admission goes on to the token
(engine/kv/partial_pages.py): a device page continuing the same chain whose
first tokens match the prompt's next ones has those token slots copied into
the sequence's fresh page. A sequence that ends leaves its partial last page
in the cache for that. Requests that take no hits (scored prompts, mean and
CLS pooling, cache_prompt false) take no partial hits either, and pages of a
request with cache_prompt false are never registered.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from engine.kv.block_hash import ROOT_HASH, hash_page
from engine.kv.block_pool import BlockPool
from engine.kv.disk_restore import DiskRestores
from engine.kv.disk_tier import DiskTier
from engine.kv.host_tier import HostTier, KVTransfers
from engine.kv.partial_pages import PartialHit, PartialPages, partial_hash
from engine.kv.restore_cost import RestoreCost
from engine.kv.state_checkpoints import Place, StateCheckpoints
from engine.scheduling.sequence import Sequence
from protocol import CacheHits, SamplingParams


class PrefixPage(NamedTuple):
    """One full page of a prompt's reusable prefix and where it was found."""

    page_hash: bytes
    tokens: list[int]
    page: int | None  # the device page holding it, or None: in the host tier
    slot: int | None  # its host tier slot when not on the device
    # Found in the disk tier only (slot None), or read from it for this
    # request into the host tier (slot set: counted as the disk's hit).
    on_disk: bool = False


def takes_hits(params: SamplingParams) -> bool:
    """Whether a request may take its prompt's K/V from the cache: scoring
    needs every prompt position's logits, mean pooling every position's
    hidden state, CLS the first's, so nothing is skipped for them (last
    pooling reads only the last token, which is always computed); and
    cache_prompt false keeps a request out of the cache."""
    return (params.cache_prompt and params.prompt_logprobs < 0
            and params.pooling not in ("mean", "cls"))


class KVManager:
    def __init__(self, pool: BlockPool, fingerprint: bytes, output_window: int, max_context: int,
                 host: HostTier | None = None, disk: DiskTier | None = None):
        self.pool = pool
        self.host = host
        self.disk = disk
        if host is not None:
            pool.on_evict = host.offload
        self.restores: DiskRestores | None = None
        # Requests whose restore waits for the one under way (their ids;
        # judged worth restoring already).
        self._next_restores: set[str] = set()
        # Whether a restore would beat computing (with a disk tier).
        self.restore_cost: RestoreCost | None = None
        if disk is not None:
            assert host is not None, "the disk tier takes its pages from the host tier"
            host.on_evict = disk.spill
            host.below = disk  # chains leave the host tier head first
            self.restore_cost = RestoreCost()
            self.restores = DiskRestores(disk, host, pool, self.promote, self.restore_cost)
        self.page_size = pool.page_size
        self.fingerprint = fingerprint
        self.output_window = output_window
        self.max_context = max_context
        self.outstanding = 0
        self.partial = PartialPages()
        pool.on_forget = self.partial.forget
        # A hybrid model's recurrent-state checkpoints: a cached prefix is
        # reused only as far as the deepest checkpoint it holds.
        self.checkpoints: StateCheckpoints | None = None

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _cached_prefix(self, seq: Sequence) -> tuple[list[PrefixPage], bool]:
        """Longest run of full pages at the start of seq's tokens that the
        device prefix cache or the host tier holds (the device first, page by
        page), and whether the run stopped at a page neither holds.

        Only pages wholly inside the first num_tokens - 1 tokens count: the
        last token is always computed, since its logits are needed.
        """
        found: list[PrefixPage] = []
        if not takes_hits(seq.params):
            return found, False
        parent = ROOT_HASH
        ps = self.page_size
        ids = seq.cache_ids
        for index in range((seq.num_tokens - 1) // ps):
            tokens = ids[index * ps : (index + 1) * ps]
            page_hash = hash_page(parent, tokens, self.fingerprint)
            page = self.pool.lookup(page_hash, tokens)
            slot = None
            if page is None and self.host is not None:
                slot = self.host.find(page_hash, tokens)
            on_disk = (page is None and slot is None and self.disk is not None
                       and self.disk.find(page_hash))
            if page is None and slot is None and not on_disk:
                return found, True
            found.append(PrefixPage(page_hash, tokens, page, slot, on_disk))
            parent = page_hash
        return found, False

    def try_admit(self, seq: Sequence) -> bool:
        """Give seq pages for all its tokens and reserve its output window.

        Nothing is read from the disk tier unless seq fits (see _fits); when
        it fits and its prefix goes on into the disk, the reads start and
        seq is refused until they end (is_restoring)."""
        prefix, stopped = self._cached_prefix(seq)
        hit = self._partial_hit(seq, prefix)
        restore = None
        if self.checkpoints is not None:
            prefix, hit, restore = self._resume_point(seq, prefix, hit)
        remaining_output = max(seq.params.max_tokens - seq.num_output_tokens, 0)
        target_tokens = min(
            seq.num_tokens + min(self.output_window, remaining_output), self.max_context
        )
        target_pages = max(self.pages_for(target_tokens), self.pages_for(seq.num_tokens))
        if not self._fits(prefix, hit, target_pages):
            return False
        first_disk = next((i for i, entry in enumerate(prefix) if entry.on_disk), len(prefix))
        restores = self.restores
        if first_disk < len(prefix):
            assert restores is not None
            if self.is_restoring(seq):
                return False
            if not restores.has(seq.request_id) and self._worth_restoring(seq, prefix,
                                                                           first_disk):
                if restores.busy:
                    # One restore at a time: another request's holds pages
                    # until it is admitted, and two such could hold what
                    # both need.
                    self._next_restores.add(seq.request_id)
                    return False
                self._next_restores.discard(seq.request_id)
                if restores.start(
                        seq.request_id, [entry.page for entry in prefix if entry.page is not None],
                        [entry.page_hash for entry in prefix if entry.slot is not None],
                        [(prefix[i - 1].page_hash if i else ROOT_HASH, entry.page_hash,
                          tuple(entry.tokens)) for i, entry in enumerate(prefix)
                         if i >= first_disk and entry.on_disk]):
                    return False
            # Not read (judged slower than computing, past the deadline,
            # damaged, no slot): computed.
            prefix, stopped, hit = prefix[:first_disk], True, None
        if restores is not None and restores.has(seq.request_id):
            read = restores.read_pages(seq.request_id)
            prefix = [entry._replace(on_disk=True) if entry.page_hash in read else entry
                      for entry in prefix]
        from_disk = any(entry.on_disk for entry in prefix)
        cached = [entry.page for entry in prefix if entry.page is not None]
        self.pool.acquire(cached)
        if hit is not None:
            self.pool.acquire([hit.page])
        host = self.host
        if host is not None:
            if stopped or from_disk:
                host.counters.misses += 1
            if stopped and self.disk is not None:
                self.disk.counters.misses += 1
            # Before allocating: the pages it evicts go to the host tier, and
            # must not push out the slots about to be read.
            for entry in prefix:
                if entry.slot is not None:
                    host.take(entry.slot)
            if restores is not None:
                restores.finish(seq.request_id)  # its pages are pinned for this step
        fresh = iter(self.pool.allocate(self.pages_for(seq.num_tokens) - len(cached)))
        table: list[int] = []
        parent = ROOT_HASH
        for entry in prefix:
            page = entry.page
            if page is None:
                page = next(fresh)
                host.load(entry.slot, page)  # type: ignore[union-attr,arg-type]
                self.register(page, parent, entry.page_hash, entry.tokens)
            table.append(page)
            parent = entry.page_hash
        table.extend(fresh)
        partial = 0
        if hit is not None:
            self.partial.copy(hit, table[len(prefix)])
            partial = hit.num_tokens
        seq.block_table = table
        seq.block_hashes = [entry.page_hash for entry in prefix]
        seq.num_computed_tokens = len(prefix) * self.page_size + partial
        if seq.num_output_tokens == 0:
            # (Re)admitted before its first token: what it reused, by tier,
            # counted where the scheduler counts its num_cached_tokens.
            seq.cache_hits = self._hits_by_tier(prefix, partial)
            self._count_hits(seq.cache_hits)
        seq.reserved_pages = target_pages
        self.outstanding += target_pages - len(seq.block_table)
        seq.state_restore = restore
        seq.last_checkpoint = seq.num_computed_tokens
        if restore is not None and self.checkpoints is not None:
            counters = self.checkpoints.counters
            counters.restored += 1
            counters.restored_tokens += seq.num_computed_tokens
            counters.restored_from_host += restore.host
        return True

    def _worth_restoring(self, seq: Sequence, prefix: list[PrefixPage], first_disk: int
                         ) -> bool:
        """Whether to read seq's disk pages rather than compute every token
        from the first of them on (the pages after it are reachable only
        through it); a restore judged slower is counted as skipped. Asked
        once per admission: a request waiting for the restore under way was
        judged worth it already."""
        if seq.request_id in self._next_restores:
            return True
        assert self.restore_cost is not None and self.disk is not None
        disk_pages = sum(1 for entry in prefix[first_disk:] if entry.on_disk)
        if self.restore_cost.should_restore(disk_pages * self.disk.file_bytes,
                                            (len(prefix) - first_disk) * self.page_size):
            return True
        self.disk.counters.skipped += 1
        return False

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """A step computed tokens of prompts in seconds (its prefill share):
        the compute side of restore_cost's verdicts."""
        if self.restore_cost is not None:
            self.restore_cost.note_prefill(tokens, seconds)

    def _resume_point(self, seq: Sequence, prefix: list[PrefixPage], hit: PartialHit | None
                      ) -> tuple[list[PrefixPage], PartialHit | None, Place | None]:
        """The cached prefix cut back to the deepest state checkpoint in it
        (nothing when there is none), the partial page that checkpoint ends
        in, and where the checkpoint is."""
        assert self.checkpoints is not None
        cached = len(prefix) * self.page_size + (hit.num_tokens if hit is not None else 0)
        hashes = [entry.page_hash for entry in prefix]
        while (found := self.checkpoints.find(seq.token_ids, hashes, cached)) is not None:
            length, place = found
            full, rest = divmod(length, self.page_size)
            if not rest:
                return prefix[:full], None, place
            # The checkpoint ends inside a cached full page or the partial
            # hit, copied up to it; a page in the host tier cannot be copied
            # in part: look for a checkpoint before that page.
            source = prefix[full].page if full < len(prefix) else hit.page  # type: ignore[union-attr]
            if source is not None:
                return prefix[:full], PartialHit(source, rest), place
            cached = full * self.page_size
        return [], None, None

    def _fits(self, prefix: list[PrefixPage], hit: PartialHit | None, target_pages: int) -> bool:
        """Whether target_pages fit beside the other sequences' reservations,
        decided before any disk page is read. Only the device pages before
        the prefix's first disk page count as reused: a disk page that cannot
        be read cuts the prefix there and the pages after it are computed
        into fresh ones (and reusing them after all needs fewer)."""
        first_disk = next((i for i, entry in enumerate(prefix) if entry.on_disk), len(prefix))
        reused = [entry.page for entry in prefix[:first_disk] if entry.page is not None]
        # Cached pages nobody holds are counted in pool.num_free; taking them
        # does not use up a free page for the new ones.
        idle_hits = sum(1 for page in reused if self.pool.is_idle(page))
        if hit is not None and self.pool.is_idle(hit.page):
            idle_hits += 1  # pinned until its copy is queued
        available = self.pool.num_free - idle_hits - self.outstanding
        return target_pages - len(reused) <= available

    def _partial_hit(self, seq: Sequence, prefix: list[PrefixPage]) -> PartialHit | None:
        """A device page continuing the prefix's chain whose first tokens are
        seq's next ones (never its last token, which is always computed)."""
        if not takes_hits(seq.params):
            return None
        start = len(prefix) * self.page_size
        end = min(start + self.page_size, seq.num_tokens - 1)
        if end <= start:
            return None
        parent = prefix[-1].page_hash if prefix else ROOT_HASH
        return self.partial.best(parent, seq.cache_ids[start:end])

    def _hits_by_tier(self, prefix: list[PrefixPage], partial: int) -> CacheHits:
        ps = self.page_size
        device = sum(ps for entry in prefix if entry.page is not None and not entry.on_disk)
        disk = sum(ps for entry in prefix if entry.on_disk)
        return CacheHits(device=device, host=len(prefix) * ps - device - disk, disk=disk,
                         partial=partial)

    def _count_hits(self, hits: CacheHits) -> None:
        """Add one admission's cached tokens to the counter of the tier that
        served each (the device's share is the rest of num_cached_tokens)."""
        ps = self.page_size
        if self.host is not None:
            self.host.counters.hit_pages += hits.host // ps
            self.host.counters.hit_tokens += hits.host
        if self.disk is not None:
            self.disk.counters.hit_pages += hits.disk // ps
            self.disk.counters.hit_tokens += hits.disk
        if hits.partial:
            self.partial.hits += 1
            self.partial.hit_tokens += hits.partial

    def is_restoring(self, seq: Sequence) -> bool:
        """seq waits for its prefix to be read from the disk tier (or for
        the restore under way to end, so that its own can begin)."""
        restores = self.restores
        return restores is not None and (
            restores.restoring(seq.request_id)
            or (seq.request_id in self._next_restores and restores.busy))

    @property
    def restoring(self) -> bool:
        return self.restores is not None and self.restores.active

    def promote(self, slot: int, parent: bytes, page_hash: bytes, tokens: tuple[int, ...]
                ) -> int | None:
        """A page a disk restore read into a host slot, put on a device page
        (DiskRestores._keep) if the pool can spare one beyond the running
        sequences' reservations: cached there at once, the copy from the
        slot queued; returns the page, referenced for the restore. None:
        no page to spare (or the device has it already)."""
        host = self.host
        assert host is not None
        page = self.pool.lookup(page_hash, tokens)
        if page is not None:
            self.pool.acquire([page])  # computed meanwhile: no copy needed
            return page
        if self.pool.num_free - self.outstanding < 1:
            return None
        host.take(slot)  # pinned: the page allocate() may evict must not push it out
        (page,) = self.pool.allocate(1)
        host.load(slot, page)
        self.register(page, parent, page_hash, list(tokens))
        return page

    def poll_restores(self) -> None:
        """Take the disk reads done (each step, before admission)."""
        if self.restores is not None:
            self.restores.poll()

    def wait_for_reads(self, timeout: float) -> None:
        """Nothing else to do: wait for a disk read (or a restore's deadline)."""
        if self.restores is not None:
            self.restores.wait(timeout)

    def offload_cached(self) -> Iterator[KVTransfers]:
        """At shutdown, with a disk tier: move the device's cached pages that
        the disk lacks into the host tier (pushing its older pages to the
        disk), a host tier's worth at a time; the caller runs each batch's
        copies before asking for the next. close() then writes the rest."""
        host, disk = self.host, self.disk
        if host is None or disk is None:
            return
        if self.restores is not None:
            self.restores.close()  # no slot stays reserved for a read
        pages = [(page, *self.pool.cached_key(page)) for page in self.pool.cached_pages()]
        pages = [entry for entry in pages if not disk.find(entry[2])]
        for start in range(0, len(pages), host.num_slots):
            for page, parent, page_hash, tokens in pages[start : start + host.num_slots]:
                host.offload(page, parent, page_hash, tokens)
            yield host.take_transfers()

    def close(self) -> None:
        """At shutdown: the disk tier writes the host tier's pages it lacks."""
        if self.disk is not None and self.host is not None:
            assert self.restores is not None
            self.restores.close()
            self.disk.persist(self.host)

    def take_transfers(self) -> KVTransfers:
        """The host tier copies that scheduling queued, and the copies of
        pages reused to the token, to run before the next forward pass."""
        transfers = self.host.take_transfers() if self.host is not None else KVTransfers()
        transfers.copies = self.partial.take()
        return transfers

    def unpin_copy_sources(self) -> None:
        """The step is planned: the pages its copies read may be evicted again
        (whatever reuses them is queued after the copies)."""
        if self.partial.pinned:
            self.pool.release(self.partial.take_pinned())

    def try_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make seq's pages cover num_tokens tokens; False when the pool can't."""
        needed = self.pages_for(num_tokens) - len(seq.block_table)
        if needed <= 0:
            return True
        reserved = min(needed, max(seq.reserved_pages - len(seq.block_table), 0))
        unreserved = needed - reserved
        if unreserved > self.pool.num_free - self.outstanding:
            return False
        seq.block_table.extend(self.pool.allocate(needed))
        self.outstanding -= reserved
        return True

    def trim(self, seq: Sequence) -> None:
        """Release seq's pages past those its tokens need: the tail that a
        rejected draft grew into (its K/V is garbage past num_computed_tokens
        and was never hashed). Book-keeping only; nothing is copied."""
        keep = self.pages_for(seq.num_tokens)
        extra = seq.block_table[keep:]
        if not extra:
            return
        unallocated_before = max(seq.reserved_pages - len(seq.block_table), 0)
        del seq.block_table[keep:]
        # Pages given back within the reservation are owed to seq again.
        self.outstanding += max(seq.reserved_pages - keep, 0) - unallocated_before
        self.pool.release(reversed(extra))

    def commit(self, seq: Sequence) -> None:
        """Register pages that the last step filled, for later prefix hits."""
        ps = self.page_size
        full_pages = seq.num_computed_tokens // ps
        # (A prompt with images builds its key ids: only when a page is full.)
        ids = seq.cache_ids if len(seq.block_hashes) < full_pages else seq.token_ids
        while len(seq.block_hashes) < full_pages:
            index = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if index else ROOT_HASH
            tokens = ids[index * ps : (index + 1) * ps]
            page_hash = hash_page(parent, tokens, self.fingerprint)
            if seq.params.cache_prompt:
                self.register(seq.block_table[index], parent, page_hash, tokens)
            seq.block_hashes.append(page_hash)

    def register(self, page: int, parent: bytes, page_hash: bytes, tokens: list[int]) -> None:
        """Make a full page that holds tokens after the chain parent a prefix
        cache entry, and reusable to the token (unless the hash is cached
        already, in another page)."""
        if self.pool.register(page, parent, page_hash, tokens):
            self.partial.add(parent, page, tokens)

    def free(self, seq: Sequence) -> None:
        if self.restores is not None:
            self.restores.finish(seq.request_id)  # aborted while its pages were read
            self._next_restores.discard(seq.request_id)
        self._keep_partial_page(seq)
        self.outstanding -= max(seq.reserved_pages - len(seq.block_table), 0)
        # Tail first: the prefix, shared more often, stays cached longer.
        self.pool.release(reversed(seq.block_table))
        seq.block_table = []
        seq.block_hashes = []
        seq.reserved_pages = 0
        seq.num_computed_tokens = 0

    def _keep_partial_page(self, seq: Sequence) -> None:
        """Register seq's partial last page (the tokens whose K/V it holds
        past its last full page) so a later prompt can reuse them to the
        token; a placeholder (a token still on the device) ends them."""
        if not seq.params.cache_prompt:
            return
        known = min(seq.num_computed_tokens, seq.num_tokens)
        while known and seq.token_ids[known - 1] < 0:
            known -= 1
        full, rest = divmod(known, self.page_size)
        if not rest or full >= len(seq.block_table) or len(seq.block_hashes) < full:
            return
        parent = seq.block_hashes[full - 1] if full else ROOT_HASH
        tokens = seq.cache_ids[full * self.page_size : known]
        page = seq.block_table[full]
        if self.pool.register(page, parent, partial_hash(parent, tokens, self.fingerprint),
                              tokens):
            self.partial.add(parent, page, tokens)

    def check_invariants(self, running: list[Sequence]) -> None:
        self.pool.check_invariants()
        self.partial.check_invariants(self.pool.is_registered)
        if self.host is not None:
            self.host.check_invariants()
        if self.restores is not None:
            self.restores.check_invariants()
        expected = sum(max(s.reserved_pages - len(s.block_table), 0) for s in running)
        assert self.outstanding == expected, (
            f"outstanding reservations {self.outstanding} != {expected} summed over running"
        )
        assert self.outstanding <= self.pool.num_free, (
            f"reserved {self.outstanding} pages but only {self.pool.num_free} are free"
        )
