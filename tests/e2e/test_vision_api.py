"""Images end to end: `roundhouse serve --vision` on a tiny random Qwen2.5-VL
(transformers' own class, saved with its tower), a real engine subprocess,
the openai and anthropic SDKs. The engine's answers to image prompts are
checked against transformers in tests/engine/test_vision_engine.py; here the
whole path: an image request is answered and counted with its image
tokens, the same image in a follow-up turn comes from the prefix cache with
the same answer, a different image gets a different answer, bad media gets a
clean 400 and the server keeps serving."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator

import anthropic
import numpy as np
import openai
import pytest

from tests.router.test_image_generation import PROCESSOR, VL_TEMPLATE
from tests.support.server import Server, running_server
from tests.support.tiny_vl_models import build_tiny_vl_model

PIL = pytest.importorskip("PIL.Image")

pytestmark = pytest.mark.slow


def png(seed: int, width: int = 100, height: int = 60) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    PIL.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_uri(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = tmp_path_factory.mktemp("models") / "tiny-vl"
    build_tiny_vl_model("qwen2_5_vl", model)
    (model / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    (model / "chat_template.jinja").write_text(VL_TEMPLATE)
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with running_server([str(model), "--vision", "--threads", "1", "--page-size", "16"],
                        log) as running:
        yield running


def ask(client: openai.OpenAI, model: str, image: bytes | None, text: str = "Describe it."
        ) -> openai.types.chat.ChatCompletion:
    content: list[dict] = [{"type": "text", "text": text}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": data_uri(image)}})
    return client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": content}])


def test_image_chat_is_answered_cached_and_told_apart(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    text_only = ask(client, model, None)
    first = ask(client, model, png(1))
    # 100 x 60 resizes to 112 x 56: a 4 x 8 patch grid, 8 image tokens (+ start and end).
    assert first.usage.prompt_tokens == text_only.usage.prompt_tokens + 10
    again = ask(client, model, png(1))
    assert again.choices[0].message.content == first.choices[0].message.content
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens and details.cached_tokens >= 16
    other = ask(client, model, png(2))
    assert other.usage.prompt_tokens == first.usage.prompt_tokens
    assert other.choices[0].message.content != first.choices[0].message.content


def test_anthropic_image_block_and_bad_media(server: Server) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                                 timeout=120)
    image = base64.b64encode(png(1)).decode()
    reply = client.messages.create(model="tiny-vl", max_tokens=4, messages=[{
        "role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": image}},
            {"type": "text", "text": "Describe it."}]}])
    assert reply.usage.output_tokens == 4
    broken = base64.b64encode(b"\x89PNG\r\n\x1a\n not really").decode()
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny-vl", max_tokens=4, messages=[{
            "role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": broken}}]}])
    assert server.get("/health").status_code == 200
