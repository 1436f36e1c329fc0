"""Seeded random outputs: well-formed turns with random damage, and markup soup.

No exception, the invariants of support.check_calls, and the same events
however the text is cut.
"""

from __future__ import annotations

import random
import re

import pytest

from router.chat.events import ToolCallStart
from tests.router.parsers.support import chained_events, reasoning_events, tool_events

FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "<function=", "f>", "</function>", "<parameter=", "p>",
    "</parameter>", "<think>", "</think>", "<th", "\n", "\n\n", " ", "  ", "\t", "`", "```", "~~~",
    '{"name": "', 'f"', '"arguments": ', "{", "}", "[", "]", '"', "\\", '\\"', "\\u00e9", "\\ud83d",
    ", ", ":", "1", "true", "null", "text", "é", "😀", "<", ">", "/", "=",
]  # fmt: skip
PARTS = [
    "Let me look.\n",
    "\n\n",
    "Use `<tool_call>` here.\n",
    "```\n<tool_call>\n```\n",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris }", "n": [1, {"a": 2}]}}\n</tool_call>\n',
    '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": \\"\\u00e9\\ud83d\\ude00\\"}"}\n</tool_call>',
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis 😀\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n",
    "<tool_call>\n<function=g>\n<parameter=code>\nif a < b:\n    print('</p')\n</parameter>\n</function>\n</tool_call>",
    "<think>\nhmm\n</think>\n\n",
    "Done.",
]
TOKEN = re.compile(r"<[^<>]*>?|\\u[0-9a-f]{4}|.", re.DOTALL)


def random_soup(rng: random.Random) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 40)))


def damaged_turn(rng: random.Random) -> str:
    """A few well-formed parts, then a handful of fragment-level deletions, insertions and a cut."""
    tokens = TOKEN.findall("".join(rng.choice(PARTS) for _ in range(rng.randint(1, 5))))
    for _ in range(rng.randint(0, 3)):
        at = rng.randrange(len(tokens) + 1)
        if rng.random() < 0.5 and at < len(tokens):
            del tokens[at]
        else:
            tokens.insert(at, rng.choice(FRAGMENTS))
    if rng.random() < 0.3:
        tokens = tokens[: rng.randint(0, len(tokens))]
    return "".join(tokens)


@pytest.mark.parametrize("seed", range(3))
def test_damaged_turns(seed: int) -> None:
    rng = random.Random(seed)
    started = 0
    for _ in range(100):
        text = damaged_turn(rng)
        for fmt in ("hermes", "qwen3_coder"):
            started += any(isinstance(e, ToolCallStart) for e in tool_events(text, fmt))
        chained_events(text)
        reasoning_events(text, start_in_reasoning=True)
    assert started >= 40  # the damage leaves plenty of calls to exercise


@pytest.mark.parametrize("seed", range(3))
def test_markup_soup(seed: int) -> None:
    rng = random.Random(1000 + seed)
    for _ in range(100):
        text = random_soup(rng)
        tool_events(text, "hermes")
        tool_events(text, "qwen3_coder")
        reasoning_events(text)
        tool_events(f'<tool_call>\n{{"name": "f", "arguments": {{"a": "{text}', "hermes")
        tool_events(f"<tool_call>\n<function=f>\n<parameter=a>\n{text}", "qwen3_coder")
