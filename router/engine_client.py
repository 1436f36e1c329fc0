"""The router's end of one engine's sockets.

The router binds two ipc:// sockets per engine (PUSH for commands, PULL for
events) before starting the process, so nothing is lost however the start-up
races. One reader task decodes events and routes each request's outputs to its
own queue; the busy loop on the other side sends one StepOutputs per step.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import zmq
import zmq.asyncio

from protocol import (
    Abort,
    Awake,
    EngineDead,
    EngineStats,
    Generate,
    GrammarVocab,
    ImageInput,
    LoadProgress,
    Ready,
    RequestError,
    RequestOutput,
    SamplingParams,
    Shutdown,
    Sleep,
    Slept,
    SlotCommand,
    SlotReply,
    StepOutputs,
    Wake,
    encoder,
    event_decoder,
)

log = logging.getLogger(__name__)


class EngineFailure(Exception):
    """The engine died or refused a request; `code` says which."""

    def __init__(self, message: str, code: str = "engine_failed"):
        super().__init__(message)
        self.code = code


class RequestStream:
    """Outputs of one request, in order, ending at its finish reason.

    The engine's reader appends each step's output; the one consumer takes
    everything that arrived since it last looked (take), so a consumer that
    fell behind catches up in one pass instead of one wake-up per step.

    A consumer may also have a listener take outputs in the reader's pass
    (listen): while it waits with nothing queued, each output goes to the
    listener, which handles it at once or declines it (then it is queued as
    usual). Outputs stay in order either way, and the wait ends when an output
    the listener took finishes the request."""

    def __init__(self, client: EngineClient, request_id: str):
        self._client = client
        self.request_id = request_id
        self._items: deque[RequestOutput | EngineFailure] = deque()
        # The consumer's wait for the next item, while it waits.
        self._waiter: asyncio.Future[None] | None = None
        self._listener: Callable[[RequestOutput], bool] | None = None
        self.finished = False
        self._aborted = False

    def listen(self, listener: Callable[[RequestOutput], bool] | None) -> None:
        """listener(output) -> whether it handled the output (else it is queued)."""
        self._listener = listener

    def _put(self, item: RequestOutput | EngineFailure) -> None:
        listener, waiter = self._listener, self._waiter
        if (listener is not None and waiter is not None and not waiter.done() and not self._items
                and type(item) is RequestOutput and listener(item)):
            if item.finish_reason is not None and not self.finished:
                self._finish()
            if self.finished:
                self._wake()
            return
        self._items.append(item)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def has_output(self) -> bool:
        """Whether something arrived that take() would return without waiting."""
        return bool(self._items)

    async def take(self) -> list[RequestOutput]:
        """Every output that arrived and was not taken yet (waiting for one
        if none has), up to and including the one with a finish reason; []
        once finished or aborted. Raises the EngineFailure that ended the
        request, after handing over the outputs that came before it."""
        items = self._items
        while not items:
            if self.finished:
                return []
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.finished:
            return []  # aborted while outputs were on their way
        outputs: list[RequestOutput] = []
        while items:
            item = items[0]
            if isinstance(item, EngineFailure):
                if outputs:
                    return outputs  # the failure ends the next take
                items.popleft()
                self._finish()
                raise item
            items.popleft()
            outputs.append(item)
            if item.finish_reason is not None:
                self._finish()
                break
        return outputs

    def _finish(self) -> None:
        self.finished = True
        self._listener = None
        self._client._forget(self.request_id)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            outputs = await self.take()
            if not outputs:
                return
            for output in outputs:
                yield output
                if self._aborted:
                    return

    def abort(self) -> None:
        """Ask the engine to stop this request; safe to call more than once."""
        self._aborted = True
        self._listener = None
        if not self.finished:
            self.finished = True
            self._client.abort([self.request_id])
        self._wake()  # a wait for more ends (the listener may have aborted)


class EngineClient:
    def __init__(self, run_dir: Path, name: str):
        self._context = zmq.asyncio.Context.instance()
        self.input_address = f"ipc://{run_dir}/{name}-in"
        self.output_address = f"ipc://{run_dir}/{name}-out"
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.bind(self.input_address)
        self._events = self._context.socket(zmq.PULL)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.bind(self.output_address)
        self._encode = encoder().encode
        self._streams: dict[str, RequestStream] = {}
        self.stats = EngineStats()
        self.ready: asyncio.Future[Ready] = asyncio.get_running_loop().create_future()
        self.dead: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.on_progress: Callable[[LoadProgress], None] | None = None
        # The Sleep or Wake command waiting for its answer, if any.
        self._transition: asyncio.Future[Slept | Awake] | None = None
        self._vocab_sent = False
        self._slot_replies: dict[str, asyncio.Future[SlotReply]] = {}
        self._reader = asyncio.create_task(self._read_events(), name=f"engine-events-{name}")

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               id_slot: int = -1, *, images: Sequence[ImageInput] = ()) -> RequestStream:
        if self.dead.done():
            raise EngineFailure(f"the engine is not running: {self.dead.result()}")
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        self._send(Generate(request_id, prompt_token_ids, params, id_slot, list(images)))
        return stream

    async def slot_action(self, command: SlotCommand) -> SlotReply:
        """Send a /slots action and wait for its reply (an action on a busy
        lane is answered once the lane is free)."""
        if self.dead.done():
            raise EngineFailure(f"the engine is not running: {self.dead.result()}")
        reply = self._slot_replies[command.action_id] = asyncio.get_running_loop().create_future()
        self._send(command)
        try:
            done, _ = await asyncio.wait({reply, self.dead}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._slot_replies.pop(command.action_id, None)
        if reply not in done:
            raise EngineFailure(f"the engine failed: {self.dead.result()}")
        return reply.result()

    def send_vocab_once(self, vocab: Callable[[], GrammarVocab]) -> None:
        """Give the engine the tokenizer vocabulary its grammars need, once,
        before the first request with a grammar (commands keep their order)."""
        if not self._vocab_sent:
            self._send(vocab())
            self._vocab_sent = True

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._streams.pop(request_id, None)
        if not self.dead.done():
            self._send(Abort(request_ids))

    async def sleep(self, weights: str) -> Slept:
        """Ask the (idle) engine to release its device memory."""
        reply = await self._transit(Sleep(weights))  # type: ignore[arg-type]
        assert isinstance(reply, Slept)
        return reply

    async def wake(self) -> Awake:
        reply = await self._transit(Wake())
        assert isinstance(reply, Awake)
        return reply

    async def _transit(self, command: Sleep | Wake) -> Slept | Awake:
        if self.dead.done():
            raise EngineFailure(f"the engine is not running: {self.dead.result()}")
        loop = asyncio.get_running_loop()
        self._transition = reply = loop.create_future()
        self._send(command)
        done, _ = await asyncio.wait({reply, self.dead}, return_when=asyncio.FIRST_COMPLETED)
        self._transition = None
        if reply not in done:
            reply.cancel()
            raise EngineFailure(f"the engine failed: {self.dead.result()}")
        return reply.result()

    def shutdown(self) -> None:
        if not self.dead.done():
            self._send(Shutdown())

    def _send(self, message: Generate | Abort | GrammarVocab | Sleep | Wake | Shutdown
              | SlotCommand) -> None:
        # The engine reads continuously, so the send completes at once; the
        # returned future needs no waiting (and abort() runs in finally blocks
        # of cancelled handlers, where waiting is not an option).
        self._commands.send(self._encode(message), copy=False)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def _read_events(self) -> None:
        decode = event_decoder().decode
        while True:
            frame = await self._events.recv(copy=False)
            event = decode(frame.buffer)
            if isinstance(event, StepOutputs):
                self.stats = event.stats
                for output in event.outputs:
                    stream = self._streams.get(output.request_id)
                    if stream is not None:
                        stream._put(output)
            elif isinstance(event, RequestError):
                stream = self._streams.pop(event.request_id, None)
                if stream is not None:
                    stream._put(EngineFailure(event.message, code=str(event.code)))
            elif isinstance(event, LoadProgress):
                if self.on_progress is not None:
                    self.on_progress(event)
            elif isinstance(event, Ready):
                if not self.ready.done():
                    self.ready.set_result(event)
            elif isinstance(event, SlotReply):
                waiter = self._slot_replies.get(event.action_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(event)
            elif isinstance(event, (Slept, Awake)):
                if self._transition is not None and not self._transition.done():
                    self._transition.set_result(event)
            elif isinstance(event, EngineDead):
                log.error("engine reported failure: %s\n%s", event.message, event.traceback)
                self.fail_all(event.message)
                return

    def end_all(self, reason: str, code: str = "engine_failed") -> None:
        """The router gives up on every open request (an unload, or shutdown
        past its grace): the engine is told to abort them, each stream ends
        with an error (`code`), and the engine stays up for the Shutdown that
        follows."""
        streams, self._streams = self._streams, {}
        if streams and not self.dead.done():
            self._send(Abort(list(streams)))
        for stream in streams.values():
            stream._put(EngineFailure(reason, code=code))

    def fail_all(self, reason: str) -> None:
        """The engine is gone: end every open request with an error."""
        if not self.dead.done():
            self.dead.set_result(reason)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._put(EngineFailure(f"the engine failed: {reason}"))

    def close(self) -> None:
        self._reader.cancel()
        self._commands.close()
        self._events.close()
