"""An engine that streams at a real engine's pace: `python -m tests.support.paced_engine`.

For the router's streaming benchmark (tests/perf/bench_router_streaming.py):
it speaks the real protocol over the real sockets, as the scripted engine
does (it reuses that engine's commands, Ready and bookkeeping), but every
request gets max_tokens tokens whatever its prompt, and the steps keep a fixed
cadence: one StepOutputs every `step_seconds` (script.json, as for the
scripted engine) carrying one token for every running request, as a batched
decode step does. The tokens are the script's default text tokenized with the
model's own tokenizer, repeated as needed, so the router detokenizes real text.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import zmq

from protocol import EngineOptions, ErrorCode, Generate, RequestError, command_decoder
from tests.support.scripted_engine import Running, ScriptedEngine, run_engine


class PacedEngine(ScriptedEngine):
    def __init__(self, model: Path, options: EngineOptions, emit_socket: zmq.Socket):
        super().__init__(model, options, emit_socket)
        self.tokens = self.text.tokenizer.encode(self.script.default)
        if not self.tokens:
            raise ValueError("the paced engine needs a non-empty default text in script.json")
        self.started = 0

    def _start(self, request: Generate) -> None:
        if self.asleep or request.params.grammar is not None:
            self.emit(RequestError(request.request_id, ErrorCode.INVALID_REQUEST,
                                   "the paced engine only streams plain text"))
            return
        # Each request starts elsewhere in the text, so the streams differ.
        start = 31 * self.started % len(self.tokens)
        self.started += 1
        wanted = request.params.max_tokens
        repeats = -(-(start + wanted) // len(self.tokens))
        reply = (self.tokens * repeats)[start:start + wanted]
        self.running[request.request_id] = Running(request, reply)
        self.stats.prompt_tokens_total += len(request.prompt_token_ids)


def serve(engine: PacedEngine, inbox: zmq.Socket, parent_pid: int) -> int:
    """Commands as they come; a step every step_seconds while requests run.
    A late step is not made up for with a burst: the cadence restarts."""
    decode = command_decoder().decode
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    step = engine.script.step_seconds
    next_step = time.monotonic()
    while True:
        if parent_pid and os.getppid() != parent_pid:
            return 1
        wait = max(0.0, next_step - time.monotonic()) if engine.running else 0.5
        if poller.poll(int(wait * 1000)):
            while inbox.poll(0):
                if not engine.handle(decode(inbox.recv())):
                    return 0
        now = time.monotonic()
        if not engine.running:
            next_step = now
        elif now >= next_step:
            engine.tick()
            next_step = max(next_step + step, now)
        elif next_step - now < 0.001:
            # poll() counts whole milliseconds; sleep the last fraction.
            time.sleep(next_step - now)


def main() -> int:
    return run_engine(PacedEngine, "tests.support.paced_engine", serve)


if __name__ == "__main__":
    raise SystemExit(main())
