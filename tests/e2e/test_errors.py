"""Bad input gets a 400 in OpenAI's error shape that names the field."""

from __future__ import annotations

import json

import openai
import pytest

from tests.support.server import Server

pytestmark = pytest.mark.slow

OK = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def with_(**fields: object) -> dict:
    return {**OK, **fields}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (with_(temperature=-0.5), "temperature", "invalid_value"),
        (with_(temperature="hot"), "temperature", "invalid_type"),
        (with_(top_p=0), "top_p", "invalid_value"),
        (with_(top_p=1.5), "top_p", "invalid_value"),
        (with_(n=0), "n", "invalid_value"),
        (with_(max_tokens=-2), "max_tokens", "invalid_value"),
        (with_(max_completion_tokens=0), "max_completion_tokens", "invalid_value"),
        (with_(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role", "invalid_value"),
        (with_(messages=[]), "messages", "invalid_value"),
        (with_(messages="hi"), "messages", "invalid_type"),
        (with_(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
         "messages[0].content[0].image_url", "missing_required_parameter"),
        (with_(stop=[1, 2]), "stop[0]", "invalid_type"),
        ({"model": "smollm2"}, "messages", "missing_required_parameter"),
    ],
)
def test_chat_field_errors(router: Server, body: dict, param: str, code: str) -> None:
    response = router.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and error["code"] == code, error


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]"])
def test_malformed_bodies(router: Server, raw: bytes) -> None:
    response = router.post("/v1/chat/completions", data=raw,
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "smollm2", "prompt": [["a"]]}, "prompt[0]"),
        ({"model": "smollm2", "prompt": []}, "prompt"),
        ({"model": "smollm2", "prompt": ["a", [1, 10**9]]}, "prompt[1]"),
        ({"model": "smollm2", "prompt": ""}, "prompt"),
        ({"model": "smollm2", "prompt": [1, 10**9]}, "prompt"),
        ({"model": "smollm2", "prompt": "x", "suffix": "y"}, "suffix"),
        ({"model": "smollm2", "prompt": "x", "top_k": -5}, "top_k"),
    ],
)
def test_completion_field_errors(router: Server, body: dict, param: str) -> None:
    response = router.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "model_not_found"


def test_sdk_sees_a_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], n=17)
    assert caught.value.param == "n"


def test_prompt_longer_than_the_context(router: Server) -> None:
    # SmolLM2 (8192 tokens of context), which the modules around this one use:
    # the package's --models-max 1 router keeps it loaded instead of switching.
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hello " * 9000}]}
    response = router.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "8192" in error["message"] and "903" in error["message"]


def test_unknown_route_in_the_same_shape(router: Server) -> None:
    response = router.post("/v1/nothing-here", data=json.dumps({}))
    assert response.status_code == 404
    assert "error" in response.json()
