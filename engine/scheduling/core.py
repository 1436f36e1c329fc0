"""The busy loop: drain commands, schedule, launch a step, complete the one
before, publish outputs.

It never touches a socket: commands arrive on a queue filled by the input
thread and events leave through `emit`, which hands them to the output thread.

The loop is a two-stage pipeline, so the host's work hides behind the
device's. Each turn:
1. drain commands (aborts take effect before anything is scheduled);
2. schedule step N + 1 and launch its forward pass; the device runs it right
   behind step N, reading step N's tokens from the device where they are
   needed (engine/execution/future_tokens.py);
3. launch step N + 1's sampling, but for rows that need step N's token on
   the host first (a grammar mask, a token that may be forced:
   engine/sampling/forced_tokens.py; penalties need nothing from the host,
   their counts live on the device: engine/sampling/penalty_state.py);
4. complete step N: wait for its tokens, advance the grammar matchers, let
   the scheduler place the tokens and finish sequences, queue the outputs;
5. for the rows put off, fill the grammar masks and decide the forced
   tokens now (the device is still busy with step N + 1's forward pass) and
   launch their sampling;
6. publish step N's outputs.
A step's outputs are always taken before the buffers they came through are
used again (two alternating halves of each), and every event of step N (a
finish, an abort, a failed grammar) is seen by the scheduler before step N + 2
is scheduled. A sequence that stopped at step N was already in step N + 1:
that step's work for it is dropped. On the CPU (or without our kernels) the
tokens are known as soon as they are sampled, and the same loop simply never
waits.

Embedding requests (SamplingParams.pooling) run as scored prompts do:
chunked, eagerly, nothing sampled; the runner pools their hidden states
(engine/execution/embeddings.py) and the output that finishes one carries
its vector.

Requests with a grammar get an xgrammar matcher when they arrive (the grammar
is compiled then); every step masks their logits and advances their matchers
(engine/sampling/grammar.py).

Speculative decoding (Scheduler.drafter, off by default): a decode row
(greedy or sampled, see may_draft) drafts only with all its tokens on the host, and its accepted tokens must
be known before anything more is scheduled for it. So while any running
decode row may draft, each turn completes the step in flight before it
schedules: the loop runs synchronously (no overlap on a GPU; none is lost on
the CPU). A verify step's drafts are checked when it completes
(engine/sampling/verify.py) and a row's output carries all its accepted tokens.
A grammar row's draft is cut where its grammar refuses it, and a reasoning
budget's where a forced token would fall (Scheduler.cut_draft); the masks of
its draft positions are filled while the device runs the verify step's
forward pass (ModelRunner.forward's draft_masks), and its matcher takes all
the tokens the step emitted for it when the step completes.
What drafting costs is measured from the loop's own step times: each
decode-only step's interval from the step before it, with its rows and
drafts and whether it ran without overlap, goes to the scheduler's
DraftCosts (engine/sampling/draft_cost.py), which every row's draft length
weighs (engine/scheduling/step_times.py says which steps count and how).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import msgspec

from engine.execution.embeddings import PooledVectors, embedding_error
from engine.execution.model_runner import ModelRunner, SampledTokens, StepForward
from engine.sampling.forced_tokens import ForcedTokens, check_budget
from engine.sampling.grammar import EngineGrammar, GrammarCompileError, GrammarError
from engine.sampling.logprobs import PromptScores
from engine.sampling.sampler import Sampler
from engine.sampling.token_mask import TokenMask
from engine.sampling.verify import accept_drafts
from engine.scheduling.media import SequenceMedia
from engine.scheduling.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from engine.scheduling.sequence import SeqStatus, Sequence
from engine.scheduling.slot_actions import SlotActions
from engine.scheduling.step_times import StepTimes
from protocol import (
    MAX_TOP_LOGPROBS,
    Abort,
    Awake,
    CacheHits,
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
    SlotCommand,
    SlotReply,
    StepOutputs,
    TokenLogprobs,
    Wake,
)
from protocol.sampling import MAX_LOGPROB_TOKEN_IDS, SamplingParams

log = logging.getLogger(__name__)

# How long an idle loop waits for a command before checking invariants again.
IDLE_WAIT_SECONDS = 1.0
# How long a loop with nothing to run but disk reads to wait for (a request
# waiting on its restore: engine/kv/disk_restore.py) sleeps before it looks
# at its commands again.
DISK_WAIT_SECONDS = 0.005


@dataclass
class InFlight:
    """A launched step whose tokens the host has not taken yet."""

    out: SchedulerOutput
    # Its sampled tokens, in one or two parts: (indices among the step's
    # sampling rows, or None for all of them; their tokens).
    tokens: list[tuple[list[int] | None, SampledTokens]]
    # Prompt-progress reports due when it completes: (sequence, tokens
    # computed once this step is done).
    reporting: list[tuple[Sequence, int]]
    prefill_tokens: int
    decode_tokens: int
    launched_at: float
    # Prompt tokens scored by this step: (chunk, their log probabilities).
    scores: list[tuple[ScheduledChunk, PromptScores]] = field(default_factory=list)
    # Embeddings of the requests whose prompt it finished.
    pooled: PooledVectors | None = None
    # The target's tokens at its draft positions (StepForward.verified).
    verified: SampledTokens | None = None
    # Launched with no step in flight: the device idled while the host
    # scheduled it (the loop completed the step before first).
    synchronous: bool = False
    # Off a CUDA device only: when its tokens were ready (its sampling
    # returned) and the loop's time outside step() before that
    # (engine/scheduling/step_times.py).
    ready_at: float = 0.0
    outside: float = 0.0


def _drafted_tokens(sampling: list[ScheduledChunk], sampled: list[int],
                    verified: list[int]) -> dict[str, list[int]]:
    """Per grammar row of a verify step, by request id, the tokens it emitted
    after its sampled one: its accepted draft tokens and the free one after
    them. verified holds the target's tokens at the draft rows, in chunk order."""
    emitted: dict[str, list[int]] = {}
    targets = iter(verified)
    for chunk, token in zip(sampling, sampled, strict=True):
        if not chunk.draft:
            continue
        row_targets = [next(targets) for _ in chunk.draft]
        if chunk.seq.params.grammar is not None:
            emitted[chunk.seq.request_id] = accept_drafts(token, chunk.draft, row_targets)[1:]
    return emitted


def _draft_logprobs(chunks: list[ScheduledChunk], verified: SampledTokens | None
                    ) -> dict[int, list[TokenLogprobs]]:
    """Per chunk (by id) whose row asks for log probabilities, those of the
    target's tokens at its draft positions (engine/sampling/draft_logprobs.py),
    in order; read after verified.tolist()."""
    found: dict[int, list[TokenLogprobs]] = {}
    if verified is None:
        return found
    per_row = verified.logprobs()
    row = 0
    for chunk in chunks:
        entries = per_row[row : row + len(chunk.draft)]
        row += len(chunk.draft)
        if chunk.draft and chunk.seq.params.logprobs >= 0:
            found[id(chunk)] = [entry for entry in entries if entry is not None]
    return found


def _take_cache_hits(seq: Sequence) -> CacheHits | None:
    """seq's cached tokens by tier, in its first output after admission only."""
    hits, seq.cache_hits = seq.cache_hits, None
    return hits


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
        self.forced = ForcedTokens()
        scheduler.cut_draft = self._cut_draft
        self.step_count = 0
        self._in_flight: InFlight | None = None
        self._last_completed_at = 0.0
        # Decode steps timed for the draft costs; a CUDA device runs behind the host.
        self.step_times = StepTimes(scheduler, asynchronous=runner.device.type == "cuda")
        self._pending: list[RequestOutput] = []
        self._stats = EngineStats(kv_pages_total=scheduler.kv.pool.num_pages)
        self._stopping = False
        # Cached pages kept in host memory while asleep; None while awake.
        self._kept_pages: int | None = None
        # llama.cpp's /slots save/restore/erase (the device idle before each).
        self.slot_actions = SlotActions(scheduler, runner, emit, self._drain)

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
        elif isinstance(command, SlotCommand):
            if self._kept_pages is not None and command.action != "list":
                self.emit(SlotReply(command.action_id, error="the model is asleep; wake it first"))
            else:
                self.slot_actions.handle(command)

    def _shutdown(self) -> None:
        """Stop now: the router sends Shutdown once it is done with this
        engine (it drained or aborted its requests first), so anything still
        here is aborted, its outputs published (so no stream is left open),
        and the loop ends; the process exits 0."""
        left = [seq.request_id for seq in (*self.scheduler.running, *self.scheduler.waiting)]
        for seq in self.scheduler.abort(left):
            self._forget(seq.request_id)
            self._pending.append(self._output(seq, []))
        self._drain()
        if left:
            log.info("shutdown: aborted %d request(s) still here", len(left))
        if self._pending:
            self._publish()
        # The disk tier (if any) keeps the cached pages for the next run:
        # the device's go through the host tier, whose pages it then writes.
        kv = self.scheduler.kv
        for transfers in kv.offload_cached():
            self.runner.move_kv(transfers)
        kv.close()
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
        # The device must be done with the last step before its memory goes.
        self._drain()
        if self._pending:
            # Outputs of requests aborted just before, so they arrive before Slept.
            self._publish()
        pages = scheduler.kv.pool.cached_pages()
        started = time.perf_counter()
        if hasattr(scheduler.drafter, "sleep"):
            scheduler.drafter.sleep()  # type: ignore[union-attr]  # a draft model's memory
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
        if hasattr(self.scheduler.drafter, "wake"):
            self.scheduler.drafter.wake()  # type: ignore[union-attr]
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
        reasoning = command.params.reasoning
        problem = check_budget(reasoning, self.vocab_size) if reasoning is not None else None
        if problem is not None:
            self.emit(RequestError(command.request_id, ErrorCode.INVALID_REQUEST, problem))
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
        if reasoning is not None:
            self.forced.admit(command.request_id, reasoning)
        seq = Sequence(command.request_id, command.prompt_token_ids, command.params)
        if command.images:
            media = self._media(command)
            if isinstance(media, str):
                self.emit(RequestError(command.request_id, ErrorCode.INVALID_REQUEST, media))
                return
            seq.media = media
        self.scheduler.add(seq)
        if command.id_slot >= 0:
            self.scheduler.lanes.pin(command.request_id, command.id_slot)
        self._stats.prompt_tokens_total += seq.num_prompt_tokens

    def _media(self, command: Generate) -> SequenceMedia | str:
        """The request's images laid over its prompt, or why they cannot be."""
        encoder = self.runner.vision
        if encoder is None:
            return ("this model is not served with vision (--vision): it takes no images")
        try:
            return SequenceMedia.build(command.prompt_token_ids, list(command.images),
                                       encoder.spec.image_token_id, encoder.spec.merge_size)
        except ValueError as exc:
            return f"the request's images do not match its prompt: {exc}"

    def _validate(self, command: Generate) -> tuple[ErrorCode, str] | None:
        prompt = command.prompt_token_ids
        max_context = self.scheduler.max_context
        if command.request_id in self.scheduler:
            return ErrorCode.DUPLICATE_REQUEST, f"request id {command.request_id!r} is already running"
        if command.id_slot >= self.scheduler.max_concurrency:
            return (ErrorCode.INVALID_REQUEST, f"Invalid slot ID: id_slot {command.id_slot}; this "
                    f"model has {self.scheduler.max_concurrency} slots")
        if not prompt:
            return ErrorCode.INVALID_REQUEST, "the prompt is empty"
        # A scored prompt or an embedding generates nothing: it may fill the context.
        only_scored = command.params.max_tokens == 0 and (
            command.params.prompt_logprobs >= 0 or command.params.pooling is not None)
        if len(prompt) > max_context or (len(prompt) == max_context and not only_scored):
            return (
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"the prompt has {len(prompt)} tokens; this model's context is {max_context} "
                f"tokens, which must also hold at least one generated token",
            )
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return ErrorCode.INVALID_REQUEST, f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})"
        params = command.params
        if params.pooling is not None:
            problem = embedding_error(params)
            if problem is not None:
                return ErrorCode.INVALID_REQUEST, problem
        scores_prompt = params.prompt_logprobs >= 0 or params.pooling is not None
        if params.max_tokens < (0 if scores_prompt else 1):
            return (ErrorCode.INVALID_REQUEST,
                    "max_tokens must be at least 1 (0 only when the prompt is scored)")
        for name, count in (("logprobs", params.logprobs),
                            ("prompt_logprobs", params.prompt_logprobs)):
            if count > MAX_TOP_LOGPROBS:
                return (ErrorCode.INVALID_REQUEST,
                        f"{name} asks for {count} alternatives; at most {MAX_TOP_LOGPROBS}")
        bad = next((t for t in command.params.logit_bias if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return (ErrorCode.INVALID_REQUEST,
                    f"logit_bias token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        return self._check_named_ids(params)

    def _check_named_ids(self, params: SamplingParams) -> tuple[ErrorCode, str] | None:
        """SamplingParams.logprob_token_ids: few, in the vocabulary, and only
        beside the sampled tokens' own log probabilities, which carry them."""
        named = params.logprob_token_ids
        if not named:
            return None
        if params.logprobs < 0:
            return ErrorCode.INVALID_REQUEST, "logprob_token_ids needs logprobs >= 0"
        if len(named) > MAX_LOGPROB_TOKEN_IDS:
            return (ErrorCode.INVALID_REQUEST, f"logprob_token_ids names {len(named)} tokens; "
                    f"at most {MAX_LOGPROB_TOKEN_IDS}")
        bad = next((t for t in named if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return (ErrorCode.INVALID_REQUEST, f"logprob_token_ids token id {bad} is outside the "
                    f"vocabulary (0..{self.vocab_size - 1})")
        return None

    # ---- the loop ------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        """Requests to serve, or a launched step still to complete."""
        return self.scheduler.has_work() or self._in_flight is not None

    def run(self, commands: queue.Queue[RouterCommand]) -> None:
        while not self._stopping:
            if not self.has_work and not self._pending:
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
            if self.has_work:
                self.step()
            elif self._pending:
                self._publish()
            if self.slot_actions.deferred:
                self.slot_actions.retry()

    def step(self) -> None:
        """One turn of the pipeline: launch the next step, complete the one
        before it (see the module's docstring)."""
        self.step_times.enter()
        try:
            self._turn()
        finally:
            self.step_times.leave()

    def _turn(self) -> None:
        flight = self._in_flight
        if flight is not None and (flight.verified is not None or self.scheduler.wants_drafts()):
            # A row can draft only once the step in flight is on the host, and
            # nothing is scheduled after a verify step before its drafts are
            # checked (its rows' computed tokens count drafts not yet kept).
            self._drain()
        out = self.scheduler.schedule()
        # Pages the scheduling moved between the device and the host tier:
        # copied before this step's forward pass reads or overwrites them.
        kv = self.scheduler.kv
        transfers = kv.take_transfers()
        if transfers:
            self.runner.move_kv(transfers)
        if out.is_empty and self._in_flight is None and not self._pending and kv.restoring:
            # Nothing runs until a disk read lands: wait for one, briefly.
            kv.wait_for_reads(DISK_WAIT_SECONDS)
            return
        forward: StepForward | None = None
        launched: InFlight | None = None
        parts: list[tuple[list[int] | None, SampledTokens]] = []
        put_off: list[int] = []
        if not out.is_empty:
            synchronous = self._in_flight is None
            launched_at = time.perf_counter()
            forward = self.runner.forward(out, self._draft_masks(out))
            first_slot = self.runner.future.next_slots()
            sampling = [chunk.seq for chunk in out.chunks if chunk.samples]
            put_off = [row for row, seq in enumerate(sampling) if self._needs_host_tokens(seq)]
            if not put_off:
                parts.append((None, self._sample(out, forward, first_slot)))
            elif len(put_off) < len(sampling):
                # The other rows need nothing from the host: sampled now.
                waiting = set(put_off)
                rows = [row for row in range(len(sampling)) if row not in waiting]
                parts.append((rows, self._sample(out, forward, first_slot, rows=rows)))
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self._complete(previous)
        if forward is not None:
            if put_off:
                rows = put_off if len(put_off) < len(sampling) else None
                seqs = [sampling[row] for row in put_off]
                mask = self.forced.force(self.grammar.fill(seqs), seqs)
                parts.append((rows, self._sample(out, forward, first_slot, mask, rows)))
            # MTP drafting's head runs over the step's rows (all sampled now).
            self.runner.after_sampling(out, forward)
            launched = self._launched(out, parts, forward, launched_at, synchronous)
            self.step_times.launched(launched)
            self.step_count += 1
        self._in_flight = launched
        self._publish()

    def _drain(self) -> None:
        """Complete the step in flight, if any."""
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self._complete(previous)

    def _cut_draft(self, seq: Sequence, draft: list[int]) -> list[int]:
        """seq's draft (all its tokens known) before a position whose token a
        reasoning budget forces, and before a token its grammar refuses."""
        return self.grammar.cut_draft(seq, self.forced.cut_draft(seq, draft))

    def _draft_masks(self, out: SchedulerOutput) -> Callable[[], TokenMask | None] | None:
        """The fill of a verify step's draft-row masks, for the runner to call
        while the device runs the forward pass; None without a grammar row
        among the drafting ones."""
        drafted = [(chunk.seq, chunk.draft) for chunk in out.chunks if chunk.draft]
        if not any(seq.params.grammar is not None for seq, _ in drafted):
            return None
        return partial(self.grammar.fill_drafts, drafted)

    def _needs_host_tokens(self, seq: Sequence) -> bool:
        """Whether a sampling row needs its newest token on the host before
        it can be sampled: a grammar mask, or a token that may be forced
        (engine/sampling/forced_tokens.py). Penalties do not need it: their
        counts are kept on the device (engine/sampling/penalty_state.py)."""
        # A request with a grammar has a matcher: admission refuses it otherwise.
        return seq.params.grammar is not None or self.forced.needs_host(seq)

    def _sample(self, out: SchedulerOutput, forward: StepForward, first_slot: int,
                mask: TokenMask | None = None, rows: list[int] | None = None) -> SampledTokens:
        """Launch the sampling of the step's sampling rows (or of rows, their
        indices among them) and give their sequences placeholders; sampling
        row i's token goes to future slot first_slot + i."""
        tokens = self.runner.sample(forward, first_slot, mask, rows)
        self.scheduler.add_pending_tokens(out, first_slot, None if rows is None else set(rows))
        return tokens

    def _launched(self, out: SchedulerOutput, tokens: list[tuple[list[int] | None, SampledTokens]],
                  forward: StepForward, launched_at: float, synchronous: bool) -> InFlight:
        # Decode rows compute the newest token of a sequence that already has
        # output; the rest of the batch is prompt (or recomputed) tokens.
        # (A verify chunk is a decode row with its draft.)
        decode_tokens = sum(chunk.num_tokens for chunk in out.chunks if chunk.samples
                            and chunk.num_tokens == 1 + len(chunk.draft)
                            and chunk.token_index > chunk.seq.num_prompt_tokens)
        # Chunks of a prompt, up to the one that samples its first token; a
        # sequence recomputed after a preemption reported its prompt already.
        reporting = [(chunk.seq, chunk.start + chunk.num_tokens) for chunk in out.chunks
                     if chunk.seq.params.report_progress
                     and (chunk.token_index == chunk.seq.num_prompt_tokens if chunk.samples
                          else chunk.seq.num_output_tokens == 0)]
        scores = [(out.chunks[index], chunk_scores) for index, chunk_scores in forward.scores]
        return InFlight(out, tokens, reporting, out.num_tokens - decode_tokens, decode_tokens,
                        launched_at, scores, pooled=forward.pooled, verified=forward.verified,
                        synchronous=synchronous)

    def _complete(self, flight: InFlight) -> None:
        """Take a launched step's tokens and apply them."""
        out = flight.out
        sampled, logprobs = self._taken(flight)
        sampling = [chunk for chunk in out.chunks if chunk.samples]
        logprobs_of = {id(chunk): lp for chunk, lp in zip(sampling, logprobs, strict=True)}
        # Sequences that finished or were aborted since launch: their work is dropped.
        gone = {id(chunk.seq) for chunk in out.chunks if chunk.seq.status is SeqStatus.FINISHED}
        live = [(chunk.seq, token) for chunk, token in zip(sampling, sampled, strict=True)
                if id(chunk.seq) not in gone]
        verified = flight.verified.tolist() if flight.verified is not None else []
        drafted = _drafted_tokens(sampling, sampled, verified) if verified and len(self.grammar) else None
        verdict = self.grammar.accept([seq for seq, _ in live], [token for _, token in live], drafted)
        changed = self.scheduler.complete(out, sampled, verdict.completed, verified)
        draft_logprobs = _draft_logprobs(out.chunks, flight.verified)
        # Progress first, so a prompt's last report (all of it processed)
        # arrives before its first token.
        # (A sequence preempted since launch reports again when recomputed.)
        self._pending.extend(self._progress(seq, computed) for seq, computed in flight.reporting
                             if id(seq) not in gone and seq.status is not SeqStatus.WAITING)
        # Then the prompt tokens scored, before any token sampled after them.
        self._pending.extend(self._scored(chunk.seq, scores) for chunk, scores in flight.scores
                             if id(chunk.seq) not in gone)
        embeddings = ({id(out.chunks[index]): vector
                       for index, vector in flight.pooled.by_chunk().items()}
                      if flight.pooled is not None else {})
        for chunk in changed:
            seq = chunk.seq
            if seq.request_id in verdict.rejected:
                continue
            if chunk.token_index < 0:  # a prompt scored or embedded, nothing generated
                output = self._output(seq, [])
                output.embedding = embeddings.get(id(chunk), b"")
                self._pending.append(output)
                self._forget(seq.request_id)
                continue
            row_logprobs = logprobs_of.get(id(chunk))
            end = chunk.token_index + 1 + chunk.accepted
            token_logprobs = [row_logprobs] if row_logprobs else []
            if row_logprobs and chunk.accepted:
                token_logprobs += draft_logprobs[id(chunk)][: chunk.accepted]
            output = self._output(seq, seq.token_ids[chunk.token_index:end], token_logprobs)
            if chunk.draft:
                output.num_draft_tokens = len(chunk.draft)
                output.num_draft_accepted = chunk.accepted
                self._stats.draft_tokens_total += len(chunk.draft)
                self._stats.draft_accepted_tokens_total += chunk.accepted
                self._stats.generated_tokens_total += chunk.accepted
            self._pending.append(output)
            if seq.finish_reason is not None:
                self._forget(seq.request_id)
        for request_id, message in verdict.rejected.items():
            self._fail(request_id, message)
        self._account(flight, len(sampled))

    @staticmethod
    def _taken(flight: InFlight) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The step's tokens and their log probabilities (None for rows that
        did not ask) in sampling-row order, its parts put together."""
        ((rows, first), *rest) = flight.tokens
        if not rest and rows is None:
            return first.tolist(), first.logprobs()
        count = sum(1 for chunk in flight.out.chunks if chunk.samples)
        sampled = [0] * count
        logprobs: list[TokenLogprobs | None] = [None] * count
        for rows, part in flight.tokens:
            order = rows or range(count)
            for row, token, row_logprobs in zip(order, part.tolist(), part.logprobs(),
                                                strict=True):
                sampled[row] = token
                logprobs[row] = row_logprobs
        return sampled, logprobs

    def _account(self, flight: InFlight, num_sampled: int) -> None:
        stats = self._stats
        stats.generated_tokens_total += num_sampled
        now = time.perf_counter()
        # The device runs steps back to back: a step's time is from its launch,
        # or from the completion of the step before if that came later.
        seconds = now - max(flight.launched_at, self._last_completed_at)
        self._last_completed_at = now
        self.step_times.completed(flight, now)
        num_tokens = flight.prefill_tokens + flight.decode_tokens
        # The step's wall time, shared between prefill and decode by token
        # count: llama.cpp's prompt/predicted seconds for a mixed batch.
        prefill_seconds = seconds * flight.prefill_tokens / num_tokens
        stats.prefill_tokens_total += flight.prefill_tokens
        stats.prefill_seconds_total += prefill_seconds
        # The prefill rate a disk restore is weighed against (restore_cost.py).
        self.scheduler.kv.note_prefill(flight.prefill_tokens, prefill_seconds)
        stats.decode_seconds_total += seconds * flight.decode_tokens / num_tokens
        stats.forward_passes_total += 1
        stats.busy_slots_total += len(flight.out.chunks)

    def _fail(self, request_id: str, message: str) -> None:
        """End a running request with a request error (its grammar cannot go on)."""
        self.scheduler.abort([request_id])  # nothing to do if it just finished
        self._forget(request_id)
        self.emit(RequestError(request_id, ErrorCode.INVALID_REQUEST, message))

    def _forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)
        self.grammar.forget(request_id)
        self.forced.forget(request_id)
        self.runner.forget(request_id)

    def _output(self, seq: Sequence, tokens: list[int],
                logprobs: list[TokenLogprobs] | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=tokens,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=logprobs or [],
            cache_hits=_take_cache_hits(seq),
        )

    def _scored(self, seq: Sequence, scores: PromptScores) -> RequestOutput:
        """Log probabilities of prompt tokens (no tokens, no finish reason)."""
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=[],
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            prompt_logprobs=scores.entries(),
            cache_hits=_take_cache_hits(seq),
        )

    def _progress(self, seq: Sequence, computed: int) -> RequestOutput:
        """A prompt-progress report: no tokens, no finish reason; prompt tokens
        found in the prefix cache count as computed."""
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=[],
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_computed_tokens=computed,
            cache_hits=_take_cache_hits(seq),
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
        stats.partial_kv_hits_total = scheduler.kv.partial.hits
        stats.partial_kv_hit_tokens_total = scheduler.kv.partial.hit_tokens
        if scheduler.kv.host is not None:
            scheduler.kv.host.report(stats)
        if scheduler.kv.disk is not None:
            scheduler.kv.disk.report(stats)
        stats.steps_total = self.step_count
        outputs, self._pending = self._pending, []
        # The output thread encodes later, after this loop has moved on: send a copy.
        self.emit(StepOutputs(self.step_count, outputs, msgspec.structs.replace(stats)))
