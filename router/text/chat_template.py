"""Chat templates rendered with minijinja, the way transformers' apply_chat_template renders them.

Templates come from model files (untrusted Jinja); minijinja is a sandboxed
Rust implementation that needs no Jinja2 import and is fast to render. The
environment mirrors transformers': trim_blocks and lstrip_blocks on, a tojson
that does not HTML-escape, raise_exception() and strftime_now() globals, and
the same clean-up of the messages before rendering (None-valued keys dropped,
reasoning aliases filled in).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import minijinja

# ChatML, used when a model ships no template (the router logs that it does).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Names a message's reasoning may arrive under; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# transformers' {% generation %} ... {% endgeneration %} marks assistant spans for
# training masks and renders its body unchanged; minijinja has no such tag.
_GENERATION_TAG = re.compile(r"\{%(-?)\s*(end)?generation\s*(-?)%\}")

# Appended to the final message for continue_final_message; the trailing space
# shows whether the template stripped the message's trailing whitespace.
_CONTINUE_MARK = "\x00roundhouse-continue\x00 "

_TEMPLATE_NAME = "chat"


class TemplateError(ValueError):
    """The template could not render these messages (the HTTP layer answers 400)."""


def raise_exception(message: str) -> None:
    raise TemplateError(message)


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
           separators: Sequence[str] | None = None, sort_keys: bool = False) -> str:
    # minijinja's builtin escapes <, >, & and '; transformers' filter does not.
    try:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=tuple(separators) if separators else None,
                          sort_keys=sort_keys)
    except (TypeError, ValueError) as exc:
        raise TemplateError(f"tojson: {exc}") from exc


class ChatTemplate:
    """One compiled chat template (plus its tool-use variant if the model names one)."""

    def __init__(self, source: str, *, tool_use_source: str | None = None) -> None:
        self.source = source
        self.tool_use_source = tool_use_source
        self._env = minijinja.Environment(
            trim_blocks=True,
            lstrip_blocks=True,
            filters={"tojson": tojson},
            globals={"raise_exception": raise_exception, "strftime_now": strftime_now},
        )
        self._compile(_TEMPLATE_NAME, source)
        if tool_use_source is not None:
            self._compile("tool_use", tool_use_source)

    def _compile(self, name: str, source: str) -> None:
        rewritten = _GENERATION_TAG.sub(
            lambda m: "{%" + m[1] + (" endif " if m[2] else " if true ") + m[3] + "%}", source)
        try:
            self._env.add_template(name, rewritten)
        except minijinja.TemplateError as exc:
            raise TemplateError(f"the chat template does not compile: {exc.message}") from exc

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, bos_token: str | None = None,
               eos_token: str | None = None, continue_final_message: bool = False,
               **kwargs: Any) -> str:
        """Render a conversation. Raises TemplateError for input the template rejects.

        continue_final_message leaves the last message open (an assistant
        prefill) instead of closing it; it excludes add_generation_prompt.
        Other keyword arguments (enable_thinking, documents, ...) reach the
        template as variables.
        """
        if not messages:
            raise TemplateError("the conversation has no messages")
        if continue_final_message and add_generation_prompt:
            raise TemplateError("continue_final_message and add_generation_prompt exclude each other")
        chat = [_prepare_message(message) for message in messages]
        if continue_final_message:
            final = chat[-1].get("content")
            if not isinstance(final, str):
                raise TemplateError("continue_final_message needs a final message with text content")
            chat[-1]["content"] = final + _CONTINUE_MARK
        context: dict[str, Any] = {
            "messages": chat,
            "tools": [_plain(tool) for tool in tools] if tools is not None else None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        # Like transformers' special_tokens_map: a token the model lacks is left undefined.
        if bos_token is not None:
            context["bos_token"] = bos_token
        if eos_token is not None:
            context["eos_token"] = eos_token
        context.update({key: _plain(value) for key, value in kwargs.items()})
        name = "tool_use" if tools and self.tool_use_source is not None else _TEMPLATE_NAME
        try:
            text = self._env.render_template(name, **context)
        except TemplateError:
            raise
        except minijinja.TemplateError as exc:
            raise TemplateError(f"chat template error: {exc.message}") from exc
        except Exception as exc:
            # Python's own methods on request values (content.startswith()
            # on a list of parts, a str method with a wrong argument) raise
            # Python errors through minijinja: still these messages' fault.
            raise TemplateError(f"chat template error: {type(exc).__name__}: {exc}") from exc
        return _cut_at_continue_mark(text) if continue_final_message else text


def _cut_at_continue_mark(text: str) -> str:
    mark = _CONTINUE_MARK.rstrip(" ")
    at = text.rfind(mark)
    if at < 0:
        raise TemplateError("continue_final_message: the template dropped the final message")
    if text.startswith(_CONTINUE_MARK, at):
        return text[:at]
    # The template trimmed the message; trim what precedes the mark the same way.
    return text[:at].rstrip()


def _prepare_message(message: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise TemplateError(f"a chat message must be an object, not {type(message).__name__}")
    # OpenAI clients send "content": null next to tool_calls; templates handle a
    # missing key but would print "None" for a null one.
    plain = {key: _plain(value) for key, value in message.items() if value is not None}
    reasoning = next((plain[key] for key in _REASONING_FIELDS if key in plain), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


def _plain(value: Any) -> Any:
    """A deep copy made of JSON types, so templates never see (or mutate) caller objects."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    raise TemplateError(f"chat template input holds a {type(value).__name__}, not JSON data")
