"""The rerank handler: the request checked, the judge's prompts built, the
model leased, every document scored, the results sorted.

    {"model": "judge", "object": "list",
     "usage": {"prompt_tokens": 212, "total_tokens": 212},
     "results": [{"index": 1, "relevance_score": 0.93, "document": {"text": "..."}}, ...]}

Results are sorted by relevance_score, highest first (equal scores keep the
documents' order), and cut to top_n; `document` only with return_documents.
usage counts the judge prompts' tokens, as llama.cpp does.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from router.engine_client import EngineFailure
from router.errors import ContextLengthExceeded, InvalidRequest
from router.generation import new_request_id
from router.http.errors import decode_body, engine_error
from router.http.keys import MANAGER
from router.http.models_api import public_id
from router.lifecycle import ModelSlot
from router.observability.records import current_record
from router.openai.common import autoload
from router.rerank.judge import Judge
from router.rerank.request import RerankJob, RerankRequest, checked
from router.rerank.scoring import score_prompts


def not_enabled(model: str) -> InvalidRequest:
    # llama.cpp's words (it answers 501); a router names the model and the preset key.
    return InvalidRequest(f"This server does not support reranking with model '{model}'. Start "
                          "it with `--reranking` (in a preset: `reranking = true`)",
                          code="reranking_not_enabled", param="model")


def check_fits(prompts: list[list[int]], max_context: int) -> None:
    """Every judge prompt leaves room for the judge's one-token answer."""
    for index, prompt in enumerate(prompts):
        if len(prompt) >= max_context:
            raise ContextLengthExceeded(
                f"documents[{index}] makes a judge prompt of {len(prompt)} tokens; this model's "
                f"context is {max_context} tokens, which must also hold the answer. Shorten "
                "the document (or the query)", n_prompt_tokens=len(prompt), n_ctx=max_context,
                param=f"documents[{index}]")


def ranked(job: RerankJob, scores: list[float]) -> list[dict[str, Any]]:
    """The top_n results, highest score first; sorted() is stable, so equal
    scores keep the documents' order."""
    order = sorted(range(len(scores)), key=scores.__getitem__, reverse=True)[: job.top_n]
    results: list[dict[str, Any]] = []
    for index in order:
        result: dict[str, Any] = {"index": index, "relevance_score": scores[index]}
        if job.return_documents:
            result["document"] = {"text": job.documents[index]}
        results.append(result)
    return results


async def rerank(request: web.Request) -> web.Response:
    req = decode_body(await request.read(), RerankRequest)
    manager = request.app[MANAGER]
    slot = manager.resolve(req.model)
    if not slot.entry.settings.reranking:
        raise not_enabled(slot.id)
    job = checked(req)
    judge = Judge.of(slot.id, await manager.text_for(slot))
    prompts = await judge.prompts(job.instruction, job.query, job.documents)
    prompt_tokens = sum(map(len, prompts))
    request_id = new_request_id("rerank")
    record = current_record.get()
    if record is not None:
        record.engine_request_id, record.prompt_tokens = request_id, prompt_tokens

    def admit(loaded: ModelSlot) -> None:
        assert loaded.ready is not None
        n_vocab = loaded.ready.model.n_vocab
        if max(judge.yes_id, judge.no_id) >= n_vocab:
            # A tokenizer larger than the model's vocabulary: the engine would refuse it.
            raise InvalidRequest(f"model '{slot.id}': its tokenizer's \"yes\" and \"no\" "
                                 f"({judge.yes_id}, {judge.no_id}) lie outside the model's "
                                 f"vocabulary of {n_vocab}", code="reranking_not_supported",
                                 param="model")
        check_fits(prompts, loaded.max_context)

    async with manager.lease(slot, autoload=autoload(request), on_admit=admit) as engine:
        try:
            scores = await score_prompts(engine.client, judge, prompts, request_id,
                                         slot.lane_count)
        except EngineFailure as exc:
            raise engine_error(exc) from None
    return web.json_response({
        "model": public_id(manager, slot),
        "object": "list",
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        "results": ranked(job, scores),
    })
