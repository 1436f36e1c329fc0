"""A small JSON Schema checker: the subset the request log's schema uses
(type, const, enum, pattern, minimum, properties, required,
additionalProperties, items), so the tests hold every event to the
documented schema without a new dependency."""

from __future__ import annotations

import re
from typing import Any

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}

KEYWORDS = frozenset({"type", "const", "enum", "pattern", "minimum", "properties", "required",
                      "additionalProperties", "items", "description"})


def _is(value: Any, name: str) -> bool:
    # JSON has no booleans among its numbers; Python's bool is an int.
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    return isinstance(value, _TYPES[name])


def errors(value: Any, schema: dict[str, Any], where: str = "$") -> list[str]:
    """Every way `value` breaks `schema`, as `$.path: what`; empty when it fits."""
    unknown = set(schema) - KEYWORDS
    if unknown:
        raise ValueError(f"{where}: the checker does not know {sorted(unknown)}")
    found: list[str] = []
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else types
        if not any(_is(value, name) for name in names):
            return [f"{where}: {type(value).__name__} {value!r:.60} is not {' or '.join(names)}"]
    if "const" in schema and value != schema["const"]:
        found.append(f"{where}: {value!r:.60} is not {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        found.append(f"{where}: {value!r:.60} is not one of {schema['enum']}")
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        found.append(f"{where}: {value!r:.60} does not match {schema['pattern']}")
    if "minimum" in schema and _is(value, "number") and value < schema["minimum"]:
        found.append(f"{where}: {value} is below {schema['minimum']}")
    if isinstance(value, dict):
        found += _object_errors(value, schema, where)
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            found += errors(item, schema["items"], f"{where}[{index}]")
    return found


def _object_errors(value: dict[str, Any], schema: dict[str, Any], where: str) -> list[str]:
    found = [f"{where}: '{name}' is missing" for name in schema.get("required", ()) if name not in value]
    properties = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for name, item in value.items():
        if name in properties:
            found += errors(item, properties[name], f"{where}.{name}")
        elif extra is False:
            found.append(f"{where}: '{name}' is not in the schema")
        elif isinstance(extra, dict):
            found += errors(item, extra, f"{where}.{name}")
    return found
