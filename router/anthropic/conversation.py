"""Anthropic's conversation (top-level system, user/assistant messages made of
content blocks) as the messages a chat template takes.

- system (a string or text blocks) -> a leading system message;
- user text blocks -> a user message; each tool_result block -> a tool message
  (tool_call_id, and the tool's name when an earlier tool_use names it), in
  block order, so results stay next to the calls they answer;
- assistant text -> content, tool_use -> tool_calls (arguments = input, a
  dict, which templates print as JSON), thinking -> reasoning_content;
  redacted_thinking is dropped (its content is encrypted by Anthropic);
- a final assistant message is the prefill: its text is what the answer
  continues, and it is not part of the history.

Image blocks (base64 and URL sources) in user messages and inside their
tool_result blocks become the conversation's ImageRefs, in order, and
{"type": "image"} parts of the message content (router/chat/image_parts.py);
a message without images keeps string content. Images elsewhere, file
sources (Anthropic's Files API), documents and other inputs get a 400
naming the block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

from router.anthropic.fields import refuse
from router.anthropic.schemas import InputMessage
from router.chat.image_parts import MessageContent
from router.media.sources import data_uri_from_base64
from router.media.types import ImageRef

# How a failed tool call (tool_result with is_error) reads to the model: the
# templates have no field for it, so it goes into the text.
TOOL_ERROR_PREFIX = "Error: "

_NOT_TEXT = ("document", "search_result", "container_upload")
# The media types Anthropic accepts in a base64 image source.
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


@dataclass(frozen=True)
class Conversation:
    messages: list[dict[str, Any]]
    prefill: str
    # One per {"type": "image"} part of the messages, in order.
    images: tuple[ImageRef, ...] = ()


def _text_of(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise refuse(f"{where}.text", "a text block needs a string 'text'", "invalid_type")
    return text


def _refuse_block(kind: Any, where: str, allowed: str) -> NoReturn:
    if kind == "image":
        raise refuse(f"{where}.type", "image blocks go in user messages (and their tool_result "
                     f"blocks); expected {allowed}")
    if kind in _NOT_TEXT:
        raise refuse(f"{where}.type", f"{kind} blocks are not supported: this server's models read "
                     "text and images")
    raise refuse(f"{where}.type", f"content block type {kind!r} is not supported here; expected {allowed}")


def system_text(system: str | list[dict[str, Any]] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    texts = []
    for index, block in enumerate(system):
        where = f"system[{index}]"
        if block.get("type") != "text":
            _refuse_block(block.get("type"), where, "text blocks")
        texts.append(_text_of(block, where))
    return "\n".join(texts) or None


def _blocks(message: InputMessage) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"type": "text", "text": message.content}]
    return message.content


def _image(block: dict[str, Any], where: str) -> ImageRef:
    """An image block's source: base64 data (as a data: URI) or a URL."""
    source = block.get("source")
    param = f"{where}.source"
    if not isinstance(source, dict):
        code = "missing_required_parameter" if source is None else "invalid_type"
        raise refuse(param, "an image block needs a 'source' object", code)
    kind = source.get("type")
    if kind == "base64":
        media_type = source.get("media_type")
        if media_type not in IMAGE_MEDIA_TYPES:
            raise refuse(f"{param}.media_type", f"must be one of {', '.join(IMAGE_MEDIA_TYPES)}, "
                         f"got {media_type!r}")
        data = source.get("data")
        if not isinstance(data, str) or not data:
            raise refuse(f"{param}.data", "a base64 image source needs its data as a string",
                         "invalid_type")
        return ImageRef(data_uri_from_base64(data, media_type), param)
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url.strip():
            code = "missing_required_parameter" if url is None else "invalid_type"
            raise refuse(f"{param}.url", "a url image source needs its URL as a string", code)
        return ImageRef(url, param)
    if kind == "file":
        raise refuse(f"{param}.type", "file sources need Anthropic's Files API, which this server "
                     "does not have; send the image as base64 data or a URL")
    raise refuse(f"{param}.type", f"image source type {kind!r} is not supported; expected base64 "
                 "or url")


def _tool_result_content(block: dict[str, Any], where: str,
                         images: list[ImageRef]) -> str | list[dict[str, Any]]:
    content = block.get("content", "")
    parts = MessageContent(images)
    if isinstance(content, str):
        parts.text(content)
    elif isinstance(content, list):
        for index, part in enumerate(content):
            inner = f"{where}.content[{index}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.text(_text_of(part, inner))
            elif kind == "image":
                parts.image(_image(part, inner))
            else:
                _refuse_block(kind, inner, "text or image blocks")
    else:
        raise refuse(f"{where}.content", "tool_result content must be a string or a list of text "
                     "and image blocks", "invalid_type")
    if parts.has_image:
        listed = parts.content()
        # Templates join parts with nothing between: "Error: " reads as in text.
        return [{"type": "text", "text": TOOL_ERROR_PREFIX}, *listed] if block.get("is_error") else listed
    text = "\n".join(parts.texts())
    if block.get("is_error"):
        return TOOL_ERROR_PREFIX + text if text else "Error"
    return text


class _Builder:
    """Walks the messages once, keeping tool names by tool_use id so tool
    results can name the tool they answer."""

    def __init__(self) -> None:
        self.out: list[dict[str, Any]] = []
        self.tool_names: dict[str, str] = {}
        self.images: list[ImageRef] = []

    def user(self, message: InputMessage, index: int) -> None:
        parts = MessageContent(self.images)

        def flush() -> None:
            nonlocal parts
            if parts:
                self.out.append({"role": "user", "content": parts.content()})
                parts = MessageContent(self.images)

        for block_index, block in enumerate(_blocks(message)):
            where = f"messages[{index}].content[{block_index}]"
            kind = block.get("type")
            if kind == "text":
                parts.text(_text_of(block, where))
            elif kind == "image":
                parts.image(_image(block, where))
            elif kind == "tool_result":
                flush()
                tool_use_id = block.get("tool_use_id")
                if not isinstance(tool_use_id, str) or not tool_use_id:
                    raise refuse(f"{where}.tool_use_id", "a tool_result block needs its tool_use_id")
                entry = {"role": "tool", "tool_call_id": tool_use_id,
                         "content": _tool_result_content(block, where, self.images)}
                if tool_use_id in self.tool_names:
                    entry["name"] = self.tool_names[tool_use_id]
                self.out.append(entry)
            else:
                _refuse_block(kind, where, "text, image or tool_result in a user message")
        flush()

    def assistant(self, message: InputMessage, index: int) -> dict[str, Any]:
        texts: list[str] = []
        thinking: list[str] = []
        calls: list[dict[str, Any]] = []
        for block_index, block in enumerate(_blocks(message)):
            where = f"messages[{index}].content[{block_index}]"
            kind = block.get("type")
            if kind == "text":
                texts.append(_text_of(block, where))
            elif kind == "thinking":
                text = block.get("thinking")
                if not isinstance(text, str):
                    raise refuse(f"{where}.thinking", "a thinking block needs a string 'thinking'",
                                 "invalid_type")
                # The signature is taken as it is: it only ever meant "this
                # came from a server", and keys change with every restart.
                if text:
                    thinking.append(text)
            elif kind == "redacted_thinking":
                continue
            elif kind == "tool_use":
                calls.append(self._tool_use(block, where))
            else:
                _refuse_block(kind, where, "text, thinking or tool_use in an assistant message")
        entry: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if thinking:
            entry["reasoning_content"] = "\n".join(thinking)
        if calls:
            entry["tool_calls"] = calls
        return entry

    def _tool_use(self, block: dict[str, Any], where: str) -> dict[str, Any]:
        call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
        if not isinstance(call_id, str) or not call_id:
            raise refuse(f"{where}.id", "a tool_use block needs an 'id'")
        if not isinstance(name, str) or not name:
            raise refuse(f"{where}.name", "a tool_use block needs a 'name'")
        if not isinstance(arguments, dict):
            raise refuse(f"{where}.input", "tool_use input must be an object", "invalid_type")
        self.tool_names[call_id] = name
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _prefill(message: InputMessage, index: int) -> str:
    """The text a final assistant message puts in the model's mouth."""
    texts = []
    for block_index, block in enumerate(_blocks(message)):
        where = f"messages[{index}].content[{block_index}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_of(block, where))
        elif kind == "tool_use":
            raise refuse(f"{where}.type", "a final assistant message (a prefill) cannot end in a "
                         "tool_use: send its tool_result in a user message")
        elif kind not in ("thinking", "redacted_thinking"):
            _refuse_block(kind, where, "text in a final assistant message")
    text = "".join(texts)
    # As Anthropic: trailing whitespace would make the model continue
    # mid-token, which it was never trained on.
    if text != text.rstrip():
        raise refuse(f"messages[{index}].content", "final assistant content cannot end with trailing whitespace")
    return text


def _check_not_empty(message: InputMessage, index: int) -> None:
    if not message.content:
        raise refuse(f"messages[{index}].content", "all messages must have non-empty content except "
                     "for the optional final assistant message")


def conversation(system: str | list[dict[str, Any]] | None,
                 messages: list[InputMessage]) -> Conversation:
    if not messages:
        raise refuse("messages", "at least one message is required")
    builder = _Builder()
    text = system_text(system)
    if text is not None:
        builder.out.append({"role": "system", "content": text})
    prefill = ""
    last = len(messages) - 1
    for index, message in enumerate(messages):
        if message.role == "user":
            _check_not_empty(message, index)
            builder.user(message, index)
        elif message.role == "assistant":
            if index == last:
                prefill = _prefill(message, index)
                continue
            _check_not_empty(message, index)
            builder.out.append(builder.assistant(message, index))
        else:
            raise refuse(f"messages[{index}].role", f"unexpected role {message.role!r}; roles are "
                         "'user' and 'assistant' (the system prompt goes in the top-level 'system')")
    return Conversation(builder.out, prefill, tuple(builder.images))
