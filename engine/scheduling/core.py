"""The busy loop: drain commands, schedule, run one step, publish outputs.

It never touches a socket: commands arrive on a queue filled by the input
thread and events leave through `emit`, which hands them to the output thread.

Requests with a grammar get an xgrammar matcher when they arrive (the grammar
is compiled then); every step masks their logits and advances their matchers
(engine/sampling/grammar.py).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable

import msgspec

from engine.execution.model_runner import ModelRunner
from engine.sampling.grammar import EngineGrammar, GrammarCompileError, GrammarError
from engine.sampling.sampler import Sampler
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.sequence import Sequence
from protocol import (
    Abort,
    Awake,
    EngineEvent,
    EngineStats,
    ErrorCode,
    Generate,
    GrammarVocab,
    RequestError,
    RequestOutput,
    RouterCommand,
    Shutdown,
    Sleep,
    Slept,
    StepOutputs,
    Wake,
)

log = logging.getLogger(__name__)

# How long an idle loop waits for a command before checking invariants again.
IDLE_WAIT_SECONDS = 1.0


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        sampler: Sampler,
        *,
        vocab_size: int,
        emit: Callable[[EngineEvent], None],
    ):
        self.runner = runner
        self.scheduler = scheduler
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.emit = emit
        self.grammar = EngineGrammar(vocab_size, runner.device)
        self.step_count = 0
        self._pending: list[RequestOutput] = []
        self._stats = EngineStats(kv_pages_total=scheduler.kv.pool.num_pages)
        self._stopping = False
        # Cached pages kept in host memory while asleep; None while awake.
        self._kept_pages: int | None = None

    # ---- commands ----------------------------------------------------------

    def handle(self, command: RouterCommand) -> None:
        if isinstance(command, Generate):
            self._add(command)
        elif isinstance(command, Abort):
            for seq in self.scheduler.abort(command.request_ids):
                self._forget(seq.request_id)
                self._pending.append(self._output(seq, []))
        elif isinstance(command, GrammarVocab):
            self.grammar.set_vocab(command)
        elif isinstance(command, Sleep):
            self._sleep(command)
        elif isinstance(command, Wake):
            self._wake()
        elif isinstance(command, Shutdown):
            self._shutdown()

    def _shutdown(self) -> None:
        """Stop now: the router sends Shutdown once it is done with this
        engine (it drained or aborted its requests first), so anything still
        here is aborted, its outputs published (so no stream is left open),
        and the loop ends; the process exits 0."""
        left = [seq.request_id for seq in (*self.scheduler.running, *self.scheduler.waiting)]
        for seq in self.scheduler.abort(left):
            self._forget(seq.request_id)
            self._pending.append(self._output(seq, []))
        if left:
            log.info("shutdown: aborted %d request(s) still here", len(left))
        if self._pending:
            self._publish()
        self._stopping = True

    @property
    def asleep(self) -> bool:
        return self._kept_pages is not None

    def _sleep(self, command: Sleep) -> None:
        if self._kept_pages is not None:
            self.emit(Slept(0.0, self._kept_pages, self.runner.device_bytes()))
            return
        scheduler = self.scheduler
        if scheduler.has_work():
            # The router drains an engine before putting it to sleep; going on
            # would throw away requests that someone is waiting for.
            raise RuntimeError(
                f"Sleep arrived with {len(scheduler.running)} running and "
                f"{len(scheduler.waiting)} waiting requests; the router must send Sleep "
                "only to an engine with no requests"
            )
        if self._pending:
            # Outputs of requests aborted just before, so they arrive before Slept.
            self._publish()
        pages = scheduler.kv.pool.cached_pages()
        started = time.perf_counter()
        host_bytes = self.runner.sleep(command.weights, pages)
        seconds = time.perf_counter() - started
        self._kept_pages = len(pages)
        device_bytes = self.runner.device_bytes()
        log.info("asleep in %.2fs (weights: %s, %d KV pages kept, %.1f MiB of host memory "
                 "taken, %d device bytes still held)", seconds, command.weights, len(pages),
                 host_bytes / 2**20, device_bytes)
        self.emit(Slept(seconds, len(pages), device_bytes))

    def _wake(self) -> None:
        if self._kept_pages is None:
            self.emit(Awake(0.0))
            return
        started = time.perf_counter()
        # A failure here (out of device memory, an unreadable model file) leaves
        # the engine without weights or KV: it propagates and ends the engine.
        self.runner.wake()
        seconds = time.perf_counter() - started
        self._kept_pages = None
        log.info("awake in %.2fs", seconds)
        self.emit(Awake(seconds))

    def _add(self, command: Generate) -> None:
        if self._kept_pages is not None:
            self.emit(RequestError(command.request_id, ErrorCode.INVALID_REQUEST,
                                   "the engine is asleep; it must be woken (Wake) before it "
                                   "takes requests"))
            return
        error = self._validate(command)
        if error is not None:
            code, message = error
            self.emit(RequestError(command.request_id, code, message))
            return
        grammar = command.params.grammar
        if grammar is not None:
            try:
                self.grammar.admit(command.request_id, grammar)
            except GrammarError as exc:
                # A grammar that does not compile has its own code, so the router
                # can name the request field at fault.
                code = (ErrorCode.INVALID_GRAMMAR if isinstance(exc, GrammarCompileError)
                        else ErrorCode.INVALID_REQUEST)
                self.emit(RequestError(command.request_id, code, str(exc)))
                return
        seq = Sequence(command.request_id, command.prompt_token_ids, command.params)
        self.scheduler.add(seq)
        self._stats.prompt_tokens_total += seq.num_prompt_tokens

    def _validate(self, command: Generate) -> tuple[ErrorCode, str] | None:
        prompt = command.prompt_token_ids
        max_context = self.scheduler.max_context
        if command.request_id in self.scheduler:
            return ErrorCode.DUPLICATE_REQUEST, f"request id {command.request_id!r} is already running"
        if not prompt:
            return ErrorCode.INVALID_REQUEST, "the prompt is empty"
        if len(prompt) >= max_context:
            return (
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"the prompt has {len(prompt)} tokens; this model's context is {max_context} "
                f"tokens, which must also hold at least one generated token",
            )
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return ErrorCode.INVALID_REQUEST, f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})"
        if command.params.max_tokens < 1:
            return ErrorCode.INVALID_REQUEST, "max_tokens must be at least 1"
        bad = next((t for t in command.params.logit_bias if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return (ErrorCode.INVALID_REQUEST,
                    f"logit_bias token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        return None

    # ---- the loop ------------------------------------------------------------

    def run(self, commands: queue.Queue[RouterCommand]) -> None:
        while not self._stopping:
            if not self.scheduler.has_work() and not self._pending:
                try:
                    self.handle(commands.get(timeout=IDLE_WAIT_SECONDS))
                except queue.Empty:
                    # Idle: a good moment to prove the books balance.
                    self.scheduler.check_invariants()
                    continue
            while not self._stopping:
                try:
                    self.handle(commands.get_nowait())
                except queue.Empty:
                    break
            if self.scheduler.has_work():
                self.step()
            elif self._pending:
                self._publish()

    def step(self) -> None:
        started = time.perf_counter()
        out = self.scheduler.schedule()
        # Decode rows compute the newest token of a sequence that already has
        # output; the rest of the batch is prompt (or recomputed) tokens.
        # Counted before update() appends the sampled tokens.
        decode_tokens = sum(1 for chunk in out.chunks if chunk.samples and chunk.num_tokens == 1
                            and chunk.seq.num_output_tokens > 0)
        prefill_tokens = out.num_tokens - decode_tokens
        sampling = [chunk.seq for chunk in out.chunks if chunk.samples]
        # Sequences with no output yet are prefilling their prompt.
        reporting = [chunk.seq for chunk in out.chunks
                     if chunk.seq.params.report_progress and chunk.seq.num_output_tokens == 0]
        mask = self.grammar.fill(sampling)
        sampled = self.runner.execute(out, mask) if not out.is_empty else []
        verdict = self.grammar.accept(sampling, sampled)
        self.step_count += 1
        changed = self.scheduler.update(out, sampled, verdict.completed)
        # Progress first, so a prompt's last report (all of it processed)
        # arrives before its first token.
        self._pending.extend(self._progress(seq) for seq in reporting)
        for seq in changed:
            if seq.request_id in verdict.rejected:
                continue
            self._pending.append(self._output(seq, seq.token_ids[-1:]))
            if seq.finish_reason is not None:
                self._forget(seq.request_id)
        for request_id, message in verdict.rejected.items():
            self._fail(request_id, message)
        stats = self._stats
        stats.generated_tokens_total += len(sampled)
        if not out.is_empty:
            # The step's wall time, shared between prefill and decode by token
            # count: llama.cpp's prompt/predicted seconds for a mixed batch.
            seconds = time.perf_counter() - started
            stats.prefill_tokens_total += prefill_tokens
            stats.prefill_seconds_total += seconds * prefill_tokens / out.num_tokens
            stats.decode_seconds_total += seconds * decode_tokens / out.num_tokens
            stats.forward_passes_total += 1
            stats.busy_slots_total += len(out.chunks)
        self._publish()

    def _fail(self, request_id: str, message: str) -> None:
        """End a running request with a request error (its grammar cannot go on)."""
        self.scheduler.abort([request_id])  # nothing to do if it just finished
        self._forget(request_id)
        self.emit(RequestError(request_id, ErrorCode.INVALID_REQUEST, message))

    def _forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)
        self.grammar.forget(request_id)

    def _output(self, seq: Sequence, tokens: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=tokens,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def _progress(self, seq: Sequence) -> RequestOutput:
        """A prompt-progress report: no tokens, no finish reason; prompt tokens
        found in the prefix cache count as computed."""
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=[],
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_computed_tokens=seq.num_computed_tokens,
        )

    def _publish(self) -> None:
        scheduler = self.scheduler
        pool = scheduler.kv.pool
        stats = self._stats
        stats.running = len(scheduler.running)
        stats.prefilling = scheduler.num_prefilling
        stats.waiting = len(scheduler.waiting)
        stats.kv_pages_used = pool.num_used
        stats.kv_pages_cached = pool.num_cached
        stats.kv_tokens_used = sum(seq.num_computed_tokens for seq in scheduler.running)
        stats.preemptions_total = scheduler.num_preemptions
        stats.cached_tokens_total = scheduler.num_cached_tokens_total
        stats.steps_total = self.step_count
        outputs, self._pending = self._pending, []
        # The output thread encodes later, after this loop has moved on: send a copy.
        self.emit(StepOutputs(self.step_count, outputs, msgspec.structs.replace(stats)))
