"""Stored responses: a bounded, in-process LRU (by count and by bytes).

Each record keeps its response object, its own input items and the id of
the response it continued. A conversation is the chain of its records, so
a record costs only its own turn, not the whole history again; continuing
one (previous_response_id) walks the chain and refreshes every record in
it, so a conversation in use is never the least recently used. When the
bounds are passed the least recently used records go, with a log line; a
later request that needs one of them gets a 400 saying so.

A continuation pins its conversation while it runs (`pinned`): eviction
passes over pinned records, so the chain it read is still there when its
own record is stored. A DELETE is honoured at once even so: it breaks the
pins on that record, and the continuation then fails with a 400
`previous_response_not_found` (an error event when streamed) and is not
stored, so no stored response ever continues a deleted one.

Nothing survives a restart: this is the server's memory of recent
responses for previous_response_id and GET, not a database.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from router.errors import InvalidRequest
from router.http.keys import MANAGER

log = logging.getLogger(__name__)

MIB = 1 << 20


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]
    # This request's own input items (canonical, with ids); earlier turns
    # live in the records of the chain.
    input_items: list[dict[str, Any]]
    previous_id: str | None
    size: int

    @property
    def id(self) -> str:
        return self.body["id"]


def stored(body: dict[str, Any], input_items: list[dict[str, Any]],
           previous_id: str | None) -> StoredResponse:
    # The JSON size stands in for the memory a record holds: close enough to
    # bound it, and computed once.
    size = len(msgspec.json.encode([body, input_items]))
    return StoredResponse(body, input_items, previous_id, size)


class MissingResponse(Exception):
    """A response of the chain is not stored (never was, deleted, or evicted)."""

    def __init__(self, response_id: str):
        super().__init__(response_id)
        self.response_id = response_id


class ChainBroken(InvalidRequest):
    """A response of a running continuation's conversation was deleted."""

    def __init__(self, previous_id: str, deleted_id: str):
        message = f"Previous response with id '{previous_id}' not found: "
        message += ("it was deleted while this response was being generated." if deleted_id == previous_id
                    else f"response '{deleted_id}' of its conversation was deleted while this response "
                         "was being generated.")
        super().__init__(message, code="previous_response_not_found", param="previous_response_id")


class ChainPin:
    """A running continuation's hold on the records of its conversation."""

    def __init__(self, previous_id: str | None, record_ids: tuple[str, ...]):
        self.previous_id = previous_id
        self.record_ids = record_ids
        self.deleted_id: str | None = None

    def check(self) -> None:
        """Raise ChainBroken once a record of the conversation was deleted."""
        if self.deleted_id is not None:
            assert self.previous_id is not None
            raise ChainBroken(self.previous_id, self.deleted_id)


class ResponseStore:
    def __init__(self, max_records: int, max_bytes: int):
        if max_records < 1 or max_bytes < 1:
            raise ValueError("a response store needs room for at least one record and one byte")
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.bytes = 0
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()
        # Record id -> the pins of running continuations whose chain holds it.
        self._pins: dict[str, list[ChainPin]] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._records

    def put(self, record: StoredResponse) -> bool:
        """Store a record, evicting the least recently used ones past the
        bounds; False (and a log line) when it alone is larger than allowed."""
        if record.size > self.max_bytes:
            log.warning("response %s (%d bytes) is larger than the whole response store (%d bytes, "
                        "--response-store-max-mib); not stored", record.id, record.size, self.max_bytes)
            return False
        self._drop(record.id)
        self._records[record.id] = record
        self.bytes += record.size
        self._evict(keep=record.id)
        return True

    def _evict(self, keep: str | None = None) -> None:
        # Pinned records are passed over: a running continuation needs its
        # chain. They are at most the chains of the requests in flight, so
        # the store may exceed its bounds by that much until they finish.
        records, size = len(self._records), self.bytes
        victims: list[str] = []
        for record_id, record in self._records.items():  # least recently used first
            if records <= self.max_records and size <= self.max_bytes:
                break
            if record_id in self._pins or record_id == keep:
                continue
            victims.append(record_id)
            records -= 1
            size -= record.size
        for record_id in victims:
            old = self._records.pop(record_id)
            self.bytes -= old.size
            log.info("response store: evicted %s (%d bytes), least recently used; keeping %d "
                     "records, %d bytes (limits: %d records, %d bytes)", record_id, old.size,
                     len(self._records), self.bytes, self.max_records, self.max_bytes)

    def get(self, response_id: str) -> StoredResponse | None:
        record = self._records.get(response_id)
        if record is not None:
            self._records.move_to_end(response_id)
        return record

    def delete(self, response_id: str) -> bool:
        """Forget a record; running continuations of its conversation will
        fail instead of storing a response that continues it."""
        if not self._drop(response_id):
            return False
        for pin in self._pins.get(response_id, ()):
            pin.deleted_id = pin.deleted_id or response_id
        return True

    def _drop(self, response_id: str) -> bool:
        record = self._records.pop(response_id, None)
        if record is None:
            return False
        self.bytes -= record.size
        return True

    @contextlib.contextmanager
    def pinned(self, previous_id: str | None) -> Iterator[ChainPin]:
        """Pin the conversation ending with `previous_id` while a
        continuation of it runs. Raises MissingResponse when it is not whole."""
        record_ids = tuple(r.id for r in self.chain(previous_id)) if previous_id is not None else ()
        pin = ChainPin(previous_id, record_ids)
        for record_id in record_ids:
            self._pins.setdefault(record_id, []).append(pin)
        try:
            yield pin
        finally:
            for record_id in record_ids:
                pins = self._pins[record_id]
                pins.remove(pin)
                if not pins:
                    del self._pins[record_id]
            self._evict()  # what was passed over while pinned

    def chain(self, response_id: str) -> list[StoredResponse]:
        """The records of a conversation, oldest first, ending with
        `response_id`; raises MissingResponse naming the first one missing."""
        records: list[StoredResponse] = []
        current: str | None = response_id
        while current is not None:
            record = self.get(current)
            if record is None:
                raise MissingResponse(current)
            records.append(record)
            current = record.previous_id
        records.reverse()
        return records

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """Every item of a conversation up to and including `response_id`'s
        output: each turn's input items, then its output items."""
        items: list[dict[str, Any]] = []
        for record in self.chain(response_id):
            items.extend(record.input_items)
            items.extend(record.body["output"])
        return items


# One store per application, made from its ServeConfig on first use.
_stores: weakref.WeakKeyDictionary[web.Application, ResponseStore] = weakref.WeakKeyDictionary()


def response_store(app: web.Application) -> ResponseStore:
    store = _stores.get(app)
    if store is None:
        config = app[MANAGER].config
        store = ResponseStore(config.response_store_max_records,
                              max(1, int(config.response_store_max_mib * MIB)))
        _stores[app] = store
    return store
