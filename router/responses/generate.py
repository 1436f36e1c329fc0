"""One response being generated: its turn, its output items, its object.

Shared by the streamed and the whole answer, so both give the same items
and the same response object.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from router.chat.turn import TurnRun
from router.generation import PromptProgress
from router.http.errors import ApiError
from router.responses.logprobs import OutputLogprobs
from router.responses.output import Event, OutputAssembler
from router.responses.request_map import ResponsePlan
from router.responses.response import response_body, usage
from router.responses.store import ChainPin, ResponseStore, stored


class ResponseRun:
    def __init__(self, response_id: str, plan: ResponsePlan, run: TurnRun, model: str,
                 sampling: dict[str, float], pin: ChainPin):
        self.id = response_id
        # The conversation it continues, pinned in the store while it runs.
        self.pin = pin
        self.plan = plan
        self.run = run
        self.model = model
        self.sampling = sampling
        self.created_at = int(time.time())
        # include message.output_text.logprobs: the engine was asked for them.
        logprobs = OutputLogprobs(run) if plan.chat.sampling.logprobs >= 0 else None
        self.output = OutputAssembler(plan.tools, logprobs)

    async def events(self) -> AsyncIterator[Event]:
        """Output events as the turn produces them, the closing ones last.
        Raises EngineFailure when the engine refuses the request or dies, and
        ChainBroken as soon as the conversation it continues is deleted
        (then closing the turn aborts the engine request)."""
        self.pin.check()
        async for event in self.run.events():
            self.pin.check()
            if isinstance(event, PromptProgress):
                continue  # the Responses API has no prompt progress event
            for out in self.output.feed(event):
                yield out
        for out in self.output.finish(incomplete=self.incomplete):
            yield out

    @property
    def incomplete(self) -> bool:
        # Cut by max_output_tokens, or by the end of the context.
        return self.run.finish_reason == "length"

    def body(self, status: str, error: ApiError | None = None) -> dict[str, Any]:
        finished = status in ("completed", "incomplete")
        return response_body(
            self.id, created_at=self.created_at, model=self.model, echo=self.plan.echo,
            sampling=self.sampling, status=status,
            output=list(self.output.items) if status != "in_progress" else [],
            usage=usage(self.run) if finished else None,
            error=_error(error) if error is not None else None,
        )

    def final_body(self) -> dict[str, Any]:
        return self.body("incomplete" if self.incomplete else "completed")

    def keep(self, body: dict[str, Any], store: ResponseStore) -> None:
        """Store a finished response (unless the request said store: false).
        Raises ChainBroken, storing nothing, if the conversation it continues
        was deleted meanwhile: a stored response must be one that can be continued."""
        self.pin.check()
        if self.plan.store:
            store.put(stored(body, self.plan.input_items, self.plan.echo["previous_response_id"]))


def _error(error: ApiError) -> dict[str, Any]:
    # The codes a response's `error` may carry: a refused prompt, or our failure.
    code = "invalid_prompt" if error.status == 400 else "server_error"
    return {"code": code, "message": error.message}
