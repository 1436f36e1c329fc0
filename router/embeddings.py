"""Embeddings as the router serves them, for OpenAI's POST /v1/embeddings and
llama.cpp's /embedding (router/openai/embeddings.py, router/llamacpp/embedding.py).

Each input is its own engine request (SamplingParams.pooling, max_tokens 0),
pooled the way the model's engine reported at load (Ready.model.pooling) and
normalised on the device. All of a request's inputs are submitted at once,
so the engine's continuous batching runs them together; their vectors come
back in input order as little-endian float32 bytes (RequestOutput.embedding).

Texts are tokenized as the model's tokenizer would for transformers: BOS
where it wants one, and the token its configuration appends (an embedding
model's EOS, which last-token pooling reads). Token-id inputs are taken as
they are. A request holds at most MAX_INPUTS inputs and MAX_TOTAL_TOKENS
tokens; each input fits the context (an embedding generates nothing, so it
may fill it).
"""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Sequence

from protocol import Pooling, SamplingParams
from router.engine_client import EngineClient, EngineFailure, RequestStream
from router.errors import ContextLengthExceeded, invalid
from router.generation import new_request_id
from router.lifecycle import ModelManager, ModelSlot
from router.observability.records import current_record
from router.text.model_text import ModelText
from router.text.offload import off_loop
from router.text.tokenizer import INLINE_ENCODE_CHARS

# OpenAI's bounds on one embeddings request.
MAX_INPUTS = 2048
MAX_TOTAL_TOKENS = 300_000


def is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool) for item in value)


def check_count(count: int, param: str) -> None:
    if count == 0:
        raise invalid(f"'{param}' is empty: give at least one input", param)
    if count > MAX_INPUTS:
        raise invalid(f"'{param}' holds {count} inputs; at most {MAX_INPUTS} per request", param)


async def encode_texts(text: ModelText, texts: Sequence[str], param: str) -> list[list[int]]:
    """Token ids of each text, as the model's tokenizer gives them with its
    special tokens; many or long texts are encoded off the event loop."""
    for index, item in enumerate(texts):
        if not item:
            raise invalid(f"'{param}[{index}]' is an empty string", param)
    if sum(len(item) for item in texts) <= INLINE_ENCODE_CHARS:
        return [with_specials(text, text.tokenizer.encode(item)) for item in texts]
    # One batch call: tokenizers lets go of the GIL and uses every core.
    encoded = await off_loop(text.tokenizer.backend.encode_batch_fast, list(texts),
                             add_special_tokens=False)
    return [with_specials(text, item.ids) for item in encoded]


def with_specials(text: ModelText, ids: list[int]) -> list[int]:
    """ids of a text with the model's BOS in front (if it wants one and the
    text does not start with it) and its appended EOS at the end (likewise)."""
    tokenizer = text.tokenizer
    if tokenizer.add_bos_token and ids[:1] != [tokenizer.bos_token_id]:
        ids.insert(0, tokenizer.bos_token_id)  # type: ignore[arg-type]
    eos = tokenizer.appended_eos_id
    if eos is not None and ids[-1:] != [eos]:
        ids.append(eos)
    return ids


def check_tokens(inputs: Sequence[list[int]], n_vocab: int, max_context: int, param: str) -> None:
    """Every input non-empty, in the vocabulary and within the context; the
    request within MAX_TOTAL_TOKENS."""
    total = 0
    for index, ids in enumerate(inputs):
        if not ids:
            raise invalid(f"'{param}[{index}]' holds no tokens", param)
        bad = next((t for t in ids if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise invalid(f"token id {bad} in '{param}[{index}]' is outside the vocabulary "
                          f"(0..{n_vocab - 1})", param)
        if len(ids) > max_context:
            raise ContextLengthExceeded(
                f"'{param}[{index}]' has {len(ids)} tokens; this model's context is "
                f"{max_context} tokens. Please reduce the length of the input.",
                n_prompt_tokens=len(ids), n_ctx=max_context, param=param)
        total += len(ids)
    if total > MAX_TOTAL_TOKENS:
        raise invalid(f"'{param}' holds {total} tokens in all; at most {MAX_TOTAL_TOKENS} per "
                      "request", param)


def check_normalize(value: int, param: str = "embd_normalize") -> None:
    if value < -1:
        raise invalid(f"'{param}' must be -1 (none), 0 (max absolute), 1 (taxicab), "
                      f"2 (Euclidean) or a p-norm p > 2; got {value}", param)


async def embed(client: EngineClient, request_id: str, inputs: Sequence[list[int]],
                pooling: Pooling, normalize: int = 2) -> list[bytes]:
    """Each input's vector (little-endian float32 bytes), in order. Raises
    EngineFailure when the engine refuses one or dies; the others are aborted."""
    record = current_record.get()
    if record is not None:
        record.engine_request_id = request_id
        record.prompt_tokens = sum(len(ids) for ids in inputs)
    params = SamplingParams(max_tokens=0, pooling=pooling, embd_normalize=normalize)
    # All submitted before any is awaited: the engine batches them.
    streams = [client.submit(f"{request_id}-{index}", list(ids), params)
               for index, ids in enumerate(inputs)]
    try:
        vectors = [await _vector(stream) for stream in streams]
    finally:
        for stream in streams:
            stream.abort()  # nothing to do for those that finished
    if record is not None:
        record.finish_reason = "stop"
    return vectors


async def _vector(stream: RequestStream) -> bytes:
    while True:
        outputs = await stream.take()
        if not outputs:
            raise EngineFailure(f"request {stream.request_id} ended without its embedding")
        final = outputs[-1]
        if final.finish_reason is not None:
            if not final.embedding:
                raise EngineFailure(f"request {stream.request_id} ended ({final.finish_reason}) "
                                    "without its embedding")
            return final.embedding


def as_floats(vector: bytes) -> list[float]:
    values = array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def as_base64(vector: bytes) -> str:
    """OpenAI's encoding_format "base64": the little-endian float32 bytes."""
    return base64.b64encode(vector).decode("ascii")


def check_dimensions(dimensions: int | None, n_embd: int) -> None:
    """OpenAI's `dimensions`: only the model's own size. A model must have been
    trained for shorter vectors (Matryoshka) for a cut one to mean anything,
    and nothing in its files says so."""
    if dimensions is not None and dimensions != n_embd:
        raise invalid(f"'dimensions' must be {n_embd}, this model's embedding size: it was not "
                      f"trained to give shorter embeddings (got {dimensions})", "dimensions")


async def run_embeddings(manager: ModelManager, slot: ModelSlot, inputs: Sequence[list[int]], *,
                         autoload: bool, param: str, normalize: int = 2,
                         dimensions: int | None = None) -> list[bytes]:
    """Hold the model (loading or waking it), check the inputs against what
    its engine reported, and embed them. Raises EngineFailure when the
    engine refuses or dies."""
    pooling: list[Pooling] = []

    def admit(loaded: ModelSlot) -> None:
        ready = loaded.ready
        assert ready is not None
        check_dimensions(dimensions, ready.model.n_embd)
        check_tokens(inputs, ready.model.n_vocab, loaded.max_context, param)
        pooling.append(ready.model.pooling)  # type: ignore[arg-type]

    async with manager.lease(slot, autoload=autoload, on_admit=admit) as engine:
        return await embed(engine.client, new_request_id("embd"), inputs, pooling[-1], normalize)
