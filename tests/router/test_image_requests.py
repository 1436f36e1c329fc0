"""Images through a real router app (no engine: every answer here comes from
the model's text side): 400 vision_disabled in each API's own error shape
for a model served without --vision, the OpenAI and Anthropic SDKs seeing
it, images placed where the template renders them for a model served with
it, and the modality every model list reports."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from protocol import EngineOptions
from router.app import create_app
from router.catalog import Catalog, CatalogEntry
from router.config import ServeConfig
from router.lifecycle.manager import ModelManager
from router.llamacpp.prompt import MEDIA_MARKER
from router.settings import ModelSettings
from tests.router.media_images import QWEN25_SPEC
from tests.support.simulated_devices import NoDevices

PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5E"
       "rkJggg==")
DATA_URI = f"data:image/png;base64,{PNG}"
URL = "https://example.com/cat.jpg"
# Renders each image part as Qwen-VL templates render theirs.
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}" + IMG + "{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CHAT = {"messages": [{"role": "user", "content": [
    {"type": "text", "text": "What is this?"},
    {"type": "image_url", "image_url": {"url": DATA_URI}}]}]}
RESPONSES = {"input": [{"role": "user", "content": [
    {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": URL}]}]}
MESSAGES = {"max_tokens": 16, "messages": [{"role": "user", "content": [
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
    {"type": "text", "text": "What is this?"}]}]}
COMPLETION = {"prompt": {"prompt_string": f"Describe {MEDIA_MARKER}", "multimodal_data": [PNG]}}


def serve(tokenizer_dir: Path, check: Callable[[TestClient], Awaitable[None]]) -> None:
    """`check` against a router with two models over the same tokenizer:
    `seeing` (served with --vision) and `blind` (without); never loaded."""

    async def run() -> None:
        def entry(name: str, vision: bool) -> CatalogEntry:
            settings = ModelSettings(engine=EngineOptions(vision=vision), chat_template=IMAGE_TEMPLATE)
            return CatalogEntry(name, tokenizer_dir, "hf", settings,
                                vision=QWEN25_SPEC if vision else None)

        catalog = Catalog({"seeing": entry("seeing", True), "blind": entry("blind", False)})
        manager = ModelManager(catalog, ServeConfig(models_dir=tokenizer_dir.parent), probe=NoDevices())
        async with TestClient(TestServer(create_app(manager))) as client:
            await check(client)

    asyncio.run(run())


async def post(client: TestClient, path: str, body: dict[str, Any], model: str) -> tuple[int, Any]:
    response = await client.post(path, json={"model": model, **body})
    return response.status, await response.json()


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", CHAT, "messages[0].content[1].image_url"),
    ("/v1/chat/completions/input_tokens", CHAT, "messages[0].content[1].image_url"),
    ("/v1/responses", RESPONSES, "input[0].content[1].image_url"),
    ("/v1/responses/input_tokens", RESPONSES, "input[0].content[1].image_url"),
])
def test_vision_disabled_in_openai_shape(qwen3_tokenizer_dir: Path, path: str, body: dict[str, Any],
                                         param: str) -> None:
    async def check(client: TestClient) -> None:
        status, answer = await post(client, path, body, "blind")
        assert status == 400, answer
        error = answer["error"]
        assert (error["code"], error["param"], error["type"]) == ("vision_disabled", param,
                                                                  "invalid_request_error")
        assert "--vision" in error["message"]

    serve(qwen3_tokenizer_dir, check)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_vision_disabled_in_anthropic_shape(qwen3_tokenizer_dir: Path, path: str) -> None:
    async def check(client: TestClient) -> None:
        status, answer = await post(client, path, MESSAGES, "blind")
        assert status == 400, answer
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["message"].startswith("messages[0].content[0].source: model 'blind'")

    serve(qwen3_tokenizer_dir, check)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/completion", COMPLETION, "prompt.multimodal_data[0]"),
    ("/apply-template", CHAT, "messages[0].content[1].image_url"),
])
def test_vision_disabled_in_llamacpp_shape(qwen3_tokenizer_dir: Path, path: str, body: dict[str, Any],
                                           param: str) -> None:
    async def check(client: TestClient) -> None:
        status, answer = await post(client, path, body, "blind")
        assert status == 400, answer
        error = answer["error"]
        assert (error["code"], error["reason"]) == (400, "vision_disabled")
        assert error["message"].startswith(f"{param}: ")

    serve(qwen3_tokenizer_dir, check)


def test_the_sdks_see_vision_disabled(qwen3_tokenizer_dir: Path) -> None:
    async def check(client: TestClient) -> None:
        base = str(client.make_url(""))
        oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as chat:
            await oai.chat.completions.create(model="blind", **CHAT)
        assert (chat.value.code, chat.value.param) == ("vision_disabled", "messages[0].content[1].image_url")
        with pytest.raises(openai.BadRequestError) as responses:
            await oai.responses.create(model="blind", **RESPONSES)
        assert (responses.value.code, responses.value.param) == ("vision_disabled",
                                                                 "input[0].content[1].image_url")
        ant = anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as messages:
            await ant.messages.create(model="blind", **MESSAGES)
        assert "messages[0].content[0].source: " in messages.value.message
        # Served with --vision, the same image is counted, not refused.
        counted = await ant.messages.count_tokens(model="seeing", messages=MESSAGES["messages"])
        assert counted.input_tokens > 0
        await oai.close()
        await ant.close()

    serve(qwen3_tokenizer_dir, check)


def test_images_reach_the_template_where_they_stood(qwen3_tokenizer_dir: Path) -> None:
    async def check(client: TestClient) -> None:
        body = {"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image_url", "image_url": URL},
                                         {"type": "text", "text": " and "},
                                         {"type": "image_url", "image_url": {"url": DATA_URI}}]}]}
        status, answer = await post(client, "/apply-template", body, "seeing")
        assert status == 200, answer
        assert answer["prompt"] == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                    f"<|im_start|>user\n{IMG} and {IMG}<|im_end|>\n"
                                    "<|im_start|>assistant\n")
        # Text-only requests render exactly as before.
        status, answer = await post(client, "/apply-template",
                                    {"messages": [{"role": "user", "content": "hi"}]}, "blind")
        assert answer["prompt"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        inline = {"input": [{"role": "user", "content": [{"type": "input_image",
                                                           "image_url": DATA_URI}]}]}
        status, answer = await post(client, "/v1/responses/input_tokens", inline, "seeing")
        assert status == 200 and answer["input_tokens"] > 0, answer

    serve(qwen3_tokenizer_dir, check)


def test_every_model_list_reports_the_modality(qwen3_tokenizer_dir: Path) -> None:
    async def check(client: TestClient) -> None:
        for path in ("/v1/models", "/models"):
            cards = {card["id"]: card for card in (await (await client.get(path)).json())["data"]}
            seeing, blind = cards["seeing"], cards["blind"]
            assert seeing["architecture"] == {"modality": "text+image->text",
                                              "input_modalities": ["text", "image"],
                                              "output_modalities": ["text"]}
            assert seeing["modalities"] == {"input": ["text", "image"], "output": ["text"]}
            assert "multimodal" in seeing["capabilities"]
            assert blind["architecture"]["input_modalities"] == ["text"]
            assert blind["architecture"]["modality"] == "text->text"
            assert blind["modalities"] == {"input": ["text"], "output": ["text"]}
            assert "multimodal" not in blind["capabilities"]
        for model, vision in (("seeing", True), ("blind", False)):
            props = await (await client.get(f"/props?model={model}")).json()
            assert props["modalities"] == {"vision": vision, "video": False, "audio": False}

    serve(qwen3_tokenizer_dir, check)
