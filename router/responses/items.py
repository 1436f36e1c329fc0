"""A request's `input`, checked item by item and put in one canonical shape.

The canonical items are what GET /v1/responses/{id}/input_items lists (the
API's item shapes, each with an id) and what router/responses/history.py
turns into template messages. Every refusal names its field
(`input[2].content[0].type`).

Accepted: messages (roles user, system, developer, assistant; content a
string or input_text/output_text parts, input_image parts in user messages,
and refusal parts from assistants), function_call, function_call_output and
reasoning items. Everything else (files, audio, an input_image's file_id,
hosted tool calls, item references, compaction items) is refused: this
server has no Files API and no hosted tools.
"""

from __future__ import annotations

import json
from typing import Any

from router.chat.image_parts import detail_of, image_url
from router.http.errors import invalid
from router.responses import ids

ROLES = ("user", "system", "developer", "assistant")
# Item types that only exist with hosted tools, stored conversations or
# compaction, none of which this server has.
_HOSTED_ITEMS = {
    "file_search_call", "web_search_call", "computer_call", "computer_call_output",
    "image_generation_call", "code_interpreter_call", "local_shell_call",
    "local_shell_call_output", "shell_call", "shell_call_output", "apply_patch_call",
    "apply_patch_call_output", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "mcp_call", "custom_tool_call", "custom_tool_call_output",
    "tool_search_call", "tool_search_output", "additional_tools", "program", "program_output",
}


def canonical_input(value: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's input as canonical items (a string is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [_message("user", [{"type": "input_text", "text": value}], None)]
    return [_item(item, f"input[{index}]") for index, item in enumerate(value)]


def _item(item: dict[str, Any], where: str) -> dict[str, Any]:
    kind = item.get("type")
    if kind is None and "role" in item:
        kind = "message"  # the "easy" message shape leaves the type out
    if kind == "message":
        return _message_item(item, where)
    if kind == "function_call":
        return _function_call(item, where)
    if kind == "function_call_output":
        return _function_call_output(item, where)
    if kind == "reasoning":
        return _reasoning(item, where)
    if kind in _HOSTED_ITEMS:
        raise invalid(f"input item type {kind!r} is not supported: this server has no hosted or "
                      "custom tools; send function calls and their outputs", f"{where}.type")
    if kind == "item_reference":
        raise invalid("item references are not supported; send the items themselves, or continue "
                      "a stored response with previous_response_id", f"{where}.type")
    if kind == "compaction":
        raise invalid("compaction items are not supported: this server does not compact "
                      "conversations", f"{where}.type")
    raise invalid(f"unknown input item type {kind!r}; expected message, function_call, "
                  "function_call_output or reasoning", f"{where}.type")


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        code = "missing_required_parameter" if value is None else "invalid_type"
        raise invalid(f"'{where}.{key}' must be a string", f"{where}.{key}", code)
    return value


def _given_id(item: dict[str, Any], prefix: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and given else ids.new_id(prefix)


def _message(role: str, content: list[dict[str, Any]], given: str | None) -> dict[str, Any]:
    # An assistant message in the input has the shape of a past output message.
    return {"id": given or ids.new_id(ids.MESSAGE), "type": "message", "role": role,
            "status": "completed", "content": content}


def _message_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise invalid(f"unknown role {role!r}; expected one of {', '.join(ROLES)}", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        shaped = [_text(role, content)]
    elif isinstance(content, list):
        shaped = [_part(part, role, f"{where}.content[{index}]") for index, part in enumerate(content)]
    else:
        raise invalid("a message's content must be a string or a list of content parts",
                      f"{where}.content", "invalid_type")
    return _message(role, shaped, _given_id(item, ids.MESSAGE))


def _text(role: str, text: str) -> dict[str, Any]:
    if role == "assistant":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}


def _part(part: Any, role: str, where: str) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise invalid("a content part must be an object", where, "invalid_type")
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        return _text(role, _string(part, "text", where))
    if kind == "refusal" and role == "assistant":
        return _text(role, _string(part, "refusal", where))
    if kind == "input_image":
        return _input_image(part, role, where)
    raise invalid(f"content part type {kind!r} is not supported: this server takes text "
                  "(input_text, output_text) and images (input_image)", f"{where}.type")


def _input_image(part: dict[str, Any], role: str, where: str) -> dict[str, Any]:
    if role != "user":
        raise invalid(f"{where} is an image in a {role} message; images go in user messages "
                      "only", f"{where}.type")
    if part.get("file_id") is not None:
        raise invalid("'file_id' needs the Files API, which this server does not have; send "
                      "image_url (a data: URI or an http(s) URL)", f"{where}.file_id")
    return {"type": "input_image", "image_url": image_url(part.get("image_url"), f"{where}.image_url"),
            "detail": detail_of(part.get("detail"), f"{where}.detail"), "file_id": None}


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    arguments = item.get("arguments", "")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments)
    elif not isinstance(arguments, str):
        raise invalid("function_call arguments must be a JSON string", f"{where}.arguments", "invalid_type")
    call = {"id": _given_id(item, ids.FUNCTION_CALL), "type": "function_call",
            "call_id": _string(item, "call_id", where), "name": _string(item, "name", where),
            "arguments": arguments, "status": "completed"}
    namespace = item.get("namespace")
    if namespace is not None:
        call["namespace"] = _string(item, "namespace", where)
    return call


def _function_call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    output = item.get("output")
    if isinstance(output, list):
        for index, part in enumerate(output):
            part_where = f"{where}.output[{index}]"
            if not isinstance(part, dict) or part.get("type") != "input_text":
                kind = part.get("type") if isinstance(part, dict) else None
                raise invalid(f"function output part type {kind!r} is not supported: this server "
                              "takes text (input_text)", f"{part_where}.type")
            _string(part, "text", part_where)
    elif not isinstance(output, str):
        code = "missing_required_parameter" if output is None else "invalid_type"
        raise invalid("function_call_output needs 'output', a string or input_text parts",
                      f"{where}.output", code)
    return {"id": _given_id(item, ids.FUNCTION_CALL_OUTPUT), "type": "function_call_output",
            "call_id": _string(item, "call_id", where), "output": output, "status": "completed"}


def _text_list(item: dict[str, Any], key: str, kind: str, where: str) -> list[dict[str, Any]]:
    value = item.get(key) or []
    if not isinstance(value, list):
        raise invalid(f"'{where}.{key}' must be a list", f"{where}.{key}", "invalid_type")
    parts = []
    for index, part in enumerate(value):
        part_where = f"{where}.{key}[{index}]"
        if not isinstance(part, dict) or part.get("type") != kind:
            raise invalid(f"'{part_where}' must be a {kind} part", f"{part_where}.type")
        parts.append({"type": kind, "text": _string(part, "text", part_where)})
    return parts


def _reasoning(item: dict[str, Any], where: str) -> dict[str, Any]:
    reasoning: dict[str, Any] = {
        "id": _given_id(item, ids.REASONING), "type": "reasoning",
        "summary": _text_list(item, "summary", "summary_text", where),
        "content": _text_list(item, "content", "reasoning_text", where),
    }
    encrypted = item.get("encrypted_content")
    if isinstance(encrypted, str):
        reasoning["encrypted_content"] = encrypted
    return reasoning


def output_text(content: str | list[dict[str, Any]]) -> str:
    """The text of a function call's output (a string or input_text parts)."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)
