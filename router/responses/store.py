"""Stored responses: a bounded, in-process LRU (by count and by bytes).

Each record keeps its response object, its own input items and the id of
the response it continued. A conversation is the chain of its records, so
a record costs only its own turn, not the whole history again; continuing
one (previous_response_id) walks the chain and refreshes every record in
it, so a conversation in use is never the least recently used. When the
bounds are passed the least recently used records go, with a log line; a
later request that needs one of them gets a 400 saying so.

Nothing survives a restart: this is the server's memory of recent
responses for previous_response_id and GET, not a database.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

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


class ResponseStore:
    def __init__(self, max_records: int, max_bytes: int):
        if max_records < 1 or max_bytes < 1:
            raise ValueError("a response store needs room for at least one record and one byte")
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.bytes = 0
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()

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
        self.delete(record.id)
        self._records[record.id] = record
        self.bytes += record.size
        while len(self._records) > self.max_records or self.bytes > self.max_bytes:
            old_id, old = self._records.popitem(last=False)
            self.bytes -= old.size
            log.info("response store: evicted %s (%d bytes), least recently used; keeping %d "
                     "records, %d bytes (limits: %d records, %d bytes)", old_id, old.size,
                     len(self._records), self.bytes, self.max_records, self.max_bytes)
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        record = self._records.get(response_id)
        if record is not None:
            self._records.move_to_end(response_id)
        return record

    def delete(self, response_id: str) -> bool:
        record = self._records.pop(response_id, None)
        if record is None:
            return False
        self.bytes -= record.size
        return True

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
