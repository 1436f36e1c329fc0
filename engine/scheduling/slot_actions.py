"""llama.cpp's /slots actions on the engine's lanes (engine/scheduling/lanes.py).

- list: every lane's state (GET /slots).
- save: the K/V of the tokens the lane holds (the sequence it last ran) into
  one file (engine/kv/slot_files.py): its full pages, taken from the device
  prefix cache or the host tier by their prefix digests, as far as they hold
  them in a row from the start. Tokens past the last full page are saved as
  tokens only; a request continuing the session computes them.
- restore: the file is read and checked whole first (checksum, model, KV
  format) and refused with a message before anything is allocated; then
  its pages become ordinary device prefix cache entries, so any request
  whose prompt starts with those tokens reuses them (to the token, too:
  engine/kv/partial_pages.py), and the lane holds the session's tokens
  (what a following save writes).
- erase: the lane's pages leave the device prefix cache and the host tier
  (pages a running request still holds stay; the disk tier keeps its copies
  until they are evicted: contents are never wrong, only memory is freed).

An action on a lane that is processing waits until the lane is free, as
llama.cpp defers it; the router also serialises actions per lane.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

from engine.execution.model_runner import ModelRunner
from engine.execution.page_bytes import read_pages, write_pages
from engine.kv.block_hash import ROOT_HASH, hash_page
from engine.kv.disk_tier import artifact_digest, format_digest
from engine.kv.slot_files import SlotFileError, read_slot_file, write_slot_file
from engine.scheduling.scheduler import Scheduler
from protocol import EngineEvent, SlotCommand, SlotReply

NO_SPACE = "Unable to restore slot, no available space in KV cache"


class SlotActions:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner,
                 emit: Callable[[EngineEvent], None], drain: Callable[[], None]) -> None:
        self.scheduler = scheduler
        # Completes the step in flight: it may still write pages a finished
        # request left, which a restore may hand out again.
        self.drain = drain
        self.runner = runner
        self.emit = emit
        self.deferred: list[SlotCommand] = []

    @cached_property
    def model_digest(self) -> bytes:
        # Worked out at the first save or restore: it reads the model's files'
        # sizes and times, which an engine that never saves need not pay for.
        return bytes.fromhex(artifact_digest(Path(self.runner.model_path)))

    @cached_property
    def kv_format(self) -> bytes:
        runner, config = self.runner, self.runner.config
        return format_digest(str(runner.kv_dtype), runner.page_size, config.num_attention_layers,
                             config.num_kv_heads, config.head_dim)

    @cached_property
    def page_bytes(self) -> int:
        runner, config = self.runner, self.runner.config
        return (2 * config.num_attention_layers * runner.page_size * config.num_kv_heads
                * config.head_dim * runner.kv_dtype.itemsize)

    def handle(self, command: SlotCommand) -> None:
        lanes = self.scheduler.lanes
        if command.action == "list":
            self.emit(SlotReply(command.action_id, lanes=lanes.states()))
            return
        if not 0 <= command.id_slot < len(lanes):
            self.emit(SlotReply(command.action_id, error="Invalid slot ID"))
            return
        if command.action in ("save", "restore") and self.runner.config.has_recurrent_state:
            # A slot file holds KV pages; this model's lanes also hold recurrent
            # state, which slot files do not carry (yet).
            self.emit(SlotReply(command.action_id, error=(
                f"slot {command.action} is not supported for {self.runner.config.architecture}: "
                "its linear-attention layers keep a recurrent state that slot files do not hold")))
            return
        if lanes.busy(command.id_slot) or any(d.id_slot == command.id_slot for d in self.deferred):
            self.deferred.append(command)
            return
        self._run(command)

    def retry(self) -> None:
        """Run the deferred actions whose lane is free now, in arrival order."""
        waiting, self.deferred = self.deferred, []
        for command in waiting:
            self.handle(command)

    def _run(self, command: SlotCommand) -> None:
        self.drain()
        started = time.perf_counter()
        try:
            if command.action == "save":
                tokens, size = self._save(command.id_slot, Path(command.path))
            elif command.action == "restore":
                tokens, size = self._restore(command.id_slot, Path(command.path))
            else:
                tokens, size = self._erase(command.id_slot), 0
        except SlotFileError as exc:
            self.emit(SlotReply(command.action_id, error=str(exc)))
            return
        except OSError as exc:
            self.emit(SlotReply(command.action_id,
                                error=f"cannot write {Path(command.path).name!r}: {exc.strerror}"))
            return
        self.emit(SlotReply(command.action_id, num_tokens=tokens, num_bytes=size,
                            seconds=time.perf_counter() - started))

    def _chain(self, tokens: list[int]) -> list[tuple[bytes, list[int]]]:
        """(hash, tokens) of each full page of tokens."""
        kv = self.scheduler.kv
        ps = kv.page_size
        chain = []
        parent = ROOT_HASH
        for index in range(len(tokens) // ps):
            page_tokens = tokens[index * ps : (index + 1) * ps]
            parent = hash_page(parent, page_tokens, kv.fingerprint)
            chain.append((parent, page_tokens))
        return chain

    def _save(self, lane: int, path: Path) -> tuple[int, int]:
        kv = self.scheduler.kv
        tokens = self.scheduler.lanes.tokens(lane)
        found: list[tuple[str, int]] = []  # ("device", page) or ("host", slot)
        for page_hash, page_tokens in self._chain(tokens):
            page = kv.pool.lookup(page_hash, page_tokens)
            if page is not None:
                found.append(("device", page))
                continue
            slot = kv.host.find(page_hash, page_tokens) if kv.host is not None else None
            if slot is None:
                break
            found.append(("host", slot))
        device = read_pages(self.runner.kv_caches, [i for where, i in found if where == "device"])
        from_device = iter(device)
        payloads = []
        for where, index in found:
            if where == "device":
                payloads.append(next(from_device))
            else:
                assert self.runner.host_kv is not None
                payloads.append(self.runner.host_kv.slot_bytes(index))
        size = write_slot_file(path, model_digest=self.model_digest, format_digest=self.kv_format,
                               page_size=kv.page_size, page_bytes=self.page_bytes,
                               token_ids=tokens, pages=payloads)
        return len(tokens), size

    def _restore(self, lane: int, path: Path) -> tuple[int, int]:
        kv = self.scheduler.kv
        saved = read_slot_file(path, model_digest=self.model_digest, format_digest=self.kv_format,
                               page_size=kv.page_size, page_bytes=self.page_bytes)
        chain = self._chain(saved.token_ids)[: len(saved.pages)]
        parents = [ROOT_HASH, *(page_hash for page_hash, _ in chain)][: len(chain)]
        missing = [(parent, entry, payload)
                   for parent, entry, payload in zip(parents, chain, saved.pages, strict=True)
                   if kv.pool.lookup(*entry) is None]
        if len(missing) > kv.pool.num_free - kv.outstanding:
            raise SlotFileError(f"{NO_SPACE} ({len(missing)} pages needed)")
        pages = kv.pool.allocate(len(missing))
        # The cached pages this evicted go to the host tier first: their copies
        # must run before the pages are overwritten.
        self.runner.move_kv(kv.take_transfers())
        write_pages(self.runner.kv_caches, pages, [payload for _, _, payload in missing])
        for page, (parent, (page_hash, page_tokens), _) in zip(pages, missing, strict=True):
            kv.register(page, parent, page_hash, page_tokens)
        kv.pool.release(reversed(pages))
        self.scheduler.lanes.set_tokens(lane, saved.token_ids)
        return len(saved.token_ids), saved.num_bytes

    def _erase(self, lane: int) -> int:
        kv = self.scheduler.kv
        tokens = self.scheduler.lanes.tokens(lane)
        for page_hash, page_tokens in self._chain(tokens):
            page = kv.pool.lookup(page_hash, page_tokens)
            if page is not None and kv.pool.is_idle(page):
                kv.pool.drop_cached(page)
            slot = kv.host.find(page_hash, page_tokens) if kv.host is not None else None
            if slot is not None:
                kv.host.discard(slot)  # type: ignore[union-attr]
        self.scheduler.lanes.set_tokens(lane, [])
        return len(tokens)
