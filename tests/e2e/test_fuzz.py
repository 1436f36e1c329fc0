"""Malformed bodies against every POST route: each answer is below 500, a
4xx comes in the route's own error shape, and the server keeps serving.

Hypothesis draws the bodies (derandomized, so CI sees the same ones every
run): raw bytes, arbitrary JSON, and valid requests with one field replaced
by an arbitrary JSON value.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.scripted_models import ENGINE_ENV, QWEN3_SCRIPT, scripted_model
from tests.support.server import Server, running_server

pytestmark = pytest.mark.slow

MODEL = "fuzzed"
HI = [{"role": "user", "content": "hi"}]

# A valid body per route: the base each mutation starts from.
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "messages": HI, "max_tokens": 4},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 4},
    "/v1/responses/input_tokens": {"model": MODEL, "input": "hi"},
    "/v1/messages": {"model": MODEL, "messages": HI, "max_tokens": 4},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": HI},
    "/completion": {"prompt": "hi", "n_predict": 4},
    "/tokenize": {"content": "hi"},
    "/detokenize": {"tokens": [1, 2]},
    "/apply-template": {"messages": HI},
    "/models/load": {"model": MODEL},
}

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


def check_shape(route: str, response: requests.Response) -> None:
    body = response.json()
    if route.startswith("/v1/messages"):
        assert body["type"] == "error" and {"type", "message"} <= set(body["error"])
        assert response.headers.get("request-id")
    elif route.startswith("/v1/"):
        assert set(body["error"]) == {"message", "type", "param", "code"}
    else:
        assert body["error"]["code"] == response.status_code and "message" in body["error"]


@pytest.mark.parametrize("route", list(ROUTES))
def test_malformed_bodies_get_a_4xx_in_the_routes_shape(server: Server, route: str) -> None:
    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(body=bodies(route))
    def check(body: bytes) -> None:
        response = requests.post(server.url + route, data=body, timeout=60,
                                 headers={"Content-Type": "application/json"})
        assert response.status_code < 500, (route, body, response.text)
        if response.status_code >= 400:
            check_shape(route, response)

    check()
    # Still serving.
    assert server.get("/health").status_code == 200
    reply = server.post("/v1/chat/completions", json=ROUTES["/v1/chat/completions"])
    assert reply.status_code == 200
