"""Error codes an engine may put in a RequestError."""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    # The request cannot be served by this engine as sent (a prompt longer than
    # the context or the KV pool, a token id outside the vocabulary).
    INVALID_REQUEST = "invalid_request"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    # A grammar (JSON schema, regex, GBNF, structural tag) that does not compile.
    INVALID_GRAMMAR = "invalid_grammar"
    # A request id the engine already runs.
    DUPLICATE_REQUEST = "duplicate_request"
    # The engine failed while running this request but kept going.
    INTERNAL = "internal_error"
