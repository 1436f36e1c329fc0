"""Output constraints an OpenAI-shaped request may carry, as one GrammarSpec.

Sources, at most one per request (each 400 names its field):
- response_format: json_object (llama.cpp also reads a `schema` inside it),
  json_schema (`strict` refuses schema keywords the grammar cannot enforce);
- llama.cpp's top-level `grammar` (GBNF) and `json_schema` (Chat Completions);
- vLLM's guided_json, guided_regex, guided_choice, guided_grammar, and its
  newer structured_outputs object with the same four kinds.

The engine compiles them with xgrammar; a grammar that does not compile comes
back from the engine as a request error, a 400 naming `grammar`.
"""

from __future__ import annotations

import json
from typing import Any

from protocol import GrammarSpec
from router.errors import invalid
from router.json_schema_limits import check_enforceable
from router.openai.schemas import ChatCompletionRequest, SamplingFields


def _schema_spec(value: Any, param: str, *, strict: bool) -> GrammarSpec:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise invalid(f"'{param}' is not valid JSON", param) from None
    if not isinstance(value, dict):
        raise invalid(f"'{param}' must be a JSON schema object", param, "invalid_type")
    if strict:
        check_enforceable(value, param)
    return GrammarSpec("json_schema", json.dumps(value))


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(f"'{param}' must be a non-empty string", param, "invalid_type")
    return value


def choice_grammar(choices: Any, param: str) -> GrammarSpec:
    """One of the given strings exactly, as a GBNF grammar (JSON's string
    escapes are GBNF's too)."""
    if not isinstance(choices, list) or not choices:
        raise invalid(f"'{param}' must be a non-empty list of strings", param, "invalid_type")
    if not all(isinstance(c, str) and c for c in choices):
        raise invalid(f"'{param}' must hold non-empty strings", param, "invalid_type")
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return GrammarSpec("ebnf", f"root ::= {alternatives}")


def _structured_outputs(value: dict[str, Any]) -> list[tuple[str, GrammarSpec]]:
    found: list[tuple[str, GrammarSpec]] = []
    for key, item in value.items():
        param = f"structured_outputs.{key}"
        if item is None or item is False:
            continue
        if key == "json":
            found.append((param, _schema_spec(item, param, strict=True)))
        elif key == "regex":
            found.append((param, GrammarSpec("regex", _text(item, param))))
        elif key == "choice":
            found.append((param, choice_grammar(item, param)))
        elif key == "grammar":
            found.append((param, GrammarSpec("ebnf", _text(item, param))))
        elif key == "json_object":
            found.append((param, GrammarSpec("json_object")))
        else:
            raise invalid(f"'{param}' is not supported; use json, regex, choice, grammar or "
                          "json_object", param, "unsupported_parameter")
    return found


def _guided(req: SamplingFields) -> list[tuple[str, GrammarSpec]]:
    found: list[tuple[str, GrammarSpec]] = []
    if req.guided_json is not None:
        found.append(("guided_json", _schema_spec(req.guided_json, "guided_json", strict=True)))
    if req.guided_regex is not None:
        found.append(("guided_regex", GrammarSpec("regex", _text(req.guided_regex, "guided_regex"))))
    if req.guided_choice is not None:
        found.append(("guided_choice", choice_grammar(req.guided_choice, "guided_choice")))
    if req.guided_grammar is not None:
        found.append(("guided_grammar",
                      GrammarSpec("ebnf", _text(req.guided_grammar, "guided_grammar"))))
    if req.structured_outputs is not None:
        found.extend(_structured_outputs(req.structured_outputs))
    return found


def response_format(value: dict[str, Any] | None) -> GrammarSpec | None:
    if value is None or value.get("type") in (None, "text"):
        return None
    if value["type"] == "json_object":
        # llama.cpp's extension: a schema right inside the json_object format.
        if value.get("schema") is not None:
            return _schema_spec(value["schema"], "response_format.schema", strict=False)
        return GrammarSpec("json_object")
    if value["type"] == "json_schema":
        spec = value.get("json_schema") or {}
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise invalid("response_format json_schema needs json_schema.schema, an object",
                          "response_format.json_schema.schema")
        return _schema_spec(schema, "response_format.json_schema.schema",
                            strict=spec.get("strict") is True)
    raise invalid(f"response_format type {value['type']!r} is not supported", "response_format.type")


def _only_one(found: list[tuple[str, GrammarSpec]]) -> GrammarSpec | None:
    if len(found) > 1:
        raise invalid(f"'{found[0][0]}' and '{found[1][0]}' both constrain the output; send one",
                      found[1][0])
    return found[0][1] if found else None


def completion_constraint(req: SamplingFields) -> GrammarSpec | None:
    """The constraint of a /v1/completions request."""
    return _only_one(_guided(req))


def chat_constraint(req: ChatCompletionRequest) -> GrammarSpec | None:
    """The constraint of a Chat Completions request (its answer, after any thinking)."""
    found: list[tuple[str, GrammarSpec]] = []
    fmt = response_format(req.response_format)
    if fmt is not None:
        found.append(("response_format", fmt))
    if req.grammar is not None:
        found.append(("grammar", GrammarSpec("ebnf", _text(req.grammar, "grammar"))))
    if req.json_schema is not None:
        found.append(("json_schema", _schema_spec(req.json_schema, "json_schema", strict=False)))
    found.extend(_guided(req))
    return _only_one(found)
