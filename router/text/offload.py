"""A small thread pool for the router's CPU-heavy text work.

Rendering a long conversation, detokenizing a million ids or spelling out
each token's piece takes the router's CPU for as long as it runs; on the
event loop it would stall every route, /health included. Run here, the loop
stays free: `tokenizers` releases the GIL while it encodes and batch-decodes,
and pure-Python work yields the GIL every switch interval (5 ms). The pool
leaves a core to the event loop (one worker on a machine of two cores, at
most four): the GIL lets one Python thread run at a time anyway, and each
busy worker adds to how long the loop waits for the GIL and for a core.
Long jobs are cut into chunks by their callers where they can be, so one
request does not hold a worker for long while others queue
(router/llamacpp/tokens.py).

How many requests may queue here is bounded where they come in:
--max-token-count-requests for the token-counting routes, the lanes and the
admission queue for generation.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

TEXT_WORKERS = max(1, min(4, (os.cpu_count() or 2) - 1))

T = TypeVar("T")

_executor: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(TEXT_WORKERS, thread_name_prefix="roundhouse-text")
    return _executor


async def off_loop(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on the text pool; its exceptions reach the caller."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool(), functools.partial(fn, *args, **kwargs))
