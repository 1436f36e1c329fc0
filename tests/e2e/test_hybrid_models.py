"""Hybrid models (Qwen3.5, Qwen3-Next) through a real server and the openai
SDK: a conversation's next turn resumes from the recurrent-state checkpoint
its first turn left, and the usage says how many prompt tokens were reused;
the catalog and /props describe the model."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.support.server import Server, running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def server(request: pytest.FixtureRequest, tiny_model_factory,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = tiny_model_factory(request.param)
    log = tmp_path_factory.mktemp(f"hybrid-{request.param}") / "router.log"
    with running_server([str(model), "--threads", "1", "--page-size", "16"], log) as running:
        yield running


def test_a_conversations_next_turn_reuses_its_first_turn(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Tell me about the roundhouse at the end of the "
                                            "line, where the engines rest at night."}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                           temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                           temperature=0)
    # The same prompt resumes right before its last token, with the same answer.
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1  # type: ignore[union-attr]
    assert again.choices[0].message.content == first.choices[0].message.content
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "And the turntable?"}]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                            temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert first.usage.prompt_tokens - 1 <= cached < second.usage.prompt_tokens


def test_props_describe_the_hybrid_model(server: Server) -> None:
    props = server.get("/props").json()
    assert props["model_path"] and props["default_generation_settings"]["n_ctx"] > 0
    models = server.get("/v1/models").json()["data"]
    assert len(models) == 1
