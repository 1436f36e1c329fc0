"""GET /models shows the routed experts an engine keeps in host memory beside,
not inside, what it holds on its device (router/http/models_api.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from protocol import MemoryFacts
from router.http.models_api import device_memory


def test_held_memory_shows_host_resident_experts_outside_the_footprint() -> None:
    memory = MemoryFacts(weights_bytes=3 << 30, kv_bytes=1 << 30, host_weights_bytes=40 << 30)
    slot: Any = SimpleNamespace(
        placement=SimpleNamespace(gpu=0, planned_bytes=6 << 30, engine_device="cuda:0"),
        ready=SimpleNamespace(memory=memory), state=SimpleNamespace(public="loaded"))
    shown = device_memory(SimpleNamespace(), slot)  # type: ignore[arg-type]
    assert shown["held"]["host_weights_bytes"] == 40 << 30
    assert shown["held"]["weights_bytes"] == 3 << 30
    assert shown["held"]["footprint_bytes"] == 4 << 30
