"""Input items: accepted shapes in one canonical form; refusals name the field."""

from __future__ import annotations

import pytest

from router.errors import RouterError
from router.http.errors import api_error
from router.responses.items import canonical_input


def test_a_string_is_one_user_message() -> None:
    (item,) = canonical_input("Hello")
    assert item["type"] == "message" and item["role"] == "user" and item["status"] == "completed"
    assert item["content"] == [{"type": "input_text", "text": "Hello"}]
    assert item["id"].startswith("msg_")


def test_every_accepted_item_kind() -> None:
    items = canonical_input([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}], "id": "msg_1"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "think"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ])
    assert [i["type"] for i in items] == ["message", "message", "reasoning", "message", "function_call",
                                          "function_call_output"]
    assert items[1]["id"] == "msg_1" and items[2]["id"] == "rs_1"
    assert items[3]["content"] == [{"type": "output_text", "text": "Let me check.", "annotations": []}]
    assert items[4]["id"].startswith("fc_") and items[4]["status"] == "completed"
    assert items[5]["output"] == "sunny"


@pytest.mark.parametrize(("item", "param"), [
    ({"type": "message", "role": "tool", "content": "x"}, "input[0].role"),
    ({"role": "system", "content": [{"type": "input_image", "image_url": "http://x"}]}, "input[0].content[0].type"),
    ({"role": "user", "content": 3}, "input[0].content"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[0].call_id"),
    ({"type": "function_call_output", "call_id": "c"}, "input[0].output"),
    ({"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]},
     "input[0].output[0].type"),
    ({"type": "web_search_call", "id": "ws_1"}, "input[0].type"),
    ({"type": "item_reference", "id": "msg_1"}, "input[0].type"),
    ({"type": "compaction", "encrypted_content": "x"}, "input[0].type"),
    ({"type": "reasoning", "content": [{"type": "summary_text", "text": "x"}]}, "input[0].content[0].type"),
])
def test_refusals_name_the_field(item: dict, param: str) -> None:
    with pytest.raises(RouterError) as error:
        canonical_input([item])
    assert api_error(error.value).status == 400 and error.value.param == param
