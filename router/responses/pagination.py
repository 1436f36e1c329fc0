"""A page of a response's input items, as GET .../input_items lists them:
`limit` 1..100 (default 20), `order` asc or desc (default desc), `after` an
item id (the page starts after it, in that order)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.http.errors import invalid

DEFAULT_LIMIT = 20
MAX_LIMIT = 100


def page_of_items(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid(f"'order' must be asc or desc, got {order!r}", "order")
    limit = _limit(query.get("limit"))
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        position = next((i for i, item in enumerate(ordered) if item["id"] == after), None)
        if position is None:
            raise invalid(f"'after' names no input item of this response: {after!r}", "after")
        ordered = ordered[position + 1:]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }


def _limit(value: str | None) -> int:
    if value is None:
        return DEFAULT_LIMIT
    try:
        limit = int(value)
    except ValueError:
        raise invalid(f"'limit' must be an integer, got {value!r}", "limit", "invalid_type") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise invalid(f"'limit' must be in [1, {MAX_LIMIT}], got {limit}", "limit")
    return limit
