"""Scoring a rerank's prompts on an engine: one engine request per document.

Each request generates one greedy token and asks for the raw log
probabilities of the judge's "yes" and "no" at that position
(SamplingParams.logprob_token_ids); the token itself is not read. The
requests are submitted together, up to the engine's lane count at a time, so
continuous batching runs them side by side (and the shared start of their
prompts can come from the prefix cache) without one rerank filling the
engine's queue ahead of other clients' requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from protocol import SamplingParams
from router.engine_client import EngineClient, EngineFailure
from router.rerank.judge import Judge, relevance


def judge_params(judge: Judge) -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=0,
                          logprob_token_ids=[judge.yes_id, judge.no_id])


async def score_prompts(client: EngineClient, judge: Judge, prompts: Sequence[list[int]],
                        request_id: str, width: int) -> list[float]:
    """The relevance of each prompt, in order. Raises EngineFailure when the
    engine refuses or loses one; the others are aborted then, and so are all
    when the caller is cancelled (its client went away)."""
    params = judge_params(judge)
    lanes = asyncio.Semaphore(max(width, 1))

    async def score(index: int, prompt: list[int]) -> float:
        async with lanes:
            stream = client.submit(f"{request_id}-{index}", prompt, params)
            try:
                while outputs := await stream.take():
                    for output in outputs:
                        if output.logprobs:
                            yes, no = output.logprobs[-1].named_logprobs
                            return relevance(yes, no)
            finally:
                stream.abort()  # nothing to do once it has finished
        raise EngineFailure(f"the engine ended document {index}'s request without its "
                            "log probabilities")

    tasks = [asyncio.ensure_future(score(index, prompt)) for index, prompt in enumerate(prompts)]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        # Collected, so that no other failure is left unretrieved.
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
