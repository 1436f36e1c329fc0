"""llama.cpp's response_fields selection."""

from __future__ import annotations

from router.llamacpp.responses import select_fields


def test_response_fields_select_and_unnest() -> None:
    body = {"content": "x", "stop": True, "generation_settings": {"n_predict": 4, "seed": 1},
            "timings": {"predicted_n": 4}}
    assert select_fields(body, ["content", "generation_settings/n_predict", "nope",
                                "timings/predicted_n/deeper", "generation_settings"]) == {
        "content": "x", "generation_settings/n_predict": 4,
        "generation_settings": {"n_predict": 4, "seed": 1}}
    assert select_fields(body, []) == {}
