"""An assistant turn as every chat-shaped API asks for it, in one shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol import GrammarSpec
from router.chat.thinking_budget import ThinkingBudget
from router.media.types import ImageRef
from router.sampling import SamplingRequest


@dataclass(frozen=True)
class NamedTool:
    """tool_choice naming one function: the turn must call it."""

    name: str


ToolChoice = str | NamedTool  # "auto", "none", "required" or a NamedTool


@dataclass(frozen=True)
class ChatRequest:
    # Messages ready for the chat template: role, content (a string, or a
    # list of {"type": "text", "text"} and {"type": "image"} parts in a
    # message that holds images), and tool_calls / tool_call_id /
    # reasoning_content where they apply.
    messages: list[dict[str, Any]]
    # The images of the messages, one per {"type": "image"} part, in the
    # order the template renders them (router/chat/image_parts.py).
    images: tuple[ImageRef, ...] = ()
    sampling: SamplingRequest = field(default_factory=SamplingRequest)
    # OpenAI function tools: {"type": "function", "function": {"name", "description", "parameters"}}.
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    # Names (as the model sees them) of the tools sent with strict: true: a
    # call of one follows its schema even when the choice leaves calling free.
    strict_tools: frozenset[str] = frozenset()
    parallel_tool_calls: bool = True
    # None: whatever the template does by default.
    enable_thinking: bool | None = None
    # Reasoning tokens the model may write before the engine ends its block
    # (router/chat/thinking_budget.py); None: the request names none.
    thinking_budget: ThinkingBudget | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Text the assistant turn already starts with (an Anthropic prefill); the
    # model continues it and it is not sent back.
    prefill: str = ""
    # Constrains the answer: a JSON schema, any JSON object, a regular
    # expression or a GBNF grammar.
    response_format: GrammarSpec | None = None
    # False renders the conversation without opening an assistant turn
    # (vLLM's add_generation_prompt); a prefill never opens one either.
    add_generation_prompt: bool = True
    # Ids of generated tool calls start with this ("call_" for OpenAI,
    # "toolu_" for Anthropic).
    tool_id_prefix: str = "call_"

    @property
    def tool_names(self) -> set[str]:
        return {tool["function"]["name"] for tool in self.tools}
