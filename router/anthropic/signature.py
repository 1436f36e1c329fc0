"""Signatures for the thinking blocks this server returns.

Anthropic signs thinking so that it can tell its own blocks when clients send
them back. Here a signature is an HMAC-SHA256 of the thinking text under a
key drawn at start-up: it marks a block as produced by this process, and
clients that insist on a non-empty signature get one. Signatures that come
back in the history are accepted as they are, never checked: the key changes
with every restart, and a wrong one must not cost a conversation.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

_KEY = secrets.token_bytes(32)


def thinking_signature(text: str) -> str:
    digest = hmac.new(_KEY, text.encode("utf-8"), hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")
