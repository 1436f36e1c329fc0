"""Validation errors that name their field the way Anthropic's do.

Anthropic's error envelope has no `param`; its messages start with the
field's path instead ("messages.0.content.0.type: ..."). Ours start with the
path in the form the rest of this server uses (messages[0].content[0].type)
and keep it in ApiError.param as well.
"""

from __future__ import annotations

from router.http.errors import ApiError, invalid


def refuse(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return invalid(f"{param}: {message}", param, code)
