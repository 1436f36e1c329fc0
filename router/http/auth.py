"""API keys: where they come from, how an attempt is checked, and the
middleware that asks for one (docs/security.md).

Keys come from --api-key (labels cli-1, cli-2, ...), ROUNDHOUSE_API_KEY
(env-1, ...) and --api-key-file (file-<label>, or file-<n> for the n-th key of
the file when its line has no label); the sources add up. Only SHA-256
digests are kept. A client sends `Authorization: Bearer KEY` or
`x-api-key: KEY`; the label of the key it used goes to its RequestRecord, the
key itself never leaves this module.

The key file is re-read when it changes (looked at, at most once a second, on
the request path) and on SIGHUP. A replacement that is empty, unreadable or
malformed closes every authenticated route until a valid file returns: a
botched rotation must lock clients out, never let everyone in.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from router import env
from router.config import ServeConfig
from router.http.errors import ApiError
from router.http.route_info import Access, route_of
from router.observability.records import current_record

log = logging.getLogger(__name__)

# How often the request path may stat the key file.
FILE_CHECK_SECONDS = 1.0
# A key file is a handful of lines; anything this big is the wrong file.
MAX_FILE_BYTES = 1 << 20
# Group or others may neither read the keys nor write new ones in.
_EXPOSED_MODE = stat.S_IRGRP | stat.S_IWGRP | stat.S_IROTH | stat.S_IWOTH
# Keys travel in HTTP headers: printable ASCII, no spaces.
_KEY = re.compile(r"[\x21-\x7e]+\Z")
# Labels end up in log lines and metric labels.
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
# A comment starts a line or follows whitespace, so a key may hold a '#'.
_COMMENT = re.compile(r"(?:^|\s)#.*")

# What identifies one version of the key file: device, inode, size, mtime and
# ctime (a chmod changes only the ctime, and it can make the file valid again).
Stamp = tuple[int, int, int, int, int]


class AuthConfigError(ValueError):
    """Keys that cannot be served; the message says why and never holds a key."""


class KeyFileError(AuthConfigError):
    def __init__(self, message: str, stamp: Stamp | None):
        super().__init__(message)
        self.stamp = stamp


@dataclass(frozen=True)
class KeyDigest:
    label: str
    digest: bytes


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "replace")).digest()


def _checked(key: str, where: str) -> bytes:
    if not key:
        raise AuthConfigError(f"{where}: the key is empty")
    if not _KEY.match(key):
        raise AuthConfigError(f"{where}: a key must be printable ASCII without spaces")
    return digest(key)


def labelled(keys: Sequence[str], prefix: str, source: str) -> list[KeyDigest]:
    """Keys of the command line or the environment: <prefix>-1, <prefix>-2, ..."""
    return [KeyDigest(f"{prefix}-{n}", _checked(key, f"{source} key {n}"))
            for n, key in enumerate(keys, 1)]


def parse_key_file(text: str) -> list[KeyDigest]:
    """One key per line, optionally `label: key`; `#` comments and blank lines
    are skipped. A key holding ':' therefore needs a label in front."""
    entries: list[KeyDigest] = []
    labels: set[str] = set()
    lines_of: dict[bytes, int] = {}
    for number, raw in enumerate(text.removeprefix("\ufeff").splitlines(), 1):
        line = _COMMENT.sub("", raw).strip()
        if not line:
            continue
        name, colon, key = line.partition(":")
        if colon:
            name, key = name.strip(), key.strip()
            if not _LABEL.match(name):
                raise AuthConfigError(f"line {number}: a label is up to 64 letters, digits, "
                                      "'_', '.' or '-'")
        else:
            name, key = str(len(entries) + 1), line
        key_digest = _checked(key, f"line {number}")
        if name in labels:
            raise AuthConfigError(f"line {number}: the label {name!r} is used twice")
        if key_digest in lines_of:
            raise AuthConfigError(f"line {number}: the same key as line {lines_of[key_digest]}")
        labels.add(name)
        lines_of[key_digest] = number
        entries.append(KeyDigest(f"file-{name}", key_digest))
    if not entries:
        raise AuthConfigError("it holds no keys")
    return entries


def _stamp(info: os.stat_result) -> Stamp:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def current_stamp(path: Path) -> Stamp | None:
    try:
        return _stamp(os.stat(path))
    except OSError:
        return None


def read_key_file(path: Path) -> tuple[list[KeyDigest], Stamp]:
    """The keys of the file and the stamp of the version read; KeyFileError
    says why there are none."""
    try:
        # O_NONBLOCK: a FIFO given by mistake must not hang the event loop.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise KeyFileError(f"cannot open it: {exc.strerror}", current_stamp(path)) from None
    try:
        info = os.fstat(fd)
        stamp = _stamp(info)
        if not stat.S_ISREG(info.st_mode):
            raise KeyFileError("it is not a regular file", stamp)
        if info.st_mode & _EXPOSED_MODE:
            raise KeyFileError(f"it is readable or writable by group or others "
                               f"(mode {stat.S_IMODE(info.st_mode):03o}); chmod 600 it", stamp)
        # As OpenSSH asks of authorized_keys: another user who owns the file
        # can chmod it and write keys of their own in.
        if info.st_uid not in (os.geteuid(), 0):
            raise KeyFileError(f"it is owned by uid {info.st_uid}, neither the user the server "
                               f"runs as (uid {os.geteuid()}) nor root; chown it", stamp)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as file:
        data = file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise KeyFileError(f"it is larger than {MAX_FILE_BYTES >> 20} MiB", stamp)
    try:
        return parse_key_file(data.decode("utf-8")), stamp
    except UnicodeDecodeError:
        raise KeyFileError("it is not UTF-8 text", stamp) from None
    except AuthConfigError as exc:
        raise KeyFileError(str(exc), stamp) from None


class KeyStore:
    """The digests of every configured key, and the key file's state."""

    def __init__(self, fixed: Sequence[KeyDigest], path: Path | None = None, *,
                 clock: Callable[[], float] = time.monotonic):
        self._fixed = tuple(fixed)
        self.path = path
        self._clock = clock
        # None while the key file is invalid: every attempt fails.
        self._from_file: tuple[KeyDigest, ...] | None = None
        self._stamp: Stamp | None = None
        self._next_check = 0.0
        if path is not None:
            try:
                entries, self._stamp = read_key_file(path)
            except KeyFileError as exc:
                raise AuthConfigError(f"--api-key-file {path}: {exc}") from None
            self._from_file = tuple(entries)
            self._next_check = clock() + FILE_CHECK_SECONDS

    @classmethod
    def from_config(cls, config: ServeConfig) -> KeyStore:
        fixed = labelled(config.api_keys, "cli", "--api-key")
        fixed += labelled(config.api_keys_env, "env", env.API_KEY)
        return cls(fixed, config.api_key_file)

    @property
    def enabled(self) -> bool:
        """Whether clients need a key at all."""
        return bool(self._fixed) or self.path is not None

    @property
    def closed(self) -> bool:
        """The key file is invalid: no key is accepted until it is fixed."""
        return self.path is not None and self._from_file is None

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(entry.label for entry in self._entries())

    def _entries(self) -> tuple[KeyDigest, ...]:
        return self._fixed + (self._from_file or ())

    def authenticate(self, key: str) -> str | None:
        """The label of `key`, or None. Every digest is compared, with no
        early exit, so the time taken says nothing about which key matched."""
        presented = digest(key)
        label = None
        for entry in self._entries():
            if hmac.compare_digest(entry.digest, presented) and label is None:
                label = entry.label
        return None if self.closed else label

    def refresh(self) -> None:
        """Re-read the key file if it changed; cheap enough for every request
        (one stat a second at most)."""
        if self.path is None:
            return
        now = self._clock()
        if now < self._next_check:
            return
        self._next_check = now + FILE_CHECK_SECONDS
        if current_stamp(self.path) != self._stamp:
            self.reload()

    def reload(self) -> None:
        """Read the key file now (a change seen by refresh(), or SIGHUP)."""
        if self.path is None:
            return
        was_closed = self.closed
        try:
            entries, self._stamp = read_key_file(self.path)
        except KeyFileError as exc:
            self._stamp = exc.stamp
            self._from_file = None
            log.error("API key file %s: %s; authenticated routes are %s until a valid file "
                      "returns", self.path, exc, "still closed" if was_closed else "closed")
            return
        self._from_file = tuple(entries)
        count = f"{len(entries)} key{'' if len(entries) == 1 else 's'}"
        if was_closed:
            log.info("API key file %s is valid again (%s); authenticated routes are open",
                     self.path, count)
        else:
            log.info("API key file %s reloaded (%s)", self.path, count)


KEY_STORE = web.AppKey("key_store", KeyStore)


def presented_keys(request: web.Request) -> list[str]:
    """What the client sent: a Bearer token (OpenAI's SDK) and/or x-api-key
    (Anthropic's)."""
    keys = []
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    api_key = request.headers.get("x-api-key", "").strip()
    if api_key:
        keys.append(api_key)
    return keys


def _unauthorized(message: str, code: str) -> ApiError:
    return ApiError(401, message, type="authentication_error", code=code,
                    headers={"WWW-Authenticate": "Bearer"})


def _is_open(request: web.Request, metrics_open: bool) -> bool:
    """The route table's access rule for the matched route (not the raw path):
    health probes are open; /metrics with --metrics-open."""
    route = route_of(request)
    if route is None:
        return False
    return route.access is Access.OPEN or (route.access is Access.METRICS and metrics_open)


def auth_middleware(store: KeyStore, *, metrics_open: bool) -> Middleware:
    """Asks for a key on every route but the open ones. It runs inside the
    error middleware, so a 401 comes in the route's own error shape."""
    @web.middleware
    async def authenticate(request: web.Request, handler: Any) -> web.StreamResponse:
        # CORS preflights never get here: the CORS middleware answers them.
        if not store.enabled or _is_open(request, metrics_open):
            return await handler(request)
        store.refresh()
        keys = presented_keys(request)
        if not keys:
            raise _unauthorized("this server needs an API key: send `Authorization: Bearer KEY` "
                                "or `x-api-key: KEY`", "missing_api_key")
        labels = [store.authenticate(key) for key in keys]
        label = next((label for label in labels if label is not None), None)
        if label is None:
            raise _unauthorized("invalid API key", "invalid_api_key")
        # The observe middleware's record (request["record"]), through its
        # context variable: the same object, whatever key the request uses.
        record = current_record.get()
        if record is not None:
            record.key_label = label
        return await handler(request)

    return authenticate
