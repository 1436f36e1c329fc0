"""One assistant turn: render the prompt, run the generation, split its output.

    prepared = await prepare_turn(manager, slot, request, images)  # template, tokens, images; no engine
    async with manager.lease(slot, autoload=..., on_admit=prepared.admit) as engine:
        run = start_turn(manager, prepared, engine, request_id)
        async for event in run.events(): ...                # ParsedEvent | PromptProgress
    run.finish_reason, run.usage(), run.generation.timings()

The template sees the tools unless tool_choice is "none". "required" and a
named tool are enforced with a grammar (router/chat/tool_grammar.py), as is a
JSON response format; under "auto", a grammar holds the calls of strict tools
to their schemas and leaves the text free. The model may think first when
thinking is on; a thinking budget (router/chat/thinking_budget.py) is held
by the engine, which ends the block itself when the budget is spent, and
forces a forced call's opener right after the block. For both the block
opens in the prompt. The output goes through the reasoning parser (when the
template thinks) and the tool-call parser (when tools are offered):
reasoning is never parsed for tool calls.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from protocol import GrammarSpec, ImageInput, ReasoningBudget
from router.capabilities import require_vision
from router.chat.events import (
    ContentDelta,
    ParsedEvent,
    ReasoningDelta,
    ToolCallEnd,
)
from router.chat.request import ChatRequest, NamedTool
from router.chat.thinking_budget import (
    OPEN_BLOCK,
    UNLIMITED,
    ThinkingBudget,
    reasoning_budget,
    server_budget,
    thinking_switch,
)
from router.chat.tool_grammar import (
    answer_grammar,
    call_opener,
    forced_tool_grammar,
    strict_tools_grammar,
)
from router.errors import invalid
from router.generation import Generation, GenerationInput, Piece, PromptProgress, check_context
from router.lifecycle import ModelManager, ModelSlot
from router.media.image_loader import ImageLoader
from router.media.placement import expand_image_tokens
from router.observability.records import current_record
from router.output_budget import fits, output_budget
from router.parsers import ReasoningParser, ToolCallParser, detect_reasoning, detect_tool_format
from router.sampling import build_params, check_logit_bias
from router.supervisor import EngineProcess
from router.text.chat_template import TemplateError
from router.text.model_text import ModelText


@dataclass(frozen=True)
class PreparedTurn:
    slot: ModelSlot
    text: ModelText
    request: ChatRequest
    prompt: str
    prompt_ids: list[int]
    # "hermes", "qwen3_coder", or None when no tools are offered.
    tool_format: str | None
    # "off" (no thinking), "open" (the output starts with <think>) or
    # "inside" (the prompt already opened <think>).
    thinking: str
    # The start of a forced tool call written at the end of the prompt (and
    # fed to the tool-call parser first), or "".
    opener: str = ""
    # With thinking "inside": the budget the engine holds the block to
    # (None: no limit), and the text it forces right after the block (a
    # forced call's opener, which then streams as output), or "".
    budget: ThinkingBudget | None = None
    after_block: str = ""
    # The request's images at their offsets in prompt_ids, where each stands
    # as its num_tokens image tokens (router/media/placement.py).
    images: tuple[ImageInput, ...] = ()

    def admit(self, slot: ModelSlot, *, param: str = "messages", limit_field: str = "max_tokens",
              clamp: bool = False) -> None:
        """The lease's on_admit check: the prompt and (unless clamp) the asked
        output fit the loaded model's context (a 400 before any wait for a lane)."""
        fits(len(self.prompt_ids), self.request.sampling.max_tokens, slot.max_context,
             param=param, limit_field=limit_field, clamp=clamp)
        if slot.ready is not None:
            check_logit_bias(self.request.sampling.logit_bias, slot.ready.model.n_vocab)


async def prepare_turn(manager: ModelManager, slot: ModelSlot, request: ChatRequest,
                       images: ImageLoader | None = None) -> PreparedTurn:
    """Render and tokenize, and load the request's images into the prompt
    (each image token the template wrote becomes the image's tokens), so
    that prompt_ids is what the engine computes and every count is of it.
    Needs the model's text side only, not its engine; `images` (the app's
    loader) only for a model served with --vision."""
    turn = await render_turn(manager, slot, request)
    entry = slot.entry
    if not entry.settings.engine.vision:
        return turn
    spec = entry.vision
    assert spec is not None, "build_catalog reads the VisionSpec of every --vision model"
    assert images is not None, "a model served with --vision needs the app's ImageLoader"
    # Rendered first: a conversation the template refuses fetches nothing.
    loaded = await images.load(request.images, spec)
    ids, inputs = expand_image_tokens(turn.prompt_ids, loaded, request.images, spec,
                                      param="messages")
    return replace(turn, prompt_ids=ids, images=inputs)


async def render_turn(manager: ModelManager, slot: ModelSlot, request: ChatRequest) -> PreparedTurn:
    """Render and tokenize, images not loaded: each stands as the one image
    token the template wrote (what /apply-template shows)."""
    require_vision(request.images, slot.entry)
    text = await manager.text_for(slot)
    offered = request.tools if request.tools and request.tool_choice != "none" else None
    kwargs = dict(request.template_kwargs)
    budget = request.thinking_budget or server_budget(slot.entry.settings.reasoning_budget)
    switch = thinking_switch(request.enable_thinking, budget,
                             request.enable_thinking is not None or request.thinking_budget is not None,
                             request.response_format, text.template_defaults)
    if switch is not None:
        kwargs["enable_thinking"] = switch
    messages = list(request.messages)
    if request.prefill:
        messages.append({"role": "assistant", "content": request.prefill})
    try:
        prompt = await text.render_chat_async(
            messages, add_generation_prompt=request.add_generation_prompt and not request.prefill,
            tools=offered,
            continue_final_message=bool(request.prefill), **kwargs,
        )
    except TemplateError as exc:
        raise invalid(f"the model's chat template rejected these messages: {exc}", "messages") from None
    source = text.template.source
    has_thinking, starts_inside = detect_reasoning(source, prompt)
    if not has_thinking or prompt.rstrip().endswith("</think>"):
        thinking = "off"
    else:
        thinking = "inside" if starts_inside else "open"
    tool_format = (detect_tool_format(source) or "hermes") if offered else None
    opener = _opener(request, tool_format, thinking)
    prompt += opener
    limited = budget is not None and budget.tokens != UNLIMITED
    if thinking == "open" and not request.prefill and (limited or _forced(request, tool_format)):
        # The engine holds the block from the output's first token: it opens
        # in the prompt, as thinking templates of newer models open it.
        prompt += OPEN_BLOCK
        thinking = "inside"
    after = _after_block(request, tool_format) if thinking == "inside" else ""
    return PreparedTurn(slot, text, request, prompt, await text.encode_prompt_async(prompt),
                        tool_format, thinking, opener, budget if limited else None, after)


def _forced(request: ChatRequest, tool_format: str | None) -> bool:
    choice = request.tool_choice
    return tool_format is not None and (choice == "required" or isinstance(choice, NamedTool))


def _opener(request: ChatRequest, tool_format: str | None, thinking: str) -> str:
    """A forced call starts in the prompt: the model goes on from the wrapper
    (and the name), so the call costs what a free one does instead of the
    wrapper spelled token by token under the grammar. Not when the model may
    think first, nor after a prefill the call must follow."""
    if thinking != "off" or request.prefill:
        return ""
    return _forced_opener(request, tool_format)


def _after_block(request: ChatRequest, tool_format: str | None) -> str:
    """When the model thinks first, the engine forces the opener once the
    block closes (by the model or at its budget): the call starts there
    as it starts in the prompt otherwise."""
    return _forced_opener(request, tool_format)


def _forced_opener(request: ChatRequest, tool_format: str | None) -> str:
    if not _forced(request, tool_format):
        return ""
    assert tool_format is not None
    choice = request.tool_choice
    if isinstance(choice, NamedTool):
        return call_opener(tool_format, choice.name)
    # "required" with one tool to call names it; with several, the model names one.
    only = request.tools[0]["function"]["name"] if len(request.tools) == 1 else None
    return call_opener(tool_format, only)


def _reasoning(prepared: PreparedTurn, max_tokens: int, under_grammar: bool) -> ReasoningBudget | None:
    """What the engine holds the reasoning block to, if anything."""
    if prepared.thinking != "inside":
        return None
    tokens = prepared.budget.for_output(max_tokens) if prepared.budget is not None else UNLIMITED
    if tokens == UNLIMITED and not prepared.after_block:
        return None
    return reasoning_budget(prepared.text, tokens, under_grammar=under_grammar,
                            after=prepared.after_block)


def _grammar(prepared: PreparedTurn) -> GrammarSpec | None:
    request = prepared.request
    choice = request.tool_choice
    if prepared.tool_format is not None and _forced(request, prepared.tool_format):
        only = choice.name if isinstance(choice, NamedTool) else None
        return forced_tool_grammar(prepared.tool_format, request.tools, only=only,
                                   parallel=request.parallel_tool_calls, thinking=prepared.thinking,
                                   opener=prepared.opener)
    if request.response_format is not None:
        # It holds the whole answer (a JSON one leaves no room for a call).
        return answer_grammar(request.response_format, prepared.thinking)
    if prepared.tool_format is not None and request.strict_tools & request.tool_names:
        return strict_tools_grammar(prepared.tool_format, request.tools, strict=request.strict_tools,
                                    parallel=request.parallel_tool_calls, thinking=prepared.thinking)
    return None


def start_turn(manager: ModelManager, prepared: PreparedTurn, engine: EngineProcess,
               request_id: str) -> TurnRun:
    """Check the prompt against the loaded model and submit it."""
    slot = prepared.slot
    prompt_ids = prepared.prompt_ids
    check_context(prompt_ids, slot.max_context)
    sampling = prepared.request.sampling
    grammar = _grammar(prepared)
    if grammar is not None:
        from router.text.grammar_vocab import grammar_vocab

        engine.client.send_vocab_once(lambda: grammar_vocab(prepared.text))
    params = build_params(
        sampling,
        max_tokens=output_budget(slot.max_context, len(prompt_ids), sampling.max_tokens,
                                 manager.config.default_max_tokens),
        defaults=manager.sampling_defaults(slot),
        eos_token_ids=prepared.text.eos_token_ids,
        grammar=grammar,
        n_vocab=slot.ready.model.n_vocab if slot.ready is not None else None,
    )
    reasoning = _reasoning(prepared, params.max_tokens, grammar is not None)
    if reasoning is not None:
        params = msgspec.structs.replace(params, reasoning=reasoning)
    spec = GenerationInput(prompt_ids, params, sampling.stop, sampling.skip_special_tokens,
                           images=prepared.images)
    return TurnRun(prepared, Generation(engine.client, prepared.text, request_id, spec))


class TurnRun:
    def __init__(self, prepared: PreparedTurn, generation: Generation):
        self.prepared = prepared
        self.generation = generation
        self.tool_calls: list[ToolCallEnd] = []
        self.reasoning_text: list[str] = []
        self.content_text: list[str] = []
        request = prepared.request
        self._reasoning = (
            ReasoningParser(start_in_reasoning=prepared.thinking == "inside")
            if prepared.thinking != "off" else None
        )
        self._tools = (
            ToolCallParser(prepared.tool_format, request.tools, id_prefix=request.tool_id_prefix,
                           prefill=prepared.opener)
            if prepared.tool_format else None
        )

    async def events(self) -> AsyncIterator[ParsedEvent | PromptProgress]:
        """The turn's output as typed events; raises EngineFailure if the
        engine refuses or dies. finish_reason and usage are set at the end."""
        async for item in self.generation.stream():
            for event in self.events_of(item):
                yield event
        for event in self._flush():
            yield event
        record = current_record.get()
        if record is not None:
            record.reasoning_tokens = self.reasoning_tokens
            # Tool calls, not the engine's "stop", are how this turn ended.
            record.finish_reason = self.finish_reason

    def events_of(self, item: Piece | PromptProgress) -> Sequence[ParsedEvent | PromptProgress]:
        """The turn's events from one item of its generation (as events()
        yields them; for items sent by Generation.push_items)."""
        if isinstance(item, PromptProgress):
            return (item,)
        return self._split(item)

    def _split(self, piece: Piece) -> list[ParsedEvent]:
        if self._reasoning is None:
            return self._answer([ContentDelta(piece.text)] if piece.text else [])
        # The parser attributes the step's tokens to reasoning or answer.
        return self._answer(self._reasoning.feed(piece.text, len(piece.token_ids)))

    def _flush(self) -> list[ParsedEvent]:
        events = self._reasoning.flush() if self._reasoning is not None else []
        out = self._answer(events)
        if self._tools is not None:
            # Cut by the token limit: an open call is reported as cut, never
            # completed with invented arguments or shown as text.
            cut = self.generation.finish_reason == "length"
            out.extend(self._record(self._tools.flush(cut=cut)))
        return out

    def _answer(self, events: list[Any]) -> list[ParsedEvent]:
        """Route content through the tool-call parser; keep reasoning as is."""
        if self._tools is None:
            return self._record(events)
        out: list[ParsedEvent] = []
        for event in events:
            if isinstance(event, ContentDelta) and self._tools is not None:
                out.extend(self._record(self._tools.feed(event.text)))
            else:
                out.extend(self._record([event]))
        return out

    def _record(self, events: list[ParsedEvent]) -> list[ParsedEvent]:
        for event in events:
            if isinstance(event, ToolCallEnd):
                self.tool_calls.append(event)
            elif isinstance(event, ReasoningDelta):
                self.reasoning_text.append(event.text)
            elif isinstance(event, ContentDelta):
                self.content_text.append(event.text)
        return events

    @property
    def finish_reason(self) -> str | None:
        reason = self.generation.finish_reason
        if self.tool_calls and reason == "stop":
            return "tool_calls"
        return reason

    @property
    def reasoning_tokens(self) -> int:
        return self._reasoning.reasoning_tokens if self._reasoning is not None else 0

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_text)

    @property
    def content(self) -> str:
        return "".join(self.content_text)

    def usage(self) -> dict[str, Any]:
        """Counts in OpenAI Chat Completions' shape; other APIs rename them."""
        g = self.generation
        return {
            "prompt_tokens": g.prompt_tokens,
            "completion_tokens": g.completion_tokens,
            "total_tokens": g.prompt_tokens + g.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": g.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        }

    async def run_to_end(self) -> None:
        """Consume the whole turn (non-streamed responses)."""
        try:
            async for _ in self.events():
                pass
        finally:
            self.generation.close()
