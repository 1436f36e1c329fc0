"""One request's outputs as the router's handlers take them: in batches of
what arrived, in order, ending at the finish reason or the engine's failure;
and the generation built on them, which says when its next item is at hand."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from protocol import RequestOutput, SamplingParams
from router.engine_client import EngineFailure, RequestStream
from router.generation import Generation, GenerationInput, Piece, PromptProgress
from router.observability.records import RequestRecord, current_record
from router.text import ModelText


class FakeClient:
    """What a RequestStream needs of its EngineClient."""

    def __init__(self) -> None:
        self.streams: dict[str, RequestStream] = {}
        self.aborted: list[str] = []

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               id_slot: int = -1) -> RequestStream:
        stream = self.streams[request_id] = RequestStream(self, request_id)  # type: ignore[arg-type]
        return stream

    def _forget(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            self.streams.pop(request_id, None)


def output(ids: list[int], finish: str | None = None) -> RequestOutput:
    return RequestOutput("r", ids, finish, 3, 0)  # type: ignore[arg-type]


def test_take_hands_over_everything_that_arrived_up_to_the_finish() -> None:
    async def main() -> None:
        client = FakeClient()
        stream = client.submit("r", [1], SamplingParams(max_tokens=8))
        first, second, last = output([5]), output([6]), output([7], "length")
        for item in (first, second, last):
            stream._put(item)
        assert stream.has_output
        assert await stream.take() == [first, second, last]
        assert stream.finished and "r" not in client.streams
        assert await stream.take() == []
        stream.abort()  # finished: nothing to tell the engine
        assert client.aborted == []

    asyncio.run(main())


def test_take_waits_for_the_next_output() -> None:
    async def main() -> None:
        stream = FakeClient().submit("r", [1], SamplingParams(max_tokens=8))
        taking = asyncio.ensure_future(stream.take())
        await asyncio.sleep(0)
        assert not taking.done() and not stream.has_output
        stream._put(output([5]))
        assert await taking == [output([5])]

    asyncio.run(main())


def test_a_failure_comes_after_the_outputs_before_it() -> None:
    async def main() -> None:
        client = FakeClient()
        stream = client.submit("r", [1], SamplingParams(max_tokens=8))
        stream._put(output([5]))
        stream._put(EngineFailure("gone", code="engine_failed"))
        assert await stream.take() == [output([5])]
        with pytest.raises(EngineFailure, match="gone"):
            await stream.take()
        assert stream.finished and "r" not in client.streams

    asyncio.run(main())


def test_an_aborted_stream_takes_nothing_more() -> None:
    async def main() -> None:
        client = FakeClient()
        stream = client.submit("r", [1], SamplingParams(max_tokens=8))
        stream._put(output([5]))
        stream._put(output([6]))
        seen = []
        async for item in stream:
            seen.append(item)
            stream.abort()
        assert seen == [output([5])]
        assert client.aborted == ["r"]
        assert await stream.take() == []

    asyncio.run(main())


def test_iterating_a_stream_yields_each_output_once() -> None:
    async def main() -> None:
        stream = FakeClient().submit("r", [1], SamplingParams(max_tokens=8))
        items = [output([i]) for i in range(5)] + [output([9], "stop")]
        for item in items[:3]:
            stream._put(item)

        async def later() -> None:
            await asyncio.sleep(0.01)
            for item in items[3:]:
                stream._put(item)

        feeding = asyncio.ensure_future(later())
        assert [item async for item in stream] == items
        await feeding

    asyncio.run(main())


def test_a_generation_says_when_its_next_item_is_at_hand(qwen3_text: ModelText) -> None:
    """output_waiting: true while outputs that arrived are still to come out,
    false once the generation would wait for the engine, or has finished."""
    tokenizer = qwen3_text.tokenizer
    ids = tokenizer.encode(" one two three four")

    async def main() -> None:
        client = FakeClient()
        spec: Any = GenerationInput([1, 2, 3], SamplingParams(max_tokens=len(ids), ignore_eos=True))
        generation = Generation(client, qwen3_text, "r", spec)  # type: ignore[arg-type]
        items = generation.stream()
        first = asyncio.ensure_future(items.__anext__())
        await asyncio.sleep(0)
        stream = client.streams["r"]
        stream._put(output(ids[:1]))
        stream._put(output(ids[1:2]))
        waiting = []
        pieces = [await first]
        waiting.append(generation.output_waiting)
        pieces.append(await items.__anext__())
        waiting.append(generation.output_waiting)
        stream._put(output(ids[2:3]))
        waiting.append(generation.output_waiting)
        pieces.append(await items.__anext__())
        stream._put(output(ids[3:], "length"))
        pieces.append(await items.__anext__())
        waiting.append(generation.output_waiting)
        assert waiting == [True, False, True, False]
        assert all(isinstance(piece, Piece) for piece in pieces)
        assert "".join(piece.text for piece in pieces) == " one two three four"  # type: ignore[union-attr]
        assert generation.finish_reason == "length"
        with pytest.raises(StopAsyncIteration):
            await items.__anext__()

    asyncio.run(main())


class Pushed:
    """A consumer of Generation.push_items: takes items while `ready`."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.ready = True
        self.items: list[Piece | PromptProgress] = []
        self.fail_on = fail_on

    def send(self, item: Piece | PromptProgress) -> None:
        if self.fail_on is not None and isinstance(item, Piece) and self.fail_on in item.text:
            raise ConnectionResetError("the client left")
        self.items.append(item)


def start(qwen3_text: ModelText, pushed: Pushed, stop: tuple[str, ...] = (),
          ) -> tuple[FakeClient, Generation, Any]:
    client = FakeClient()
    spec: Any = GenerationInput([1, 2, 3], SamplingParams(max_tokens=64, ignore_eos=True), stop)
    generation = Generation(client, qwen3_text, "r", spec)  # type: ignore[arg-type]
    generation.push_items(lambda: pushed.ready, pushed.send)
    return client, generation, generation.stream()


def texts(items: list[Any]) -> str:
    return "".join(item.text for item in items if isinstance(item, Piece))


def test_pushed_items_are_sent_in_the_readers_pass_and_the_end_ends_the_stream(
        qwen3_text: ModelText) -> None:
    ids = qwen3_text.tokenizer.encode(" one two three")
    record = RequestRecord(model="m")

    async def main() -> None:
        current_record.set(record)
        pushed = Pushed()
        client, generation, items = start(qwen3_text, pushed)
        consumer = asyncio.ensure_future(items.__anext__())
        await asyncio.sleep(0)  # the consumer waits for its first item
        stream = client.streams["r"]
        stream._put(RequestOutput("r", [], None, 3, 0, 2))  # prompt progress
        for token in ids[:-1]:
            stream._put(output([token]))
            assert not stream.has_output and not consumer.done()
        stream._put(output(ids[-1:], "length"))
        with pytest.raises(StopAsyncIteration):
            await consumer
        assert isinstance(pushed.items[0], PromptProgress)
        assert texts(pushed.items) == " one two three"
        assert generation.finish_reason == "length" and "r" not in client.streams

    asyncio.run(main())
    assert record.finish_reason == "length" and record.completion_tokens == len(ids)


def test_outputs_queue_while_the_consumer_is_busy_or_not_ready(qwen3_text: ModelText) -> None:
    """Items come out once each and in order, sent or yielded."""
    ids = qwen3_text.tokenizer.encode(" a b c d e f")

    async def main() -> None:
        pushed = Pushed()
        client, _generation, items = start(qwen3_text, pushed)
        consumer = asyncio.ensure_future(items.__anext__())
        await asyncio.sleep(0)
        stream = client.streams["r"]
        stream._put(output(ids[:1]))  # pushed
        pushed.ready = False
        stream._put(output(ids[1:2]))  # not ready: queued, and the consumer wakes
        pushed.ready = True
        stream._put(output(ids[2:3]))  # queued behind it, not pushed past it
        yielded = [await consumer]
        # The consumer is busy with its item: the next output queues too.
        stream._put(output(ids[3:4]))
        yielded.append(await items.__anext__())
        yielded.append(await items.__anext__())
        consumer = asyncio.ensure_future(items.__anext__())
        await asyncio.sleep(0)  # waiting again: pushing resumes
        stream._put(output(ids[4:5]))
        stream._put(output(ids[5:], "stop"))
        with pytest.raises(StopAsyncIteration):
            await consumer
        assert texts(pushed.items[:1]) + texts(yielded) + texts(pushed.items[1:]) == " a b c d e f"
        assert len(pushed.items) == 3 and len(yielded) == 3

    asyncio.run(main())


def test_a_stop_string_met_in_the_readers_pass_aborts_and_ends(qwen3_text: ModelText) -> None:
    ids = qwen3_text.tokenizer.encode(" go on STOP never")

    async def main() -> None:
        pushed = Pushed()
        client, generation, items = start(qwen3_text, pushed, stop=("STOP",))
        consumer = asyncio.ensure_future(items.__anext__())
        await asyncio.sleep(0)
        stream = client.streams["r"]
        for token in ids:
            stream._put(output([token]))
        with pytest.raises(StopAsyncIteration):
            await consumer
        assert texts(pushed.items) == " go on "
        assert generation.stop_string == "STOP" and client.aborted == ["r"]

    asyncio.run(main())


def test_what_sending_raises_the_consumer_raises(qwen3_text: ModelText) -> None:
    ids = qwen3_text.tokenizer.encode(" fine broken")

    async def main() -> None:
        pushed = Pushed(fail_on="broken")
        client, generation, items = start(qwen3_text, pushed)
        consumer = asyncio.ensure_future(items.__anext__())
        await asyncio.sleep(0)
        stream = client.streams["r"]
        for token in ids:
            stream._put(output([token]))
        stream._put(output([11]))  # after the failure: queued, never made
        with pytest.raises(ConnectionResetError):
            await consumer
        assert texts(pushed.items) == " fine"
        assert generation.completion_tokens == len(ids)

    asyncio.run(main())


def test_an_engine_failure_reaches_a_pushing_consumer(qwen3_text: ModelText) -> None:
    async def main() -> None:
        pushed = Pushed()
        client, _generation, items = start(qwen3_text, pushed)
        consumer = asyncio.ensure_future(items.__anext__())
        await asyncio.sleep(0)
        stream = client.streams["r"]
        stream._put(output([5]))
        stream._put(EngineFailure("the engine died"))
        with pytest.raises(EngineFailure, match="died"):
            await consumer
        assert len(pushed.items) == 1

    asyncio.run(main())
