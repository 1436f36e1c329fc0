"""Several choices of one request against a stand-in engine: siblings wait
for the first's prompt, a failure or a departure ends them all, and streamed
chunks carry every token's logprobs once, in order."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from protocol import RequestOutput, SamplingParams, TokenLogprobs
from router.cli import CommandLineError, parse_serve_command
from router.engine_client import EngineFailure, RequestStream
from router.generation import Generation, GenerationInput, Piece
from router.openai.choices import Sibling, run_siblings, sibling_seed
from router.openai.completion_choice import ChunkHead, CompletionChoice, PromptInput
from router.openai.logprobs import TokenTexts
from router.text.model_text import ModelText
from router.text.token_pieces import pieces_for

EOS = 2
PROMPT = [504, 3575, 282]


class StandInEngine:
    """The engine client's side of requests: streams fed by the test."""

    def __init__(self) -> None:
        self.streams: dict[str, RequestStream] = {}
        self.submitted: list[str] = []
        self.aborted: list[str] = []

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
               id_slot: int = -1) -> RequestStream:
        stream = self.streams[request_id] = RequestStream(self, request_id)  # type: ignore[arg-type]
        self.submitted.append(request_id)
        return stream

    def _forget(self, request_id: str) -> None:
        pass

    def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)

    def send(self, request_id: str, item: RequestOutput | EngineFailure) -> None:
        self.streams[request_id]._put(item)


def generation(engine: StandInEngine, text: ModelText, request_id: str, *,
               stop: tuple[str, ...] = ()) -> Generation:
    params = SamplingParams(max_tokens=8, stop_token_ids=[EOS], logprobs=1, prompt_logprobs=0)
    model_text: Any = SimpleNamespace(tokenizer=text.tokenizer, eos_token_ids=(EOS,))
    return Generation(engine, model_text, request_id, GenerationInput(PROMPT, params, stop))  # type: ignore[arg-type]


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def siblings(generations: list[Generation]) -> list[Sibling]:
    async def collect(g: Generation) -> None:
        await g.collect()

    return [Sibling(g, lambda g=g: collect(g)) for g in generations]  # type: ignore[misc]


def test_siblings_wait_for_the_first_prompt(smollm2_text: ModelText) -> None:
    async def scenario() -> None:
        engine = StandInEngine()
        group = [generation(engine, smollm2_text, f"r-{i}") for i in range(3)]
        other = generation(engine, smollm2_text, "s-0")
        run = asyncio.create_task(run_siblings([siblings(group), siblings([other])]))
        await settle()
        # Each prompt's first choice at once, the others not yet.
        assert engine.submitted == ["r-0", "s-0"]
        engine.send("r-0", RequestOutput("r-0", [], num_computed_tokens=2))
        await settle()
        assert engine.submitted == ["r-0", "s-0"]  # still prefilling
        engine.send("r-0", RequestOutput("r-0", [7], logprobs=[TokenLogprobs(-1.0)]))
        await settle()
        assert engine.submitted == ["r-0", "s-0", "r-1", "r-2"]
        for request_id in engine.submitted:
            engine.send(request_id, RequestOutput(request_id, [EOS], "stop",
                                                  logprobs=[TokenLogprobs(-0.1)]))
        await run
        assert engine.aborted == []
        assert all(g.finish_reason == "stop" for g in [*group, other])

    asyncio.run(scenario())


def test_a_failing_sibling_ends_the_others(smollm2_text: ModelText) -> None:
    async def scenario() -> None:
        engine = StandInEngine()
        group = [generation(engine, smollm2_text, f"r-{i}") for i in range(3)]
        run = asyncio.create_task(run_siblings([siblings(group)]))
        await settle()
        engine.send("r-0", RequestOutput("r-0", [7], logprobs=[TokenLogprobs(-1.0)]))
        await settle()
        engine.send("r-1", EngineFailure("out of pages", "invalid_request"))
        with pytest.raises(EngineFailure, match="out of pages"):
            await run
        assert sorted(engine.aborted) == ["r-0", "r-2"]

    asyncio.run(scenario())


def test_a_client_that_leaves_aborts_every_sibling(smollm2_text: ModelText) -> None:
    async def scenario() -> None:
        engine = StandInEngine()
        group = [generation(engine, smollm2_text, f"r-{i}") for i in range(2)]
        run = asyncio.create_task(run_siblings([siblings(group)]))
        await settle()
        engine.send("r-0", RequestOutput("r-0", [7], logprobs=[TokenLogprobs(-1.0)]))
        await settle()
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        assert sorted(engine.aborted) == ["r-0", "r-1"]

    asyncio.run(scenario())


def test_sibling_seeds() -> None:
    assert [sibling_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert sibling_seed(2**64 - 1, 2) == 1


def chunks(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in data.split(b"\n\n") if line.startswith(b"data: ")]


def test_streamed_chunks_carry_each_tokens_logprobs_once(smollm2_text: ModelText) -> None:
    """Text held back (a part of a character, a possible stop string) brings
    its tokens' entries with it; the echo waits for the prompt's scores."""
    tokenizer = smollm2_text.tokenizer
    llama = tokenizer.encode("🦙")
    hello = tokenizer.encode("Hello!")[0]
    there = tokenizer.encode(" there")[0]
    steps = [[t] for t in [*llama, hello, there]] + [[EOS]]

    async def scenario() -> list[dict[str, Any]]:
        engine = StandInEngine()
        g = generation(engine, smollm2_text, "r-0", stop=("Hello!",))
        texts = TokenTexts(pieces_for(tokenizer))
        choice = CompletionChoice(g, PromptInput(PROMPT, "The capital of"), index=0, scorer=g,
                                  echo=True, texts=texts, head=ChunkHead("r-0", 1, "m", False))
        assert choice.opening() == b""
        data = []

        async def consume() -> None:
            async for item in g.stream():
                if isinstance(item, Piece):
                    data.append(choice.piece_data(item))
            data.append(choice.finish_data())

        task = asyncio.create_task(consume())
        await settle()
        engine.send("r-0", RequestOutput("r-0", [], prompt_logprobs=[TokenLogprobs(-3.0),
                                                                     TokenLogprobs(-4.0)]))
        for index, ids in enumerate(steps):
            finish = "stop" if ids == [EOS] else None
            engine.send("r-0", RequestOutput("r-0", ids, finish, logprobs=[TokenLogprobs(-index - 0.5)]))
        await task
        return chunks(b"".join(data))

    sent = asyncio.run(scenario())
    echo, *rest = sent
    assert echo["choices"][0]["text"] == "The capital of"
    assert echo["choices"][0]["logprobs"]["token_logprobs"] == [None, -3.0, -4.0]
    assert [c["choices"][0]["text"] for c in rest] == ["🦙", "Hello there", ""]
    logprobs = [c["choices"][0]["logprobs"] for c in rest]
    # Every shown token once, in order (the hidden stop token not at all).
    assert [v for part in logprobs if part for v in part["token_logprobs"]] == \
        [-0.5, -1.5, -2.5, -3.5, -4.5]
    assert [part["text_offset"] for part in logprobs[:2]] == [[14, 14, 14], [15, 20]]
    assert logprobs[2] is None and rest[-1]["choices"][0]["finish_reason"] == "stop"


def test_max_choices_option() -> None:
    def parse(*args: str) -> Any:
        return parse_serve_command(["serve", "--models-dir", "/m", *args])

    assert parse().max_choices == 16
    assert parse("--max-choices", "4").max_choices == 4
    with pytest.raises(CommandLineError, match="--max-choices"):
        parse("--max-choices", "0")
