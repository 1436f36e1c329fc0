"""Stop strings under speculative decoding: one engine output may carry
several tokens (a verify step's accepted drafts), and a stop string met in
the middle of them still ends the request at the string."""

from __future__ import annotations

import asyncio

import pytest

from protocol import RequestOutput
from router.text import ModelText
from tests.router.test_request_stream import Pushed, start, texts


def test_a_stop_string_inside_one_multi_token_output_ends_the_text_there(
        qwen3_text: ModelText) -> None:
    before = qwen3_text.tokenizer.encode(" go on")
    rest = qwen3_text.tokenizer.encode(" STOP never shown")

    async def main() -> None:
        pushed = Pushed()
        client, generation, items = start(qwen3_text, pushed, stop=("STOP",))
        consumer = asyncio.ensure_future(items.__anext__())
        await asyncio.sleep(0)
        stream = client.streams["r"]
        stream._put(RequestOutput("r", before[:1], None, 3, 0))
        # One verify step: the sampled token, accepted drafts and the free one.
        stream._put(RequestOutput("r", before[1:] + rest, None, 3, 0,
                                  num_draft_tokens=len(before) + len(rest) - 2,
                                  num_draft_accepted=len(before) + len(rest) - 2))
        with pytest.raises(StopAsyncIteration):
            await consumer
        assert texts(pushed.items) == " go on "
        assert generation.finish_reason == "stop" and generation.stop_string == "STOP"
        assert client.aborted == ["r"]
        # Counted up to the token that completed the stop string, not past it.
        upto = next(j for j in range(1, len(rest) + 1)
                    if "STOP" in qwen3_text.tokenizer.decode(before + rest[:j]))
        assert upto < len(rest)
        assert generation.completion_tokens == len(before) + upto
        assert generation.token_ids == before + rest[:upto]

    asyncio.run(main())
