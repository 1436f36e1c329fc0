"""Typing text parameter values (Qwen3-Coder's XML calls) by the tool's JSON schema.

The model writes every value as bare text; the arguments the client gets are
a JSON object, so "3" must become 3 when the schema says integer and stay
"3" when it says string. A value that does not parse as its type is kept as
a string: the client sees what the model wrote rather than losing it.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from typing import Any

_NO = object()  # "does not parse as this type"
_INTEGER = re.compile(r"[-+]?\d+")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def parameter_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Function name -> its "parameters" schema, from OpenAI function tools.

    Accepts {"type": "function", "function": {...}} and, leniently, the bare
    {"name", "parameters"} shape; anything else is skipped (the request
    layer validates tools, this only reads them).
    """
    schemas: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        schemas[function["name"]] = parameters if isinstance(parameters, dict) else {}
    return schemas


def value_types(parameters: dict[str, Any] | None, name: str) -> tuple[str, ...] | None:
    """The JSON types a parameter may have, or None when the schema does not say.

    Reads "type" (a name or a list of names), else the types of "anyOf" /
    "oneOf" alternatives.
    """
    properties = (parameters or {}).get("properties")
    schema = properties.get(name) if isinstance(properties, dict) else None
    if not isinstance(schema, dict):
        return None
    types = _types_of(schema)
    if not types:
        for key in ("anyOf", "oneOf"):
            for alternative in schema.get(key) or ():
                if isinstance(alternative, dict):
                    types += _types_of(alternative)
    return tuple(dict.fromkeys(types)) or None


def _types_of(schema: dict[str, Any]) -> tuple[str, ...]:
    declared = schema.get("type")
    if isinstance(declared, str):
        return (declared,)
    if isinstance(declared, list):
        return tuple(t for t in declared if isinstance(t, str))
    return ()


def typed_value(text: str, types: tuple[str, ...]) -> Any:
    """The value of text for the first of types it parses as; the text itself otherwise."""
    stripped = text.strip()
    for kind in types:
        convert = _CONVERTERS.get(kind)
        if convert is not None:
            value = convert(stripped)
            if value is not _NO:
                return value
    return text


def untyped_value(text: str) -> Any:
    """Without a schema: the JSON value text spells, else the text as a string."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return text


def _reject_constant(name: str) -> Any:
    # json.loads would accept NaN and Infinity, which json.dumps cannot write as JSON.
    raise ValueError(name)


def _integer(text: str) -> Any:
    if _INTEGER.fullmatch(text):
        return int(text)
    number = _number(text)
    if isinstance(number, float) and number.is_integer():
        return int(number)  # "3.0" or "1e3" for an integer
    return _NO


def _number(text: str) -> Any:
    if _INTEGER.fullmatch(text):
        return int(text)
    if _NUMBER.fullmatch(text):
        value = float(text)
        if math.isfinite(value):
            return value
    return _NO


def _boolean(text: str) -> Any:
    return {"true": True, "false": False}.get(text.lower(), _NO)


def _null(text: str) -> Any:
    return None if text.lower() in ("null", "none") else _NO


def _container(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        pass
    # Models sometimes write Python literals ({'a': True}); literal_eval reads
    # literals only, never running code.
    try:
        value = ast.literal_eval(text)
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NO
    return value


def _object(text: str) -> Any:
    value = _container(text)
    return value if isinstance(value, dict) else _NO


def _array(text: str) -> Any:
    value = _container(text)
    return list(value) if isinstance(value, list | tuple) else _NO


_CONVERTERS: dict[str, Callable[[str], Any]] = {
    "integer": _integer,
    "number": _number,
    "boolean": _boolean,
    "null": _null,
    "object": _object,
    "array": _array,
}
