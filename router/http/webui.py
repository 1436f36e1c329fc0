"""The web page (docs/webui.md): router/webui/ served at GET / and GET /ui/{name}.

Only the files shipped in the package folder are served, looked up by their
exact name among those listed at start: a name that is not one of them (any
path, `..`, an encoded slash) is a 404 and never reaches the filesystem. The
files are read once and kept in memory (they are a few tens of KB), each with
an ETag, so a browser revalidates (Cache-Control: no-cache) and gets a 304
when nothing changed: a new version of the server is picked up at once.

The routes are open (router/http/route_info.py Access.OPEN): the page holds
no data, and every API call it makes carries the user's key.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from aiohttp import web

from router.http.errors import ApiError

WEBUI_DIR = Path(__file__).resolve().parent.parent / "webui"

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    # RFC 9239: ES modules must come with a JavaScript type or browsers refuse them.
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}

# A plain file name: no separators, no dots but the extension's.
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*\.(html|js|css|svg)$")

# What the page may do: its own scripts and styles only, API calls to this
# server only; no inline script (model output is never HTML, but should a
# renderer slip, nothing injected could run), no framing (clickjacking).
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


@cache
def assets() -> dict[str, Asset]:
    """Every servable file of the package folder, by name (read on first use)."""
    found: dict[str, Asset] = {}
    for path in sorted(WEBUI_DIR.iterdir()):
        if not path.is_file() or not _NAME.match(path.name):
            continue
        body = path.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
        found[path.name] = Asset(body, CONTENT_TYPES[path.suffix], etag)
    return found


def _answer(request: web.Request, name: str) -> web.Response:
    asset = assets().get(name)
    if asset is None:
        raise ApiError(404, f"no such file: {request.path}", code="not_found")
    headers = {"ETag": asset.etag, "Cache-Control": "no-cache", **SECURITY_HEADERS}
    if asset.etag in request.headers.get("If-None-Match", ""):
        return web.Response(status=304, headers=headers)
    return web.Response(body=asset.body, headers={**headers, "Content-Type": asset.content_type})


async def index(request: web.Request) -> web.Response:
    return _answer(request, "index.html")


async def asset(request: web.Request) -> web.Response:
    return _answer(request, request.match_info["name"])


def serves_page(request: web.Request) -> bool:
    """Whether the request is for the page's own files (which need no model)."""
    handler = getattr(request.match_info, "handler", None)
    return handler is index or handler is asset
