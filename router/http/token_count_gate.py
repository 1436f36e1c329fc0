"""A bound on token-counting requests served at once.

Counting tokens (Anthropic's count_tokens, Responses' and chat's input_tokens, llama.cpp's
/tokenize, /detokenize, /apply-template) never touches an engine, so lanes do
not bound it; rendering and tokenizing long prompts still costs the router
CPU. That work runs on the text pool beside the event loop, a few jobs at a
time (router/text/offload.py); this gate bounds how many requests may wait
for it, and so the memory they hold. At most --max-token-count-requests run
at once; the next is refused at once with 429 server_overloaded (529 on
Anthropic's route) — no queue.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from router.http.errors import ApiError

TOKEN_COUNT_PATHS = frozenset({
    "/v1/messages/count_tokens", "/v1/v1/messages/count_tokens",
    "/v1/responses/input_tokens", "/v1/v1/responses/input_tokens", "/responses/input_tokens",
    "/v1/chat/completions/input_tokens", "/v1/v1/chat/completions/input_tokens",
    "/chat/completions/input_tokens",
    "/tokenize", "/detokenize", "/apply-template",
})


def token_count_gate(limit: int) -> Any:
    active = 0

    @web.middleware
    async def gate(request: web.Request, handler: Any) -> web.StreamResponse:
        nonlocal active
        if request.path not in TOKEN_COUNT_PATHS:
            return await handler(request)
        if active >= limit:
            raise ApiError(429, f"{limit} token-counting requests are already being served; "
                           "try again shortly", code="server_overloaded", headers={"Retry-After": "1"})
        active += 1
        try:
            return await handler(request)
        finally:
            active -= 1

    return gate
