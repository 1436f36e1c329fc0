"""/props reports whether a model runs batch-invariant (--deterministic),
from its settings: nothing is loaded to answer."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from protocol import EngineOptions
from router.app import create_app
from router.catalog import Catalog, CatalogEntry
from router.config import ServeConfig
from router.lifecycle.manager import ModelManager
from router.settings import ModelSettings
from tests.support.simulated_devices import NoDevices


def test_props_report_the_mode_per_model(qwen3_tokenizer_dir: Path) -> None:
    async def run() -> None:
        def entry(name: str, deterministic: bool) -> CatalogEntry:
            settings = ModelSettings(engine=EngineOptions(deterministic=deterministic))
            return CatalogEntry(name, qwen3_tokenizer_dir, "hf", settings)

        catalog = Catalog({"fixed": entry("fixed", True), "fast": entry("fast", False)})
        manager = ModelManager(catalog, ServeConfig(models_dir=qwen3_tokenizer_dir.parent),
                               probe=NoDevices())
        async with TestClient(TestServer(create_app(manager))) as client:
            for model, expected in (("fixed", True), ("fast", False)):
                response = await client.get(f"/props?model={model}")
                assert response.status == 200
                assert (await response.json())["deterministic"] is expected

    asyncio.run(run())
