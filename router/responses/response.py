"""The response object, in the shape the openai SDK's `Response` reads."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.chat.turn import TurnRun


def usage(run: TurnRun) -> dict[str, Any]:
    g = run.generation
    return {
        "input_tokens": g.prompt_tokens,
        "input_tokens_details": {"cached_tokens": g.cached_tokens},
        "output_tokens": g.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": run.reasoning_tokens},
        "total_tokens": g.prompt_tokens + g.completion_tokens,
    }


def response_body(
    response_id: str,
    *,
    created_at: int,
    model: str,
    echo: dict[str, Any],
    sampling: dict[str, float],
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`sampling` holds the temperature and top_p really used (the request's,
    else the model's defaults), as OpenAI reports them."""
    body: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": output,
        **echo,
        **sampling,
        "usage": usage,
    }
    if status == "completed":
        body["completed_at"] = int(time.time())
    return body
