"""decode_body: bodies that would crash later (deep nesting, integers past 64
bits) are refused as 400s that name where the problem is."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from router.errors import RouterError
from router.http.errors import decode_body
from router.http.json_bounds import MAX_JSON_DEPTH, nested_too_deeply


class Body(msgspec.Struct, kw_only=True):
    seed: int | None = None
    tokens: list[int] = []
    extra: dict[str, Any] | None = None
    prompt: str | list[Any] = ""


def refusal(raw: bytes) -> RouterError:
    with pytest.raises(RouterError) as caught:
        decode_body(raw, Body)
    return caught.value


def nested(depth: int) -> bytes:
    return b'{"extra": {"x": ' + b"[" * (depth - 2) + b"]" * (depth - 2) + b"}}"


def test_deep_nesting_is_refused_however_deep() -> None:
    for depth in (MAX_JSON_DEPTH + 1, 900, 100_000):
        error = refusal(nested(depth))
        assert error.code == "invalid_json" and f"more than {MAX_JSON_DEPTH}" in error.message


def test_nesting_up_to_the_limit_is_decoded() -> None:
    body = decode_body(nested(MAX_JSON_DEPTH), Body)
    assert body.extra is not None


def test_brackets_inside_strings_do_not_count() -> None:
    text = '[{"\\"[' * 500
    body = decode_body(msgspec.json.encode({"prompt": text, "extra": {"a": [[1]]}}), Body)
    assert body.prompt == text
    assert not nested_too_deeply(msgspec.json.encode([text] * 3))


def test_depth_check_of_a_big_bracket_heavy_body_is_quick() -> None:
    raw = msgspec.json.encode({"extra": {"rows": [[[i, [i]]] for i in range(300_000)]}})
    started = time.perf_counter()
    assert not nested_too_deeply(raw)
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"seed": 18446744073709551616}', "seed"),
    (b'{"seed": -9223372036854775809}', "seed"),
    (b'{"tokens": [1, 2, 123456789012345678901234567890]}', "tokens[2]"),
    (b'{"prompt": [5, "x", 99999999999999999999]}', "prompt[2]"),
    (b'{"extra": {"a": {"b": [18446744073709551616]}}}', "extra.a.b[0]"),
])
def test_integers_past_64_bits_are_refused_naming_where(raw: bytes, param: str) -> None:
    error = refusal(raw)
    assert error.param == param and "64-bit" in error.message


def test_integers_at_the_64_bit_edges_pass() -> None:
    body = decode_body(b'{"seed": 18446744073709551615, "tokens": [-9223372036854775808],'
                       b' "prompt": "12345678901234567890123"}', Body)
    assert body.seed == 2**64 - 1 and body.tokens == [-(2**63)]


def test_big_integers_in_ignored_fields_are_ignored() -> None:
    assert decode_body(b'{"unknown": 123456789012345678901234567890}', Body).seed is None
