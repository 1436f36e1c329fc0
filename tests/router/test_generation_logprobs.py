"""A generation's log probabilities: each piece carries those of its shown
tokens, a hidden stop token's is dropped, and prompt scores are gathered."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from protocol import RequestOutput, SamplingParams, TokenLogprobs
from router.generation import Generation, GenerationInput, Piece
from router.text.model_text import ModelText

EOS = 2


class ScriptedStream:
    """Hands out the outputs given, one batch per take()."""

    def __init__(self, batches: list[list[RequestOutput]]):
        self.batches = batches
        self.has_output = False

    async def take(self) -> list[RequestOutput]:
        return self.batches.pop(0) if self.batches else []

    def listen(self, listener: Any) -> None:
        pass

    def abort(self) -> None:
        pass


def run(text: ModelText, batches: list[list[RequestOutput]]) -> tuple[Generation, list[Piece]]:
    client: Any = SimpleNamespace(submit=lambda *args: ScriptedStream(batches))
    params = SamplingParams(max_tokens=8, stop_token_ids=[EOS], logprobs=1, prompt_logprobs=0)
    generation = Generation(client, text, "cmpl-1", GenerationInput([1, 5, 6], params))

    async def pieces() -> list[Piece]:
        return [item async for item in generation.stream() if isinstance(item, Piece)]

    return generation, asyncio.run(pieces())


def test_pieces_carry_their_tokens_logprobs(smollm2_text: ModelText) -> None:
    text: Any = SimpleNamespace(tokenizer=smollm2_text.tokenizer, eos_token_ids=(EOS,))
    hello, world = smollm2_text.tokenizer.encode("Hello world")
    first = TokenLogprobs(-0.5, [hello], [-0.5])
    second = TokenLogprobs(-1.5, [7], [-0.2])
    stop = TokenLogprobs(-0.1, [EOS], [-0.1])
    prompt = [TokenLogprobs(-3.0), TokenLogprobs(-4.0)]
    generation, pieces = run(text, [
        [RequestOutput("cmpl-1", [], prompt_logprobs=prompt)],
        [RequestOutput("cmpl-1", [hello], logprobs=[first])],
        [RequestOutput("cmpl-1", [world, EOS], "stop", logprobs=[second, stop])],
    ])
    assert [list(piece.logprobs) for piece in pieces] == [[first], [second]]
    assert generation.logprobs == [first, second]
    assert generation.prompt_logprobs == prompt
    assert generation.stop_token == EOS
