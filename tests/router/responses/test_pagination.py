"""GET .../input_items pages: limit, order, after."""

from __future__ import annotations

import pytest

from router.errors import RouterError
from router.http.errors import api_error
from router.responses.pagination import page_of_items

ITEMS = [{"id": f"item_{i}"} for i in range(5)]


def ids(page: dict) -> list[str]:
    return [item["id"] for item in page["data"]]


def test_newest_first_by_default() -> None:
    page = page_of_items(ITEMS, {})
    assert ids(page) == ["item_4", "item_3", "item_2", "item_1", "item_0"]
    assert page["object"] == "list" and not page["has_more"]
    assert (page["first_id"], page["last_id"]) == ("item_4", "item_0")


def test_pages_follow_after() -> None:
    first = page_of_items(ITEMS, {"order": "asc", "limit": "2"})
    assert ids(first) == ["item_0", "item_1"] and first["has_more"]
    second = page_of_items(ITEMS, {"order": "asc", "limit": "2", "after": first["last_id"]})
    assert ids(second) == ["item_2", "item_3"] and second["has_more"]
    last = page_of_items(ITEMS, {"order": "asc", "limit": "2", "after": second["last_id"]})
    assert ids(last) == ["item_4"] and not last["has_more"]


def test_an_empty_page() -> None:
    page = page_of_items([], {})
    assert page["data"] == [] and page["first_id"] is None and not page["has_more"]


@pytest.mark.parametrize(("query", "param"), [
    ({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"), ({"limit": "x"}, "limit"),
    ({"order": "up"}, "order"), ({"after": "nope"}, "after"),
])
def test_bad_queries_name_their_parameter(query: dict, param: str) -> None:
    with pytest.raises(RouterError) as error:
        page_of_items(ITEMS, query)
    assert api_error(error.value).status == 400 and error.value.param == param
