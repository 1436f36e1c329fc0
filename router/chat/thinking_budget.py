"""Thinking budgets: how many tokens a thinking model may reason before the
engine ends its reasoning block (engine/sampling/forced_tokens.py writes the
model's own closing delimiter, then the model answers).

Where a turn's budget comes from, the first found:
1. a count the request gives: Chat Completions' `thinking_budget` (also
   llama.cpp's `thinking_budget_tokens` and Qwen's
   `chat_template_kwargs.thinking_budget`), Messages' `thinking.budget_tokens`;
2. the request's effort level (`reasoning_effort`, Responses'
   `reasoning.effort`), through EFFORT_BUDGETS;
3. the model's `--reasoning-budget` (llama.cpp's option).
-1 is no limit; 0 turns thinking off through the template's switch (where
the template has none, the engine closes the block at once). A count the
client gave is taken as given (max_tokens may cut it first); a budget from an
effort level or the server is capped at three quarters of the turn's output
budget, so that the answer keeps room.

Where the request names no reasoning setting (no thinking switch, no budget,
no effort), a JSON-constrained answer (a json_schema or json_object format)
is asked with thinking off, unless the model's --chat-template-kwargs set
enable_thinking: a structured answer is what such a client waits for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protocol import GrammarSpec, ReasoningBudget
from router.errors import invalid
from router.text.model_text import ModelText

# Effort levels as budgets. "none" and "minimal" turn thinking off; "low"
# is Anthropic's smallest budget; "high" is Gemini 2.5 Flash's largest;
# "xhigh" and "max" leave thinking unbounded (max_tokens still holds).
EFFORT_BUDGETS: Mapping[str, int] = {
    "none": 0, "minimal": 0, "low": 1024, "medium": 8192, "high": 24576, "xhigh": -1, "max": -1,
}
UNLIMITED = -1

# The reasoning delimiters every thinking template here uses (the parser's,
# router/parsers/reasoning.py). The engine closes a block the way Qwen3's
# template writes one: "\n</think>\n\n"; under a grammar, which lets nothing
# but the answer follow </think>, without the newlines after it.
OPEN_BLOCK = "<think>\n"
CLOSE_TAG = "</think>"
_END = "\n</think>\n\n"
_END_UNDER_GRAMMAR = "\n</think>"
_JSON_KINDS = ("json_schema", "json_object")


@dataclass(frozen=True)
class ThinkingBudget:
    tokens: int  # -1: no limit
    # From an effort level or the server's default, not a count the client gave.
    default: bool = False

    def for_output(self, max_tokens: int) -> int:
        """The budget for a turn that may generate max_tokens."""
        if self.tokens < 0 or not self.default:
            return self.tokens
        return min(self.tokens, max_tokens * 3 // 4)


def given_budget(value: Any, param: str) -> ThinkingBudget | None:
    """A budget the client gave as a token count (None: not given)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < UNLIMITED:
        raise invalid(f"'{param}' must be -1 (no limit), 0 (thinking off) or a token count, "
                      f"got {value!r}", param)
    return ThinkingBudget(value)


def effort_budget(effort: str | None) -> ThinkingBudget | None:
    """An effort level's budget (None: no level, or one not in the table)."""
    tokens = EFFORT_BUDGETS.get(effort) if effort is not None else None
    return None if tokens is None else ThinkingBudget(tokens, default=True)


def server_budget(tokens: int) -> ThinkingBudget | None:
    """The model's --reasoning-budget (-1, its default, sets none)."""
    return None if tokens < 0 else ThinkingBudget(tokens, default=True)


def thinking_switch(enable_thinking: bool | None, budget: ThinkingBudget | None,
                    names_a_setting: bool, answer: GrammarSpec | None,
                    template_defaults: Mapping[str, Any]) -> bool | None:
    """The template's enable_thinking for a turn (None: the template's own
    default): the request's switch, else off for a budget of 0, else off for
    a JSON answer when the request names no reasoning setting."""
    if enable_thinking is not None:
        return enable_thinking
    if budget is not None and budget.tokens == 0:
        return False
    if (not names_a_setting and answer is not None and answer.kind in _JSON_KINDS
            and "enable_thinking" not in template_defaults):
        return False
    return None


def reasoning_budget(text: ModelText, tokens: int, *, under_grammar: bool,
                     after: str = "") -> ReasoningBudget:
    """What the engine needs to hold a block that the prompt opened to
    `tokens` (-1: only force `after`, the text that must follow the block)."""
    encode = text.tokenizer.encode
    return ReasoningBudget(
        budget=tokens,
        close_ids=encode(CLOSE_TAG),
        end_ids=encode(_END_UNDER_GRAMMAR if under_grammar else _END),
        after_ids=encode(after) if after else [],
    )
