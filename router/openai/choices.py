"""Several choices in one request: n samples of a prompt, best_of candidates,
and the prompts of a batched Completions request.

Each choice is its own engine request, so the engine batches them. The
choices of one prompt ("siblings") share its KV: the first is submitted
alone, the others once the engine has computed its prompt (its first token
came, Generation.prefilled), so the prefix cache serves them every full page
of the prompt and each computes only the last, partial page again. The
prompts of a batch run side by side from the start.

Sibling i samples with the request's seed + i (choice 0 is what n = 1 gives).
The first failure ends the request: its siblings are aborted, as they are
when the client leaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from router.engine_client import EngineFailure
from router.generation import Generation
from router.http.sse import EventStream

SEED_SPACE = 2**64


def sibling_seed(seed: int, index: int) -> int:
    """The seed of choice `index`: the request's plus the index, within 64 bits."""
    value = seed + index
    return value - SEED_SPACE if value >= SEED_SPACE else value


@dataclass(frozen=True)
class Sibling:
    generation: Generation
    # Consumes the generation to its end (and hands on what it makes).
    run: Callable[[], Awaitable[None]]


async def run_siblings(groups: Sequence[Sequence[Sibling]]) -> None:
    """Run every sibling: in each group (the choices of one prompt) the first
    at once and the others once the engine holds the first's prompt; the
    groups side by side. The first failure cancels the others and is raised
    (an EngineFailure before any other error); cancelling this cancels them.
    Every generation is closed on the way out: its engine request is aborted
    unless it finished."""
    try:
        async with asyncio.TaskGroup() as tasks:
            for group in groups:
                tasks.create_task(_run_group(tasks, group))
    except BaseExceptionGroup as failed:
        errors = list(failed.exceptions)
        raise next((e for e in errors if isinstance(e, EngineFailure)), errors[0]) from None
    finally:
        for group in groups:
            for sibling in group:
                sibling.generation.close()


async def _run_group(tasks: asyncio.TaskGroup, group: Sequence[Sibling]) -> None:
    first, *rest = group
    tasks.create_task(first.run())
    if rest:
        await first.generation.prefilled.wait()
        for sibling in rest:
            tasks.create_task(sibling.run())


async def stream_siblings(response: EventStream, groups: Sequence[Sequence[Sibling]],
                          outbox: asyncio.Queue[bytes | None]) -> EngineFailure | None:
    """Run the siblings (whose runs put their events in outbox) and write
    the events to response in the order they came, all that are at hand in
    one write. Returns the engine failure that ended them, if one did; a
    client that leaves (ConnectionResetError, raised) cancels them."""

    async def run() -> None:
        try:
            await run_siblings(groups)
        finally:
            outbox.put_nowait(None)

    runner = asyncio.create_task(run())
    try:
        ended = False
        while not ended:
            data = await outbox.get()
            if data is None:
                break
            batch = [data]
            while not outbox.empty():
                more = outbox.get_nowait()
                if more is None:
                    ended = True
                    break
                batch.append(more)
            await response.write(b"".join(batch))
        try:
            await runner
        except EngineFailure as exc:
            return exc
        return None
    finally:
        if not runner.done():
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
