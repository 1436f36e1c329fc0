"""Malformed bodies against every POST route: each answer is below 500, a
4xx comes in the route's own error shape, and the server keeps serving.

Hypothesis draws the bodies (derandomized, so CI sees the same ones every
run): raw bytes, arbitrary JSON, and valid requests with one field replaced
by an arbitrary JSON value. Every POST route of router/http/routes.py must
have a base body here (a test says so), so a new route is fuzzed too. Inputs
that once gave a 500 are kept as explicit cases below the fuzzing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.http.route_info import Api
from router.http.routes import ROUTES as SERVED
from tests.support.scripted_models import ENGINE_ENV, QWEN3_SCRIPT, scripted_model
from tests.support.server import Server, running_server

pytestmark = pytest.mark.slow

MODEL = "fuzzed"
# Per route; about 25 routes make this ~1,250 requests, well under a minute.
EXAMPLES = 50
HI = [{"role": "user", "content": "hi"}]

# A valid body per route: the base each mutation starts from.
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "messages": HI, "max_tokens": 4},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 4},
    "/v1/responses/input_tokens": {"model": MODEL, "input": "hi"},
    "/v1/chat/completions/input_tokens": {"model": MODEL, "messages": HI},
    "/v1/messages": {"model": MODEL, "messages": HI, "max_tokens": 4},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": HI},
    "/completion": {"prompt": "hi", "n_predict": 4},
    "/infill": {"input_prefix": "def f():\n", "input_suffix": "\n", "input_extra": [
        {"filename": "a.py", "text": "x = 1\n"}], "n_predict": 4},
    "/tokenize": {"content": "hi"},
    "/detokenize": {"tokens": [1, 2]},
    "/apply-template": {"messages": HI},
    "/models/load": {"model": MODEL},
    # Aliases: the same handlers under other paths, in the same shapes.
    "/chat/completions": {"model": MODEL, "messages": HI, "max_tokens": 4},
    "/chat/completions/input_tokens": {"model": MODEL, "messages": HI},
    "/completions": {"prompt": "hi", "n_predict": 4},
    "/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 4},
    "/responses/input_tokens": {"model": MODEL, "input": "hi"},
    # A response that does not exist: its 404 is the normal answer.
    "/v1/responses/{response_id}/cancel": {},
    # Another model's name, so fuzzing never unloads the one the others use.
    "/models/unload": {"model": "not-" + MODEL},
    "/models/sleep": {"model": "not-" + MODEL},
    "/models": {"model": MODEL},
    "/props": {"n_ctx": 2048},
    # The fuzzed model serves no rerank (no --reranking): a 400 in the route's shape.
    **{path: {"model": MODEL, "query": "hi", "documents": ["a", {"text": "b"}], "top_n": 1}
       for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")},
    "/v1/embeddings": {"model": MODEL, "input": ["hi", [1, 2]], "encoding_format": "float"},
    **{path: {"model": MODEL, "content": "hi"} for path in ("/embedding", "/embeddings")},
    "/slots/{id_slot}": {"filename": "fuzz.bin"},
}

# 5xx answers that are a route's normal answer, not a failure: llama.cpp
# answers 501 to POST /props when it was not started with --props.
EXPECTED_5XX = {"/props": {501}}


def url(route: str) -> str:
    return route.replace("{response_id}", "resp_fuzz").replace("{id_slot}", "0?action=erase")


def api_of(route: str) -> Api:
    return next(r.api for r in SERVED if r.path == route)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)


def mutated(base: dict[str, Any]) -> st.SearchStrategy[bytes]:
    def replace(field: str, value: Any) -> bytes:
        return json.dumps({**base, field: value}).encode()

    fields = st.sampled_from([*base, "stream", "tools", "temperature", "stop"])
    return st.builds(replace, fields, json_values)


def bodies(route: str) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=200),
        json_values.map(lambda value: json.dumps(value).encode()),
        mutated(ROUTES[route]),
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    models = tmp_path_factory.mktemp("fuzz") / "models"
    models.mkdir()
    scripted_model(models / MODEL, tiny_qwen3_dir, QWEN3_SCRIPT)
    with running_server(["--models-dir", str(models)], tmp_path_factory.mktemp("fuzz-log") / "router.log",
                        env=ENGINE_ENV) as running:
        yield running


def check_shape(route: str, response: requests.Response) -> dict[str, Any]:
    """The error body, checked against the shape of the route's API."""
    body = response.json()
    api = api_of(route)
    if api is Api.ANTHROPIC:
        assert body["type"] == "error" and {"type", "message"} <= set(body["error"])
        assert response.headers.get("request-id")
    elif api is Api.OPENAI:
        assert set(body["error"]) == {"message", "type", "param", "code"}
    else:
        assert body["error"]["code"] == response.status_code and "message" in body["error"]
    return body


def still_serving(server: Server) -> None:
    assert server.get("/health").status_code == 200
    reply = server.post("/v1/chat/completions", json=ROUTES["/v1/chat/completions"])
    assert reply.status_code == 200


def test_every_post_route_has_a_base_body() -> None:
    posted = {route.path for route in SERVED if route.method == "POST"}
    assert posted - ROUTES.keys() == set(), "add a base body for each new POST route"
    assert ROUTES.keys() - posted == set(), "these routes are gone from router/http/routes.py"


@pytest.mark.parametrize("route", list(ROUTES))
def test_malformed_bodies_get_a_4xx_in_the_routes_shape(server: Server, route: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(body=bodies(route))
    def check(body: bytes) -> None:
        response = requests.post(server.url + url(route), data=body, timeout=60,
                                 headers={"Content-Type": "application/json"})
        assert (response.status_code < 500
                or response.status_code in EXPECTED_5XX.get(route, ())), (route, body, response.text)
        if response.status_code >= 400:
            check_shape(route, response)

    check()
    still_serving(server)


# Inputs that once gave a 500, each now a 400 naming its field where there is one.
DEEP = "[" * 100_000 + "]" * 100_000


def body(route: str, **fields: Any) -> bytes:
    return json.dumps({**ROUTES[route], **fields}).encode()


def deep_in(route: str, field: str, template: str) -> bytes:
    raw = body(route, **{field: "DEEP"}).decode()
    return raw.replace('"DEEP"', template.replace("DEEP", DEEP)).encode()


GZIP = {"Content-Encoding": "gzip"}
CASES: list[tuple[str, bytes, dict[str, str], str | None]] = [
    ("/v1/chat/completions", deep_in("/v1/chat/completions", "chat_template_kwargs", '{"x": DEEP}'),
     {}, None),
    ("/v1/messages", deep_in("/v1/messages", "tools",
                             '[{"name": "f", "input_schema": {"type": "object", "properties": DEEP}}]'),
     {}, None),
    ("/v1/responses", deep_in("/v1/responses", "tools",
                              '[{"type": "function", "name": "f", "parameters": DEEP}]'), {}, None),
    ("/completion", deep_in("/completion", "prompt", "DEEP"), {}, None),
    ("/v1/chat/completions", body("/v1/chat/completions", seed=2**64), {}, "seed"),
    ("/v1/completions", body("/v1/completions", seed=-(2**63) - 1), {}, "seed"),
    ("/completion", body("/completion", seed=2**64), {}, "seed"),
    ("/v1/chat/completions", body("/v1/chat/completions", stop_token_ids=[2**64]), {},
     "stop_token_ids[0]"),
    ("/detokenize", body("/detokenize", tokens=[1, 2**63]), {}, "tokens"),
    ("/detokenize", body("/detokenize", tokens=[2**64]), {}, "tokens[0]"),
    ("/v1/completions", body("/v1/completions", prompt=[2**63]), {}, "prompt"),
    ("/v1/completions", body("/v1/completions", prompt=[1, 2**63], echo=True), {}, "prompt"),
    ("/completion", body("/completion", prompt=[2**63]), {}, "prompt"),
    *[("/v1/chat/completions", body("/v1/chat/completions", chat_template_kwargs={key: 1}), {},
       "chat_template_kwargs")
      for key in ("tools", "messages", "add_generation_prompt", "continue_final_message")],
    ("/apply-template", body("/apply-template", chat_template_kwargs={"messages": []}), {},
     "chat_template_kwargs"),
    *[(route, body(route), GZIP, None) for route in ("/v1/chat/completions", "/v1/messages", "/tokenize")],
    # One long stop string once cost quadratic memory (a 1 MB one killed the router).
    ("/v1/chat/completions", body("/v1/chat/completions", stop="y" * 100_000), {}, "stop"),
    ("/v1/completions", body("/v1/completions", stop=["y" * 100_000]), {}, "stop"),
    ("/v1/messages", body("/v1/messages", stop_sequences=["y" * 100_000]), {}, "stop_sequences"),
    ("/completion", body("/completion", stop=["y" * 100_000]), {}, "stop"),
    ("/v1/chat/completions", body("/v1/chat/completions", stop=["x"] * 17), {}, "stop"),
]


@pytest.mark.parametrize(("route", "raw", "headers", "param"), CASES,
                         ids=[f"{c[0]}-{c[3] or ('gzip' if c[2] else 'deep')}" for c in CASES])
def test_inputs_that_once_gave_a_500_get_a_400_naming_the_field(
        server: Server, route: str, raw: bytes, headers: dict[str, str], param: str | None) -> None:
    started = time.monotonic()
    response = requests.post(server.url + route, data=raw, timeout=30,
                             headers={"Content-Type": "application/json", **headers})
    elapsed = time.monotonic() - started
    assert response.status_code == 400, response.text
    error = check_shape(route, response)["error"]
    if param is not None:
        if api_of(route) is Api.OPENAI:
            assert error["param"] == param, error
        else:
            assert param in error["message"], error
    assert elapsed < 5.0
    # Not even logged as a failure (aiohttp did, draining a body that did not decompress).
    assert "Unhandled exception" not in server.log()
    still_serving(server)
