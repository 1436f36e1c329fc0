"""The router<->engine messages: one tagged union per direction.

Router -> engine: RouterCommand (Generate, Abort, GrammarVocab, Sleep, Wake,
Shutdown, SlotCommand).
Engine -> router: EngineEvent (LoadProgress, Ready, StepOutputs, RequestError,
Slept, Awake, SlotReply, EngineDead).

Every Struct is array_like (encoded as a msgpack array, no field names on the
wire) and tagged with a short string, so a decoder typed with the union picks
the right class. The engine sends one StepOutputs per step carrying every
request's new token ids.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from protocol.errors import ErrorCode
from protocol.sampling import FinishReason, SamplingParams

# Bumped whenever a message changes shape; Ready carries the engine's value and
# the router refuses an engine that speaks another one.
PROTOCOL_VERSION = 17

_STRUCT: dict[str, Any] = {"array_like": True, "omit_defaults": True, "gc": False}


# ---- router -> engine ---------------------------------------------------------


class ImageInput(msgspec.Struct, **_STRUCT):
    """One image of a prompt, decoded and resized by the router to the vision
    tower's patch grid (router/media/loader.py): the engine normalises and
    cuts the pixels into patches itself (engine/models/vision/patches.py).

    offset: the index in prompt_token_ids of the first of its
    grid_t * grid_h * grid_w / merge_size**2 image tokens, which follow each
    other. digest: sha256 over the grid and pixels; the prefix cache keys
    the image's tokens by it, so a later turn over the same image reuses
    them and a different image never does.
    """

    offset: int
    grid_t: int
    grid_h: int
    grid_w: int
    width: int
    height: int
    digest: bytes
    rgb: bytes

    def num_tokens(self, merge_size: int) -> int:
        """Its image tokens in the prompt: one per merge_size x merge_size patches."""
        return self.grid_t * self.grid_h * self.grid_w // merge_size**2


class Generate(msgspec.Struct, tag="gen", **_STRUCT):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # llama.cpp's id_slot: run in this lane (waiting until it is free), so
    # the lane's saved session is this request's (engine/scheduling/lanes.py).
    id_slot: int = -1
    # The prompt's images, by offset (only for a model served with --vision).
    images: list[ImageInput] = []


class Abort(msgspec.Struct, tag="abort", **_STRUCT):
    request_ids: list[str]


class GrammarVocab(msgspec.Struct, tag="vocab", **_STRUCT):
    """The tokenizer's vocabulary as xgrammar needs it, sent once before the
    first request with a grammar (the router owns the tokenizer).

    tokens[i] is token i as stored in the tokenizer (byte-level BPE tokens in
    their mapped form, "Ġthe"; SentencePiece tokens with "▁" and <0xNN>);
    vocab_type tells xgrammar how to read them back into bytes.
    eos_token_ids are the model's end-of-sequence ids, the tokens a grammar
    may end with: the router's, as every request's stop_token_ids are (the
    engine derives no token ids of its own).
    """

    tokens: list[str]
    vocab_type: Literal["raw", "byte_fallback", "byte_level"]
    eos_token_ids: list[int]
    add_prefix_space: bool = False


class Sleep(msgspec.Struct, tag="sleep", **_STRUCT):
    """Release device memory, keep the process and its host-side state.

    Sent only when the engine has no requests. Cached KV pages (the prefix
    cache: conversations) are copied to host memory and restored on wake.
    weights: "host" keeps them in (pinned) host memory for a fast wake;
    "disk" drops them and reads the model file again on wake.
    """

    weights: Literal["host", "disk"] = "disk"


class Wake(msgspec.Struct, tag="wake", **_STRUCT):
    pass


class Shutdown(msgspec.Struct, tag="shutdown", **_STRUCT):
    pass


class SlotCommand(msgspec.Struct, tag="slot", **_STRUCT):
    """llama.cpp's /slots on one engine: list the lanes, or save, restore or
    erase one lane's KV (path: the file, already validated by the router).
    Answered by one SlotReply with the same action_id; an action on a lane
    that is processing waits until it is free, as llama.cpp defers it."""

    action_id: str
    action: Literal["list", "save", "restore", "erase"]
    id_slot: int = -1
    path: str = ""


RouterCommand = Generate | Abort | GrammarVocab | Sleep | Wake | Shutdown | SlotCommand


# ---- engine -> router ---------------------------------------------------------


class ModelFacts(msgspec.Struct, **_STRUCT):
    architecture: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_params: int
    size_bytes: int
    dtype: str
    device: str
    # How embedding requests should pool (SamplingParams.pooling): --pooling,
    # else the model's own sentence-transformers or GGUF setting, else "last".
    pooling: str = "last"


class KvFacts(msgspec.Struct, **_STRUCT):
    page_size: int
    num_pages: int
    max_context: int
    max_concurrency: int
    max_batched_tokens: int
    bytes_per_token: int

    @property
    def capacity_tokens(self) -> int:
        return self.page_size * self.num_pages


class MemoryFacts(msgspec.Struct, frozen=True, **_STRUCT):
    """What the engine holds on its device once loaded, by kind (bytes): the
    router's device ledger plans other models around it. On the CPU the same
    kinds in host memory (activations and graphs are 0 there).
    host_weights_bytes: routed experts kept in host memory (--expert-residency
    host, --n-cpu-moe), which the device does not hold: not in the footprint."""

    weights_bytes: int = 0
    kv_bytes: int = 0
    activation_bytes: int = 0
    workspace_bytes: int = 0
    graph_bytes: int = 0
    host_weights_bytes: int = 0

    @property
    def footprint_bytes(self) -> int:
        return (self.weights_bytes + self.kv_bytes + self.activation_bytes
                + self.workspace_bytes + self.graph_bytes)


class LoadProgress(msgspec.Struct, tag="progress", **_STRUCT):
    fraction: float
    message: str


class Ready(msgspec.Struct, tag="ready", **_STRUCT):
    protocol_version: int
    pid: int
    model: ModelFacts
    kv: KvFacts
    load_seconds: float
    memory: MemoryFacts = MemoryFacts()


class TokenLogprobs(msgspec.Struct, **_STRUCT):
    """One sampled token's log probability and, if asked, the most likely
    tokens' at its position (most likely first), from the model's raw
    distribution (SamplingParams.logprobs)."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []
    # Those of SamplingParams.logprob_token_ids at the same position, in
    # their order (rows that named none: empty).
    named_logprobs: list[float] = []


class CacheHits(msgspec.Struct, **_STRUCT):
    """Where a request's cached prompt tokens came from; they add up to its
    num_cached_tokens. device, host, disk: whole pages found in that tier;
    partial: the leading tokens of one more page, reused to the token."""

    device: int = 0
    host: int = 0
    disk: int = 0
    partial: int = 0


class RequestOutput(msgspec.Struct, **_STRUCT):
    request_id: str
    # Tokens sampled for this request in this step (empty while prefilling).
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    # Prompt tokens served from the prefix cache instead of computed.
    num_cached_tokens: int = 0
    # Prompt tokens processed so far (cached ones included); sent after each
    # prefill chunk when SamplingParams.report_progress is set.
    num_computed_tokens: int = 0
    # One per token of token_ids when SamplingParams.logprobs >= 0.
    logprobs: list[TokenLogprobs] = []
    # With SamplingParams.prompt_logprobs >= 0: those of the prompt tokens
    # this step scored, in order, continuing the ones sent before (the first
    # prompt token has none); all of them arrive before the first sampled token.
    prompt_logprobs: list[TokenLogprobs] = []
    # An embedding request's pooled, normalised vector (SamplingParams.pooling)
    # as little-endian float32 bytes, in its finishing output: packed, since a
    # list of floats costs 9 bytes each in msgpack and a Python float per value
    # on both sides, and OpenAI's base64 answer is these very bytes.
    embedding: bytes = b""
    # Set in the first output after the request's (first) admission.
    cache_hits: CacheHits | None = None
    # Speculative decoding: draft tokens this step verified for the request,
    # and how many of them are among token_ids (llama.cpp's draft_n and
    # draft_n_accepted, summed over its outputs).
    num_draft_tokens: int = 0
    num_draft_accepted: int = 0


class EngineStats(msgspec.Struct, **_STRUCT):
    running: int = 0
    prefilling: int = 0
    waiting: int = 0
    kv_pages_total: int = 0
    kv_pages_used: int = 0
    kv_pages_cached: int = 0
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    generated_tokens_total: int = 0
    preemptions_total: int = 0
    steps_total: int = 0
    # What GET /metrics (llama.cpp's llamacpp: series) is derived from. A
    # step's wall time is split between prefill and decode in proportion to
    # the tokens of each kind it computed.
    # Prompt tokens computed (cache hits excluded, recomputation after a
    # preemption included).
    prefill_tokens_total: int = 0
    prefill_seconds_total: float = 0.0
    decode_seconds_total: float = 0.0
    # Steps that ran the model, and the sum of their batch sizes (sequences).
    forward_passes_total: int = 0
    busy_slots_total: int = 0
    # Tokens whose K/V the running sequences hold now.
    kv_tokens_used: int = 0
    # The prefix cache's host tier (--host-kv-mib; all 0 when it is off).
    # Pages it can hold and holds now:
    host_kv_pages_total: int = 0
    host_kv_pages_cached: int = 0
    # Pages (and their tokens) admissions found there and copied back.
    host_kv_hit_pages_total: int = 0
    host_kv_hit_tokens_total: int = 0
    # Admissions whose lookup stopped at a page neither tier held.
    host_kv_misses_total: int = 0
    # Pages the device evicted and the tier took (a page it held already is
    # not stored again), and pages it evicted in turn to make room.
    host_kv_stored_pages_total: int = 0
    host_kv_evicted_pages_total: int = 0
    # Bytes copied device -> host (stores) and host -> device (hits).
    host_kv_bytes_to_host_total: int = 0
    host_kv_bytes_to_device_total: int = 0
    # The prefix cache's disk tier (--disk-kv-path; all 0 when it is off).
    # Its budget and what its files hold now:
    disk_kv_capacity_bytes: int = 0
    disk_kv_bytes_cached: int = 0
    disk_kv_pages_cached: int = 0
    # Pages (and their tokens) admissions read back from it.
    disk_kv_hit_pages_total: int = 0
    disk_kv_hit_tokens_total: int = 0
    # Admissions whose lookup stopped at a page no tier held or could read.
    disk_kv_misses_total: int = 0
    # Page files written, and deleted to stay within the budget.
    disk_kv_written_pages_total: int = 0
    disk_kv_evicted_pages_total: int = 0
    disk_kv_bytes_read_total: int = 0
    disk_kv_bytes_written_total: int = 0
    # Files found damaged or foreign (deleted); pages not written (a full
    # disk, a write error, the writer behind); pages not written because
    # their parent was not on disk (orphans); restores cut short by the
    # deadline; restores not started, judged slower than computing the same
    # tokens; seconds spent reading pages back.
    disk_kv_corrupt_pages_total: int = 0
    disk_kv_dropped_pages_total: int = 0
    disk_kv_orphan_pages_total: int = 0
    disk_kv_deadline_hits_total: int = 0
    disk_kv_skipped_total: int = 0
    disk_kv_restore_seconds_total: float = 0.0
    # Admissions that reused the leading tokens of one more page after their
    # whole pages (engine/kv/partial_pages.py), and the tokens so reused.
    partial_kv_hits_total: int = 0
    partial_kv_hit_tokens_total: int = 0
    # Speculative decoding (EngineOptions.spec): draft tokens verified, and
    # those accepted (each a token gained over plain decoding).
    draft_tokens_total: int = 0
    draft_accepted_tokens_total: int = 0


class StepOutputs(msgspec.Struct, tag="step", **_STRUCT):
    step: int
    outputs: list[RequestOutput]
    stats: EngineStats


class RequestError(msgspec.Struct, tag="error", **_STRUCT):
    request_id: str
    code: ErrorCode
    message: str


class Slept(msgspec.Struct, tag="slept", **_STRUCT):
    seconds: float
    # Cached KV pages kept in host memory for the wake.
    kept_pages: int
    # Device memory still held by the process after sleeping (CUDA: bytes
    # reserved by torch's allocator; CPU: 0, there is no separate device).
    device_bytes: int


class Awake(msgspec.Struct, tag="awake", **_STRUCT):
    seconds: float


class LaneState(msgspec.Struct, **_STRUCT):
    """One lane as GET /slots shows it: the request it runs (or last ran) and
    the tokens of that sequence (prompt and output so far)."""

    id: int
    is_processing: bool = False
    request_id: str = ""
    token_ids: list[int] = []
    num_prompt_tokens: int = 0
    # Tokens whose K/V the lane's sequence holds (llama.cpp's n_past).
    num_computed_tokens: int = 0
    params: SamplingParams | None = None


class SlotReply(msgspec.Struct, tag="slotrep", **_STRUCT):
    """The answer to a SlotCommand: error (empty on success; the file or
    request at fault, for a 400), tokens and bytes saved, restored or
    erased, the seconds it took; for "list", every lane."""

    action_id: str
    error: str = ""
    num_tokens: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    lanes: list[LaneState] = []


class EngineDead(msgspec.Struct, tag="dead", **_STRUCT):
    message: str
    traceback: str = ""


EngineEvent = (LoadProgress | Ready | StepOutputs | RequestError | Slept | Awake | SlotReply
               | EngineDead)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def command_decoder() -> msgspec.msgpack.Decoder[RouterCommand]:
    return msgspec.msgpack.Decoder(RouterCommand)


def event_decoder() -> msgspec.msgpack.Decoder[EngineEvent]:
    return msgspec.msgpack.Decoder(EngineEvent)
