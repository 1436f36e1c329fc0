"""llama.cpp's /slots: GET /slots and POST /slots/{id}?action=save|restore|erase.

A slot is one of the engine's lanes (engine/scheduling/lanes.py). GET /slots
lists them in llama.cpp's shape: the request each runs or last ran, its
sampling settings and prompt. Save writes the KV of a lane's tokens to a file
under the model's --slot-save-path; restore reads one back into the prefix
cache (an ordinary entry any request with that prefix reuses); erase drops a
lane's pages from the caches (engine/scheduling/slot_actions.py).

In router mode ?model= names the model (llama.cpp's router requires it); a
single-model server uses its one model. The model is loaded (or woken) for an
action unless ?autoload=0; listing a model that is not running lists nothing
and loads nothing. Actions on one lane are serialised here (one lock per model
and lane); the engine also waits for a busy lane to be free, as llama.cpp
defers the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from protocol import LaneState, SlotCommand, SlotReply
from router.engine_client import EngineFailure
from router.http.errors import ApiError
from router.http.keys import MANAGER
from router.lifecycle import ModelManager, ModelSlot
from router.lifecycle.slot import ModelState
from router.llamacpp.params import completion_settings, generation_settings
from router.llamacpp.schemas import CompletionRequest
from router.openai.common import autoload
from router.supervisor import EngineProcess

# llama.cpp's fs_validate_filename, as the issue states it: 1-128 characters
# of [A-Za-z0-9._-], no leading or trailing dot (so no "." or ".."), and no
# separators: a file directly in the save directory.
_FILENAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
ACTIONS = ("save", "restore", "erase")

_locks: weakref.WeakKeyDictionary[ModelManager, dict[tuple[str, int], asyncio.Lock]] = (
    weakref.WeakKeyDictionary())


def valid_filename(name: object) -> bool:
    return (isinstance(name, str) and _FILENAME.fullmatch(name) is not None
            and not name.startswith(".") and not name.endswith("."))


def slot_file(directory: str, name: str) -> Path:
    """The file a valid name means: an existing file of the directory whose
    name equals it ignoring case, else the name itself (names are compared
    case-insensitively, so "A.bin" and "a.bin" are one session everywhere)."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    wanted = name.lower()
    for entry in folder.iterdir():
        if entry.name.lower() == wanted and entry.is_file():
            return entry
    return folder / name


def _model(manager: ModelManager, request: web.Request) -> ModelSlot:
    name = request.query.get("model")
    if not manager.single and not name:
        raise ApiError(400, "model name is missing from the request", param="model")
    return manager.resolve(name)


def _not_supported(message: str) -> ApiError:
    return ApiError(501, message, type="not_supported_error", code="not_supported")


@contextlib.asynccontextmanager
async def _engine(manager: ModelManager, slot: ModelSlot, request: web.Request
                  ) -> AsyncIterator[EngineProcess]:
    """The model's engine, loaded (or woken) and held while the action runs,
    without taking a request lane (the engine defers a busy slot itself)."""
    lifecycle = manager.lifecycle(slot)
    await lifecycle.acquire(autoload(request),
                            time.monotonic() + manager.config.pending_timeout_ms / 1000)
    try:
        engine = slot.engine
        assert engine is not None
        yield engine
    finally:
        lifecycle.release_use()


async def _ask(engine: EngineProcess, command: SlotCommand) -> SlotReply:
    try:
        return await engine.client.slot_action(command)
    except EngineFailure as exc:
        raise ApiError(503, str(exc), code="engine_failed") from None


async def get_slots(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    slot = _model(manager, request)
    if not slot.entry.settings.slots_endpoint:
        raise _not_supported("This server does not support slots endpoint.")
    lanes: list[LaneState] = []
    if slot.state is ModelState.LOADED and slot.engine is not None:
        reply = await _ask(slot.engine, SlotCommand(uuid.uuid4().hex, "list"))
        lanes = reply.lanes
    if request.query.get("fail_on_no_slot") in ("1", "true") and all(lane.is_processing for lane in lanes):
        raise ApiError(503, "no slot available", code="unavailable")
    text = await manager.text_for(slot)
    n_ctx = slot.ready.kv.max_context if slot.ready is not None else 0
    return web.json_response([_lane_body(lane, n_ctx, text.tokenizer) for lane in lanes])


def _lane_body(lane: LaneState, n_ctx: int, tokenizer: Any) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if lane.params is not None:
        req = CompletionRequest(prompt="")
        params = generation_settings(req, completion_settings(req), lane.params)
        params["n_predict"] = lane.params.max_tokens
    prompt_ids = lane.token_ids[: lane.num_prompt_tokens]
    n_decoded = max(len(lane.token_ids) - lane.num_prompt_tokens, 0)
    n_remain = (lane.params.max_tokens - n_decoded) if lane.params is not None else -1
    return {
        "id": lane.id,
        # llama.cpp's task ids are numbers; ours are the request ids.
        "id_task": -1,
        "request_id": lane.request_id,
        "n_ctx": n_ctx,
        "speculative": False,
        "is_processing": lane.is_processing,
        "params": params,
        "prompt": tokenizer.decode(prompt_ids, skip_special_tokens=False),
        "n_past": lane.num_computed_tokens,
        "next_token": {"has_next_token": lane.is_processing, "has_new_line": False,
                       "n_remain": n_remain if lane.is_processing else -1,
                       "n_decoded": n_decoded},
    }


async def post_slot(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    slot = _model(manager, request)
    settings = slot.entry.settings
    action = request.query.get("action", "")
    try:
        id_slot = int(request.match_info["id_slot"])
    except ValueError:
        raise ApiError(400, "Invalid slot ID", param="id_slot") from None
    if action not in ACTIONS:
        raise ApiError(400, "Invalid action", param="action")
    filename = ""
    path = ""
    if action != "erase":
        # As llama.cpp: without a save directory, save and restore do not exist.
        if not settings.slot_save_path:
            raise _not_supported("This server does not support slots action. Start it with "
                                 "`--slot-save-path`")
        try:
            body = msgspec.json.decode(await request.read() or b"{}")
        except msgspec.DecodeError:
            raise ApiError(400, "the body is not valid JSON") from None
        filename = body.get("filename") if isinstance(body, dict) else None
        if not valid_filename(filename):
            raise ApiError(400, "Invalid filename", param="filename")
        path = str(slot_file(settings.slot_save_path, filename))  # type: ignore[arg-type]
    lock = _locks.setdefault(manager, {}).setdefault((slot.id, id_slot), asyncio.Lock())
    async with lock, _engine(manager, slot, request) as engine:
        reply = await _ask(engine, SlotCommand(uuid.uuid4().hex, action, id_slot, path))  # type: ignore[arg-type]
    if reply.error:
        raise ApiError(400, reply.error, param="filename" if filename else "id_slot")
    if action == "erase":
        return web.json_response({"id_slot": id_slot, "n_erased": reply.num_tokens})
    ms = round(reply.seconds * 1000, 3)
    if action == "save":
        return web.json_response({"id_slot": id_slot, "filename": filename,
                                  "n_saved": reply.num_tokens, "n_written": reply.num_bytes,
                                  "timings": {"save_ms": ms}})
    return web.json_response({"id_slot": id_slot, "filename": filename,
                              "n_restored": reply.num_tokens, "n_read": reply.num_bytes,
                              "timings": {"restore_ms": ms}})
