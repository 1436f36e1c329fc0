"""Canonical items (router/responses/items.py) as chat template messages.

- `instructions` is a system message in front (never carried over from a
  previous response, as the API says); developer messages are system
  messages, and the system messages at the very start are joined into one,
  because many templates accept a system message only in first place.
- An assistant turn is made of the items between two non-assistant items:
  an output message gives its text, each function_call adds a tool call
  (arguments handed to the template as an object when they are JSON, as
  the Chat Completions front-end does), and a reasoning item becomes the
  turn's `reasoning_content` (templates such as Qwen3's render it).
- A function_call_output is a `tool` message answering its call_id.
- A user message with input_image parts gets content as text and
  {"type": "image"} parts (router/chat/image_parts.py); conversation_images
  lists its images in the same order, earlier turns' included.
"""

from __future__ import annotations

import json
from typing import Any

from router.chat.image_parts import image_part
from router.media.types import ImageRef
from router.responses.items import output_text
from router.responses.tools import ToolSet


def template_messages(items: list[dict[str, Any]], instructions: str | None,
                      tools: ToolSet) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    reasoning: list[str] = []
    called: dict[str, str] = {}
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            text = reasoning_text(item)
            if text:
                reasoning.append(text)
            continue
        if kind == "message" and item["role"] != "assistant":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _content(item)})
        elif kind == "message":
            messages.append(_assistant(_text(item), reasoning))
        elif kind == "function_call":
            name = tools.model_name(item["name"], item.get("namespace"))
            called[item["call_id"]] = name
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": name, "arguments": _arguments(item["arguments"])}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
                continue
            turn = _assistant("", reasoning)
            turn["tool_calls"] = [call]
            messages.append(turn)
        elif kind == "function_call_output":
            answer = {"role": "tool", "tool_call_id": item["call_id"], "content": output_text(item["output"])}
            if item["call_id"] in called:
                answer["name"] = called[item["call_id"]]
            messages.append(answer)
        # Thinking that no assistant turn follows has nothing to belong to.
        reasoning.clear()
    return _join_leading_system(messages)


def reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's thinking: its reasoning_text, else its summary."""
    if item.get("content"):
        return "".join(part["text"] for part in item["content"])
    return "\n\n".join(part["text"] for part in item.get("summary") or [])


def _text(item: dict[str, Any]) -> str:
    return "\n".join(part["text"] for part in item["content"] if part["type"] != "input_image")


def _content(item: dict[str, Any]) -> str | list[dict[str, Any]]:
    """A non-assistant message's text, or its text and image parts when it holds images."""
    parts = item["content"]
    if not any(part["type"] == "input_image" for part in parts):
        return _text(item)
    return [image_part() if part["type"] == "input_image" else {"type": "text", "text": part["text"]}
            for part in parts]


def conversation_images(history: list[dict[str, Any]],
                        input_items: list[dict[str, Any]]) -> tuple[ImageRef, ...]:
    """The images of the conversation's messages, in the order template_messages
    renders them. An image of an earlier turn (stored, reached through
    previous_response_id) names that field; one of this request its own."""
    images = []
    for origin, items in (("previous_response_id", history), ("input", input_items)):
        for index, item in enumerate(items):
            if item["type"] != "message":
                continue
            for part_index, part in enumerate(item["content"]):
                if part["type"] == "input_image":
                    param = (origin if origin == "previous_response_id"
                             else f"input[{index}].content[{part_index}].image_url")
                    images.append(ImageRef(part["image_url"], param, part["detail"]))
    return tuple(images)


def _assistant(content: str, reasoning: list[str]) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        turn["reasoning_content"] = "\n\n".join(reasoning)
    return turn


def _arguments(arguments: str) -> Any:
    # Templates print a string as is and an object as JSON; an object makes
    # both kinds render alike.
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return arguments


def _join_leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    leading = 0
    while leading < len(messages) and messages[leading]["role"] == "system":
        leading += 1
    if leading < 2:
        return messages
    joined = "\n\n".join(m["content"] for m in messages[:leading] if m["content"])
    return [{"role": "system", "content": joined}, *messages[leading:]]
