"""JSON-schema keywords the engine's grammar (xgrammar) cannot enforce.

A schema is turned into token masks by xgrammar, which drops some keywords
with no more than a log line on the engine (measured with xgrammar 0.2.9):
`multipleOf` on non-integers, `minLength`/`maxLength` next to `pattern` or
`format`, `uniqueItems`, `contains` (and `minContains`/`maxContains`), `not`,
`if`/`then`/`else`, `dependentRequired`, `dependentSchemas`, `dependencies`,
and `allOf` with more than one schema. Where a client asked for the schema to
be followed exactly (strict), a keyword that would silently not hold is
refused with a 400 whose param is the keyword's path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from router.errors import invalid

_NEVER = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
          "dependentRequired", "dependentSchemas", "dependencies")
# Keywords holding one subschema, a list of them, or a name -> subschema map.
_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties",
        "unevaluatedItems", "propertyNames")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def _is_integer_type(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "integer" or (isinstance(kind, list) and kind == ["integer"])


def _problems(schema: Any, path: str) -> Iterator[tuple[str, str]]:
    """(path of the keyword, why) for each keyword the grammar would drop."""
    if not isinstance(schema, dict):
        return
    for keyword in _NEVER:
        if keyword in schema and not (keyword == "uniqueItems" and schema[keyword] is False):
            yield f"{path}.{keyword}", f"'{keyword}' cannot be enforced by the grammar"
    if "multipleOf" in schema and not _is_integer_type(schema):
        yield f"{path}.multipleOf", "'multipleOf' can be enforced only on integers"
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        keyword = "minLength" if "minLength" in schema else "maxLength"
        yield (f"{path}.{keyword}",
               f"'{keyword}' cannot be enforced together with 'pattern' or 'format'")
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        yield f"{path}.allOf", "'allOf' with more than one schema cannot be enforced by the grammar"
    for keyword in _ONE:
        if isinstance(schema.get(keyword), dict):
            yield from _problems(schema[keyword], f"{path}.{keyword}")
    for keyword in _LIST:
        if isinstance(schema.get(keyword), list):
            for index, item in enumerate(schema[keyword]):
                yield from _problems(item, f"{path}.{keyword}[{index}]")
    for keyword in _MAP:
        if isinstance(schema.get(keyword), dict):
            for name, item in schema[keyword].items():
                yield from _problems(item, f"{path}.{keyword}.{name}")


def check_enforceable(schema: Any, param: str) -> None:
    """A 400 naming the first keyword of schema (at request field `param`)
    that the grammar would not enforce."""
    for where, why in _problems(schema, param):
        raise invalid(f"{why}, so the output could break the schema; remove '{where.rsplit('.', 1)[-1]}' "
                      f"or leave strict mode off", where, "unsupported_schema_keyword")
