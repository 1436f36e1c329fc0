"""A scripted engine for protocol tests: `python -m tests.support.scripted_engine`.

It speaks the real router<->engine protocol over the real sockets (the router
starts it in place of `python -m engine` when ROUNDHOUSE_ENGINE_MODULE names
this module), but instead of running a model it answers from a script, so the
tests can drive a real server, real SDKs and real parsers to known output:
tool calls, reasoning, long text.

The model directory is a normal Hugging Face directory (tokenizer, template,
config.json) plus `script.json`:

    {"rules": [{"when": "weather", "reply": "<tool_call>...</tool_call>"}, ...],
     "default": "text"}

For each request the prompt is decoded, and the rule whose `when` text occurs
latest in it wins (so the newest turn of a conversation decides). The reply is
tokenized with the model's own tokenizer and produced one token per step,
followed by the end-of-sequence token; max_tokens cuts it with "length".
A rule may add `"first_token_after": SECONDS`: its first token comes that
late (a long prefill, as a client sees it). `"step_seconds"` at the top
slows every step (default 0.005), for tests that act mid-stream.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import msgspec
import zmq

from protocol import (
    PROTOCOL_VERSION,
    Abort,
    Awake,
    EngineOptions,
    EngineStats,
    ErrorCode,
    Generate,
    GrammarVocab,
    KvFacts,
    ModelFacts,
    Ready,
    RequestError,
    RequestOutput,
    Shutdown,
    Sleep,
    Slept,
    SlotCommand,
    SlotReply,
    StepOutputs,
    Wake,
    command_decoder,
    encoder,
)
from router.text.model_text import ModelText

# Seconds per generated token: slow enough that a test can act mid-stream.
STEP_SECONDS = 0.005
# Prompt tokens "processed" per progress report.
PROGRESS_CHUNK = 8


@dataclass
class Script:
    rules: list[tuple[str, str]]
    default: str
    # reply -> seconds before its first token
    delays: dict[str, float] = field(default_factory=dict)
    step_seconds: float = STEP_SECONDS

    @classmethod
    def load(cls, path: Path) -> Script:
        data = json.loads(path.read_text())
        rules = data.get("rules", [])
        delays = {r["reply"]: float(r["first_token_after"]) for r in rules if "first_token_after" in r}
        return cls([(r["when"], r["reply"]) for r in rules], data.get("default", ""), delays,
                   float(data.get("step_seconds", STEP_SECONDS)))

    def reply_for(self, prompt: str) -> str:
        best, best_at = self.default, -1
        for when, reply in self.rules:
            at = prompt.rfind(when)
            if at > best_at:
                best, best_at = reply, at
        return best


@dataclass
class Running:
    request: Generate
    reply: list[int]
    produced: int = 0
    progress: list[int] = field(default_factory=list)
    # Prompt tokens "computed" so far (the progress reports, else all at once).
    computed: int = 0
    # time.monotonic() before which no token comes
    not_before: float = 0.0


class ScriptedEngine:
    def __init__(self, model: Path, options: EngineOptions, emit_socket: zmq.Socket):
        self.text = ModelText.load(model)
        self.script = Script.load(model / "script.json")
        config = json.loads((model / "config.json").read_text())
        self.vocab = int(config["vocab_size"])
        self.context = options.max_context or int(config.get("max_position_embeddings", 2048))
        self.options = options
        self.eos = self.text.eos_token_ids[0]
        self._socket = emit_socket
        self._encode = encoder().encode
        self.running: dict[str, Running] = {}
        self.asleep = False
        self.step = 0
        self.stats = EngineStats(kv_pages_total=1024)
        self.facts = ModelFacts(
            architecture=config["architectures"][0], n_vocab=self.vocab,
            n_ctx_train=int(config.get("max_position_embeddings", 2048)),
            n_embd=int(config["hidden_size"]), n_layer=int(config["num_hidden_layers"]),
            n_head=int(config["num_attention_heads"]), n_head_kv=int(config["num_key_value_heads"]),
            n_params=0, size_bytes=0, dtype="float32", device="cpu",
        )

    def emit(self, event: object) -> None:
        self._socket.send(self._encode(event))

    def ready(self) -> Ready:
        kv = KvFacts(page_size=16, num_pages=1024, max_context=self.context,
                     max_concurrency=self.options.max_concurrency,
                     max_batched_tokens=self.options.max_batched_tokens, bytes_per_token=0)
        return Ready(PROTOCOL_VERSION, os.getpid(), self.facts, kv, 0.0)

    def handle(self, command: object) -> bool:
        """False once the engine should exit."""
        if isinstance(command, Generate):
            self._start(command)
        elif isinstance(command, Abort):
            outputs = []
            for request_id in command.request_ids:
                job = self.running.pop(request_id, None)
                if job is not None:
                    outputs.append(self._output(job, [], "abort"))
            if outputs:
                self._publish(outputs)
        elif isinstance(command, Sleep):
            self.asleep = True
            self.emit(Slept(0.0, 0, 0))
        elif isinstance(command, Wake):
            self.asleep = False
            self.emit(Awake(0.0))
        elif isinstance(command, Shutdown):
            return False
        elif isinstance(command, GrammarVocab):
            pass
        elif isinstance(command, SlotCommand):
            # It holds no KV: no lanes to list, nothing to save, restore or erase.
            error = "" if command.action == "list" else "the scripted engine holds no KV"
            self.emit(SlotReply(command.action_id, error=error))
        return True

    def _start(self, request: Generate) -> None:
        if self.asleep:
            self.emit(RequestError(request.request_id, ErrorCode.INVALID_REQUEST, "the engine is asleep"))
            return
        if request.params.grammar is not None:
            self.emit(RequestError(request.request_id, ErrorCode.INVALID_REQUEST,
                                   "the scripted engine does not constrain output"))
            return
        if request.params.pooling is not None or request.params.max_tokens < 1:
            # It runs no model: no hidden states to pool, no prompt to score.
            self.emit(RequestError(request.request_id, ErrorCode.INVALID_REQUEST,
                                   "the scripted engine neither embeds nor scores prompts"))
            return
        if len(request.prompt_token_ids) >= self.context:
            self.emit(RequestError(request.request_id, ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                                   f"the prompt has {len(request.prompt_token_ids)} tokens; "
                                   f"the context is {self.context}"))
            return
        prompt = self.text.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
        text = self.script.reply_for(prompt)
        reply = [*self.text.tokenizer.encode(text), self.eos]
        job = Running(request, reply, not_before=time.monotonic() + self.script.delays.get(text, 0.0))
        if request.params.report_progress:
            total = len(request.prompt_token_ids)
            job.progress = [*range(PROGRESS_CHUNK, total, PROGRESS_CHUNK), total]
        self.running[request.request_id] = job
        self.stats.prompt_tokens_total += len(request.prompt_token_ids)

    def tick(self) -> None:
        outputs = []
        busy = len(self.running)
        prefill = 0
        now = time.monotonic()
        for request_id, job in list(self.running.items()):
            if job.not_before > now:
                continue
            prompt = len(job.request.prompt_token_ids)
            if job.progress:
                done = job.progress.pop(0)
                prefill += done - job.computed
                job.computed = done
                outputs.append(RequestOutput(request_id, [], None, len(job.request.prompt_token_ids),
                                             0, done))
                continue
            prefill += prompt - job.computed
            job.computed = prompt
            token = job.reply[job.produced]
            job.produced += 1
            params = job.request.params
            reason = None
            if (token == self.eos and not params.ignore_eos) or token in params.stop_token_ids:
                reason = "stop"
            elif job.produced >= params.max_tokens or job.produced >= len(job.reply):
                reason = "length"
            if reason is not None:
                del self.running[request_id]
            outputs.append(self._output(job, [token], reason))
        decode = sum(len(o.token_ids) for o in outputs)
        stats = self.stats
        stats.generated_tokens_total += decode
        # As the real engine does: one forward pass per tick, its (nominal)
        # time shared between prompt and output tokens by count.
        if prefill + decode:
            stats.prefill_tokens_total += prefill
            stats.prefill_seconds_total += STEP_SECONDS * prefill / (prefill + decode)
            stats.decode_seconds_total += STEP_SECONDS * decode / (prefill + decode)
            stats.forward_passes_total += 1
            stats.busy_slots_total += busy
        self._publish(outputs)

    def _output(self, job: Running, tokens: list[int], reason: str | None) -> RequestOutput:
        return RequestOutput(job.request.request_id, tokens, reason,  # type: ignore[arg-type]
                             len(job.request.prompt_token_ids), 0)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self.step += 1
        self.stats.running = len(self.running)
        self.stats.steps_total = self.step
        self.stats.kv_tokens_used = sum(job.computed + job.produced for job in self.running.values())
        # 16-token pages, as ready() announces.
        self.stats.kv_pages_used = sum(-(-(job.computed + job.produced) // 16)
                                       for job in self.running.values())
        self.emit(StepOutputs(self.step, outputs, msgspec.structs.replace(self.stats)))


EngineT = TypeVar("EngineT", bound=ScriptedEngine)


def serve(engine: ScriptedEngine, inbox: zmq.Socket, parent_pid: int) -> int:
    """Commands as they come; a step, then step_seconds of sleep, while
    requests run. Returns the exit status."""
    decode = command_decoder().decode
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    while True:
        if parent_pid and os.getppid() != parent_pid:
            return 1
        step = engine.script.step_seconds
        # While requests run, only a look for commands: the sleep after the
        # step is its pacing (waiting here as well made a step take twice
        # step_seconds).
        waited = 0 if engine.running else 0.5
        if poller.poll(int(waited * 1000)):
            while inbox.poll(0):
                if not engine.handle(decode(inbox.recv())):
                    return 0
        if engine.running:
            engine.tick()
            time.sleep(step)


def run_engine(engine_class: type[EngineT], module: str,
               serve_loop: Callable[[EngineT, zmq.Socket, int], int]) -> int:
    """An engine process as the router's supervisor starts one: its
    arguments, its two sockets, Ready, then serve_loop until Shutdown (0) or
    the router's death (1)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}")
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--options", default="{}", type=EngineOptions.from_json)
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--parent-pid", type=int, default=0)
    parser.add_argument("--name", default="")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args()
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(args.input)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(args.output)
    engine = engine_class(args.model, args.options, outbox)
    engine.emit(engine.ready())
    print(f"{module} ready (pid {os.getpid()})", file=sys.stderr, flush=True)
    status = serve_loop(engine, inbox, args.parent_pid)
    if status == 0:
        outbox.close()
    return status


def main() -> int:
    return run_engine(ScriptedEngine, "tests.support.scripted_engine", serve)


if __name__ == "__main__":
    raise SystemExit(main())
