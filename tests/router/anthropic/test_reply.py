"""Stop reasons and usage in Anthropic's terms."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from router.anthropic.reply import new_message_id, stop_reason, usage


def turn(finish: str | None, *, stop_string: str | None = None, produced: int = 3, asked: int | None = 10,
         prompt: int = 50, cached: int = 0) -> Any:
    generation = SimpleNamespace(finish_reason=finish, stop_string=stop_string, completion_tokens=produced,
                                 prompt_tokens=prompt, cached_tokens=cached)
    request = SimpleNamespace(sampling=SimpleNamespace(max_tokens=asked))
    return SimpleNamespace(generation=generation, prepared=SimpleNamespace(request=request))


@pytest.mark.parametrize(
    ("run", "tool_use", "expected"),
    [
        (turn("stop"), False, ("end_turn", None)),
        (turn("stop"), True, ("tool_use", None)),
        (turn("stop", stop_string="END"), False, ("stop_sequence", "END")),
        (turn("length", produced=10, asked=10), False, ("max_tokens", None)),
        (turn("length", produced=7, asked=10), False, ("model_context_window_exceeded", None)),
        (turn("length", produced=7, asked=10), True, ("model_context_window_exceeded", None)),
    ],
)
def test_stop_reason(run: Any, tool_use: bool, expected: tuple[str, str | None]) -> None:
    assert stop_reason(run, tool_use) == expected


def test_cache_reads_are_counted_apart_from_input_tokens() -> None:
    assert usage(turn("stop", prompt=50, cached=32, produced=4)) == {
        "input_tokens": 18, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 32, "output_tokens": 4}


def test_message_ids() -> None:
    ids = {new_message_id() for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("msg_") and len(i) == 28 for i in ids)
