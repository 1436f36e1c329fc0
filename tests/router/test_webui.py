"""The web page (router/webui/, docs/webui.md): served at / and /ui/{name} by
a real router app, with the right types, nothing outside the package folder,
open with API keys, off with --no-webui; and its files all present."""

from __future__ import annotations

import asyncio
import re
import tomllib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from router.app import create_app
from router.catalog import Catalog, CatalogEntry
from router.cli import parse_serve_command
from router.config import ServeConfig
from router.http.webui import WEBUI_DIR, assets
from router.lifecycle.manager import ModelManager
from tests.support.simulated_devices import NoDevices

ROOT = Path(__file__).resolve().parents[2]


def serve(config: ServeConfig, check: Callable[[TestClient], Awaitable[None]]) -> None:
    """Run `check` against a router app with one stand-in model (never loaded)."""

    async def run() -> None:
        catalog = Catalog({"m": CatalogEntry("m", Path("/models/m.gguf"), "gguf")})
        manager = ModelManager(catalog, config, probe=NoDevices())
        async with TestClient(TestServer(create_app(manager))) as client:
            await check(client)

    asyncio.run(run())


def router_config(**fields: Any) -> ServeConfig:
    return ServeConfig(models_dir=Path("/models"), **fields)


async def raw_get(client: TestClient, target: str) -> tuple[int, bytes]:
    """A request line sent as written: no client-side normalization of `..`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
    writer.write(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    answer = await reader.read()
    writer.close()
    status = int(answer.split(b" ", 2)[1])
    return status, answer


def test_the_page_and_its_files_come_with_their_types() -> None:
    async def check(client: TestClient) -> None:
        page = await client.get("/")
        assert page.status == 200
        assert page.headers["Content-Type"] == "text/html; charset=utf-8"
        body = await page.text()
        assert '<script type="module" src="/ui/app.js"></script>' in body
        # Browsers revalidate, and nothing foreign runs on the page.
        assert page.headers["Cache-Control"] == "no-cache"
        assert "script-src 'self'" in page.headers["Content-Security-Policy"]
        assert page.headers["X-Content-Type-Options"] == "nosniff"
        again = await client.get("/", headers={"If-None-Match": page.headers["ETag"]})
        assert again.status == 304
        for name, kind in [("app.js", "text/javascript"), ("style.css", "text/css"),
                           ("index.html", "text/html"), ("icon.svg", "image/svg+xml")]:
            answer = await client.get(f"/ui/{name}")
            assert answer.status == 200, name
            assert answer.headers["Content-Type"].split(";")[0] == kind
            assert await answer.read() == (WEBUI_DIR / name).read_bytes()
        head = await client.head("/ui/chat.js")
        assert head.status == 200
        assert head.headers["Content-Type"].startswith("text/javascript")

    serve(router_config(), check)


def test_only_the_package_folder_files_are_served() -> None:
    secret = (ROOT / "pyproject.toml").read_bytes()[:40]

    async def check(client: TestClient) -> None:
        for target in ["/ui/../pyproject.toml", "/ui/../../pyproject.toml",
                       "/ui/..%2F..%2Fpyproject.toml", "/ui/%2e%2e/http/webui.py",
                       "/ui/..%2fhttp%2fwebui.py", "/ui/%2Fetc%2Fpasswd", "/ui/missing.js",
                       "/ui/sub/app.js", "/ui/", "/ui/.app.js", "/ui/app.js%00.html",
                       "/ui/APP.JS", "/ui/..", "/ui/app.js/"]:
            status, answer = await raw_get(client, target)
            assert status in (400, 404), (target, status)
            assert secret not in answer, target
            assert b"from __future__" not in answer, target
        # And the error says so in llama.cpp's shape, as other unknown paths do.
        missing = await client.get("/ui/missing.js")
        assert (await missing.json())["error"]["code"] == 404

    serve(router_config(), check)


def test_no_webui_turns_the_page_off() -> None:
    async def check(client: TestClient) -> None:
        assert (await client.get("/")).status == 404
        assert (await client.get("/ui/app.js")).status == 404
        assert (await client.get("/health")).status == 200

    serve(router_config(webui=False), check)
    assert parse_serve_command(["serve", "--models-dir", "/m", "--no-webui"]).webui is False
    assert parse_serve_command(["serve", "--models-dir", "/m"]).webui is True


def test_the_page_is_open_with_keys_and_the_api_is_not() -> None:
    async def check(client: TestClient) -> None:
        assert (await client.get("/")).status == 200
        assert (await client.get("/ui/api.js")).status == 200
        assert (await client.get("/models")).status == 401
        keyed = await client.get("/models", headers={"Authorization": "Bearer sk-page"})
        assert keyed.status == 200

    serve(router_config(api_keys=("sk-page",)), check)


def test_a_loading_single_model_server_serves_the_page() -> None:
    # The page needs no model; the API answers 503 until the model is ready,
    # and the page shows that and retries.
    async def check(client: TestClient) -> None:
        assert (await client.get("/")).status == 200
        assert (await client.get("/ui/app.js")).status == 200
        assert (await client.get("/models")).status == 503

    serve(ServeConfig(model=Path("/models/m.gguf")), check)


# ---- the files themselves ---------------------------------------------------------------

# `import x from "..."`, `import {a, b} from`, `import * as c from`, `import "..."`,
# `export {d} from`, `export * from`: a module's static imports, over several lines too.
IMPORT = re.compile(r"^\s*(?:import\s+(?:[\w$*{}\s,]+?\s*from\s*)?"
                    r"|export\s*(?:\*|\{[^}]*\})\s*from\s*)"
                    r"[\"']([^\"']+)[\"']", re.M)
PAGE_REF = re.compile(r"""(?:src|href)="([^"#]+)\"""")


def imports_of(name: str) -> list[str]:
    return IMPORT.findall((WEBUI_DIR / name).read_text())


def test_every_module_the_page_imports_is_shipped() -> None:
    page = (WEBUI_DIR / "index.html").read_text()
    refs = PAGE_REF.findall(page)
    assert "/ui/app.js" in refs and "/ui/style.css" in refs
    # Nothing from elsewhere: no CDN, fonts or scripts off this server.
    for ref in refs:
        assert ref.startswith("/ui/") and ref.removeprefix("/ui/") in assets(), ref
    assert not re.search(r"url\(|@import", (WEBUI_DIR / "style.css").read_text())
    seen: set[str] = set()
    todo = ["app.js"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for target in imports_of(name):
            assert target.startswith("./"), f"{name} imports {target}: only ./x.js modules"
            module = target.removeprefix("./")
            assert module in assets(), f"{name} imports {target}, which is not shipped"
            todo.append(module)
    # No module lies unused.
    assert seen == {path.name for path in WEBUI_DIR.glob("*.js")}


def test_the_import_check_sees_every_form() -> None:
    # So the check above cannot pass by reading nothing.
    assert imports_of("app.js") == ["./catalog.js", "./chat.js", "./models.js"]
    assert "./storage.js" in imports_of("chat.js")
    text = ('import { a } from "./a.js";\nimport * as b from "./b.js";\nimport "./c.js";\n'
            'export { d } from "./d.js";\nimport {\n  f,\n  g,\n} from "./f.js";\n'
            'const e = "./e.js";\nexport function h(n) { return typeof n === "number"; }\n')
    assert IMPORT.findall(text) == ["./a.js", "./b.js", "./c.js", "./d.js", "./f.js"]


def test_the_wheel_ships_the_files_and_they_stay_small() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["router"]
    shipped = {path.name for pattern in patterns for path in (ROOT / "router").glob(pattern)}
    assert set(assets()) <= shipped
    assert {"index.html", "app.js", "style.css"} <= set(assets())
    assert sum(len(asset.body) for asset in assets().values()) < 200_000
