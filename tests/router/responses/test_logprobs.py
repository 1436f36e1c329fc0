"""Which tokens an output_text's logprobs list, through the real Qwen3 template,
reasoning parser and tool-call parser: the tokens of its text, never those of
the reasoning or of a call, and the stream's deltas add up to the part."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from protocol import RequestOutput, SamplingParams, TokenLogprobs
from router.chat.request import ChatRequest
from router.chat.turn import PreparedTurn, TurnRun
from router.generation import Generation, GenerationInput
from router.responses.logprobs import OutputLogprobs
from router.responses.output import OutputAssembler
from router.responses.tools import tool_set
from router.text.model_text import ModelText

TOOL = {"type": "function", "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
REPLY = ("<think>\nIt may rain.\n</think>\n\nLet me check.\n<tool_call>\n"
         '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n\nDone, sunny.')


class ScriptedStream:
    def __init__(self, outputs: list[RequestOutput]):
        self.outputs = outputs
        self.has_output = False

    async def take(self) -> list[RequestOutput]:
        return [self.outputs.pop(0)] if self.outputs else []

    def listen(self, listener: Any) -> None:
        pass

    def abort(self) -> None:
        pass


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer_dir: Path) -> ModelText:
    return ModelText.load(qwen3_tokenizer_dir)


def answer(text: ModelText, reply: str, *, logprobs: bool = True, thinking: bool = True):  # type: ignore[no-untyped-def]
    """Items and events of a turn whose model writes `reply`, one token per
    step, each token's logprob -(its position + 1) and one alternative."""
    tools = tool_set([TOOL])
    request = ChatRequest([{"role": "user", "content": "Weather in Paris?"}],
                          tools=tools.chat_tools, enable_thinking=None if thinking else False)
    # The turn as prepare_turn makes it, with the template's own prompt.
    prompt = text.render_chat(request.messages, tools=request.tools,
                              **({} if thinking else {"enable_thinking": False}))
    prepared = PreparedTurn(slot=None, text=text, request=request, prompt=prompt,  # type: ignore[arg-type]
                            prompt_ids=text.encode_prompt(prompt), tool_format="hermes",
                            thinking="open" if thinking else "off")
    eos = text.eos_token_ids[0]
    tokens = [*text.tokenizer.encode(reply), eos]
    outputs = [RequestOutput("r", [token], "stop" if token == eos else None,
                             logprobs=[TokenLogprobs(-(i + 1.0), [7], [-0.5])])
               for i, token in enumerate(tokens)]
    client: Any = SimpleNamespace(submit=lambda *args: ScriptedStream(outputs))
    params = SamplingParams(max_tokens=200, stop_token_ids=[eos], logprobs=1)
    run = TurnRun(prepared, Generation(client, text, "r", GenerationInput(prepared.prompt_ids, params)))
    assembler = OutputAssembler(tools, OutputLogprobs(run) if logprobs else None)

    async def events() -> list[dict[str, Any]]:
        out = [e async for event in run.events() for e in assembler.feed(event)]  # type: ignore[arg-type]
        return out + assembler.finish(incomplete=False)

    return assembler.items, asyncio.run(events()), tokens


def test_only_the_text_tokens_are_listed(qwen3: ModelText) -> None:
    items, events, tokens = answer(qwen3, REPLY)
    assert [item["type"] for item in items] == ["reasoning", "message", "function_call", "message"]
    assert "logprobs" not in items[0]["content"][0]
    for message in (items[1], items[3]):
        (part,) = message["content"]
        # The listed tokens spell the message's text (the last one's newline
        # went to the call after it), each with the value of its own position.
        assert "".join(entry["token"] for entry in part["logprobs"]).rstrip() == part["text"]
        for entry in part["logprobs"]:
            position = -int(entry["logprob"]) - 1
            assert qwen3.tokenizer.decode([tokens[position]]) == entry["token"]
            assert bytes(entry["bytes"]) == entry["token"].encode()
            assert entry["top_logprobs"] == [{"token": qwen3.tokenizer.decode([7]),
                                              "bytes": list(qwen3.tokenizer.decode([7]).encode()),
                                              "logprob": -0.5}]
    assert items[1]["content"][0]["text"] == "Let me check."
    assert items[3]["content"][0]["text"] == "Done, sunny."
    # The first listed tokens follow the newlines after </think> and after the call.
    for message, before in ((items[1], "</think>\n\n"), (items[3], "</tool_call>\n\n")):
        first = -int(message["content"][0]["logprobs"][0]["logprob"]) - 1
        assert qwen3.tokenizer.decode(tokens[:first]).endswith(before)
    # Deltas carry their own tokens (without bytes); done carries them all.
    for message in (items[1], items[3]):
        shaped = [{key: value for key, value in entry.items() if key != "bytes"}
                  for entry in message["content"][0]["logprobs"]]
        for entry in shaped:
            entry["top_logprobs"] = [{"token": t["token"], "logprob": t["logprob"]}
                                     for t in entry["top_logprobs"]]
        deltas = [e for e in events if e["type"] == "response.output_text.delta"
                  and e["item_id"] == message["id"]]
        assert [entry for delta in deltas for entry in delta["logprobs"]] == shaped
        (done,) = [e for e in events if e["type"] == "response.output_text.done"
                   and e["item_id"] == message["id"]]
        assert done["logprobs"] == shaped


def test_without_the_include_the_lists_are_empty(qwen3: ModelText) -> None:
    items, events, _ = answer(qwen3, REPLY, logprobs=False)
    assert items[1]["content"][0]["logprobs"] == [] and items[3]["content"][0]["logprobs"] == []
    assert all(e["logprobs"] == [] for e in events if e["type"].startswith("response.output_text."))


def test_thinking_off_lists_every_text_token(qwen3: ModelText) -> None:
    items, _, tokens = answer(qwen3, "Plain answer, no call.", thinking=False)
    (message,) = items
    entries = message["content"][0]["logprobs"]
    assert len(entries) == len(tokens) - 1  # all but the end-of-sequence token
    assert "".join(entry["token"] for entry in entries) == "Plain answer, no call."
