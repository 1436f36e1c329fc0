"""Images from every API to the engine's Generate, through a real router in
this process and an engine that writes down what it gets
(tests/support/recording_engine.py): each image's one image token becomes
its num_tokens image tokens, the images arrive with their offsets, grids and
digests, and every count the APIs report is of that expanded prompt. Also
the --media-* options, images_not_placed, and a --vision model that cannot
take images stopping the server at start."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from protocol.vision import vision_spec_from_configs
from router.app import create_app
from router.catalog import build_catalog
from router.cli import parse_serve_command
from router.lifecycle.manager import ModelManager
from router.llamacpp.prompt import MEDIA_MARKER
from router.media.limits import MediaLimits
from router.media.loader import prepare_image
from router.media.types import PreparedImage
from router.text.model_text import ModelText
from tests.router.media_images import encode, noise_image
from tests.support.recording_engine import received
from tests.support.scripted_models import scripted_model
from tests.support.simulated_devices import NoDevices
from tests.support.tiny_vl_models import IMAGE_TOKEN, VISION_END, VISION_START

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
# A minimal Qwen-VL template: image parts as Qwen2.5-VL's template writes them.
VL_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}" + IMG + "{% elif p.type == 'text' %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# One that drops images: the router must notice.
BLIND_TEMPLATE = VL_TEMPLATE.replace(IMG, "")
# Qwen2.5-VL's processor (14-pixel patches merged 2 x 2), small max_pixels.
PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2,
             "temporal_patch_size": 2, "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64,
             "resample": 3}
SPEC = vision_spec_from_configs(PROCESSOR, {"model_type": "qwen2_5_vl"})
SCRIPT = {"rules": [], "default": "I see it."}
MODEL = "vl"

PNG = encode(noise_image(100, 60))  # resized to 112 x 56: a 4 x 8 patch grid, 8 tokens
PNG2 = encode(noise_image(60, 90, seed=1))  # 56 wide, 84 high: 6 x 4 patches, 6 tokens
BIG = encode(noise_image(280, 280, seed=2))  # 224 x 224 under max_pixels: 64 tokens


def uri(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


def vl_model(target: Path, base: Path, template: str = VL_TEMPLATE, processor: bool = True) -> Path:
    """A Qwen2.5-VL-shaped directory on the tiny Qwen3's tokenizer and weights
    (the router reads no weights; the recording engine runs none)."""
    scripted_model(target, base, SCRIPT, template)
    config = json.loads((base / "config.json").read_text())
    config.update(model_type="qwen2_5_vl", image_token_id=IMAGE_TOKEN,
                  vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    (target / "config.json").unlink()
    (target / "config.json").write_text(json.dumps(config))
    if processor:
        (target / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return target


@pytest.fixture
def models(tmp_path: Path, tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ROUNDHOUSE_ENGINE_MODULE", "tests.support.recording_engine")
    directory = tmp_path / "models"
    directory.mkdir()
    vl_model(directory / MODEL, tiny_qwen3_dir)
    vl_model(directory / "blind-template", tiny_qwen3_dir, BLIND_TEMPLATE)
    return directory


@asynccontextmanager
async def router(models: Path, *flags: str) -> AsyncIterator[TestClient]:
    config = parse_serve_command(["serve", "--models-dir", str(models), "--vision", *flags])
    manager = ModelManager(build_catalog(config), config, probe=NoDevices())
    async with TestClient(TestServer(create_app(manager))) as client:
        yield client


def serve(models: Path, check: Callable[[TestClient], Awaitable[None]], *flags: str) -> None:
    async def run() -> None:
        async with router(models, *flags) as client:
            await check(client)

    asyncio.run(run())


def prepared(data: bytes) -> PreparedImage:
    """The image as the loader prepares it for the model (what the engine must get)."""
    return prepare_image(data, "test", "auto", SPEC, MediaLimits())


def expanded(text: ModelText, prompt: str, images: list[PreparedImage]) -> list[int]:
    """The prompt's ids with its k-th image token repeated images[k].num_tokens times."""
    out: list[int] = []
    pads = iter(images)
    for token in text.encode_prompt(prompt):
        out += [token] * next(pads).num_tokens if token == IMAGE_TOKEN else [token]
    assert next(pads, None) is None
    return out


def check_images(record: dict[str, Any], images: list[PreparedImage]) -> None:
    """The record's images are these, each at its run of image tokens, between
    the vision start and end tokens."""
    ids = record["prompt"]
    assert len(record["images"]) == len(images)
    for got, image in zip(record["images"], images, strict=True):
        offset, n = got["offset"], image.num_tokens
        assert got["grid"] == [image.grid_t, image.grid_h, image.grid_w]
        assert got["size"] == [image.width, image.height]
        assert got["digest"] == image.digest.hex()
        assert (got["rgb_sha256"], got["rgb_bytes"]) == (hashlib.sha256(image.rgb).hexdigest(),
                                                         image.width * image.height * 3)
        assert ids[offset - 1] == VISION_START and ids[offset + n] == VISION_END
        assert ids[offset:offset + n] == [IMAGE_TOKEN] * n
    assert ids.count(IMAGE_TOKEN) == sum(image.num_tokens for image in images)


def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def test_the_expected_grids() -> None:
    first, second, big = prepared(PNG), prepared(PNG2), prepared(BIG)
    assert (first.grid_h, first.grid_w, first.num_tokens) == (4, 8, 8)
    assert (second.grid_h, second.grid_w, second.num_tokens) == (6, 4, 6)
    assert big.num_tokens == 64


def test_every_api_sends_the_expanded_prompt_and_its_images(models: Path) -> None:
    text = ModelText.load(models / MODEL)
    one, two = prepared(PNG), prepared(PNG2)
    chat = user({"type": "text", "text": "Compare "}, {"type": "image_url", "image_url": {"url": uri(PNG)}},
                {"type": "text", "text": " and "}, {"type": "image_url", "image_url": {"url": uri(PNG2)}})
    chat_prompt = f"<|im_start|>user\nCompare {IMG} and {IMG}<|im_end|>\n<|im_start|>assistant\n"
    one_prompt = f"<|im_start|>user\n{IMG}What is this?<|im_end|>\n<|im_start|>assistant\n"

    async def check(client: TestClient) -> None:
        base = str(client.make_url(""))
        oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        ant = anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0)
        log = models / MODEL

        # Chat Completions, two images, through the openai SDK.
        answer = await oai.chat.completions.create(model=MODEL, messages=chat)  # type: ignore[arg-type]
        record = received(log)[-1]
        assert record["prompt"] == expanded(text, chat_prompt, [one, two])
        check_images(record, [one, two])
        assert answer.choices[0].message.content == "I see it."
        assert answer.usage is not None and answer.usage.prompt_tokens == len(record["prompt"])
        counted = await client.post("/v1/chat/completions/input_tokens",
                                    json={"model": MODEL, "messages": chat})
        assert (await counted.json())["input_tokens"] == len(record["prompt"])

        # Responses, one image.
        parts = [{"type": "input_image", "image_url": uri(PNG)},
                 {"type": "input_text", "text": "What is this?"}]
        response = await oai.responses.create(model=MODEL, input=[{"role": "user", "content": parts}])  # type: ignore[arg-type,list-item]
        record = received(log)[-1]
        assert record["prompt"] == expanded(text, one_prompt, [one])
        check_images(record, [one])
        assert response.usage is not None and response.usage.input_tokens == len(record["prompt"])
        counted = await client.post("/v1/responses/input_tokens", json={
            "model": MODEL, "input": [{"role": "user", "content": parts}]})
        assert (await counted.json())["input_tokens"] == len(record["prompt"])

        # Anthropic, one base64 image block, through the anthropic SDK.
        blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                               "data": base64.b64encode(PNG).decode()}},
                  {"type": "text", "text": "What is this?"}]
        message = await ant.messages.create(model=MODEL, max_tokens=16,
                                            messages=[{"role": "user", "content": blocks}])  # type: ignore[list-item,misc]
        record = received(log)[-1]
        assert record["prompt"] == expanded(text, one_prompt, [one])
        check_images(record, [one])
        usage = message.usage
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == len(record["prompt"])
        tokens = await ant.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": blocks}])  # type: ignore[list-item,misc]
        assert tokens.input_tokens == len(record["prompt"])

        # llama.cpp /completion: the image between its segments, wrapped in
        # the vision start and end tokens; the first segment with BOS rules.
        prompt = {"prompt_string": f"Describe {MEDIA_MARKER} now", "multimodal_data":
                  [base64.b64encode(PNG).decode()]}
        done = await (await client.post("/completion", json={"prompt": prompt, "n_predict": 4})).json()
        record = received(log)[-1]
        head = text.encode_prompt("Describe ")
        assert record["prompt"] == [*head, VISION_START, *[IMAGE_TOKEN] * one.num_tokens, VISION_END,
                                    *text.tokenizer.encode(" now")]
        assert record["images"][0]["offset"] == len(head) + 1
        check_images(record, [one])
        assert done["tokens_evaluated"] == len(record["prompt"])

        # Text only: exactly what a text model gets, no images.
        await oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        record = received(log)[-1]
        assert record["prompt"] == text.encode_prompt(
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        assert record["images"] == []
        await oai.close()
        await ant.close()

    serve(models, check)


def test_images_count_against_the_context(models: Path) -> None:
    async def check(client: TestClient) -> None:
        small = user({"type": "text", "text": "What is this?"},
                     {"type": "image_url", "image_url": {"url": uri(PNG)}})
        response = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": small})
        assert response.status == 200, await response.text()
        # 64 image tokens and the text overflow the 64-token context.
        big = user({"type": "text", "text": "What is this?"},
                   {"type": "image_url", "image_url": {"url": uri(BIG)}})
        response = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": big})
        assert response.status == 400
        assert (await response.json())["error"]["code"] == "context_length_exceeded"
        prompt = {"prompt_string": MEDIA_MARKER, "multimodal_data": [base64.b64encode(BIG).decode()]}
        response = await client.post("/completion", json={"prompt": prompt})
        assert response.status == 400
        assert "context" in (await response.json())["error"]["message"]

    serve(models, check, "--max-context", "64")


def test_images_the_template_does_not_place_are_refused(models: Path) -> None:
    async def check(client: TestClient) -> None:
        body = {"model": "blind-template", "messages": user(
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": uri(PNG)}})}
        response = await client.post("/v1/chat/completions/input_tokens", json=body)
        error = (await response.json())["error"]
        assert response.status == 400
        assert (error["code"], error["param"]) == ("images_not_placed",
                                                   "messages[0].content[1].image_url")
        assert "chat template did not place the images" in error["message"]
        # Text that spells the image token itself has no image to fill it.
        body = {"model": MODEL, "messages": [{"role": "user", "content": "a <|image_pad|> b"}]}
        response = await client.post("/v1/chat/completions/input_tokens", json=body)
        assert response.status == 400
        assert (await response.json())["error"]["code"] == "images_not_placed"
        response = await client.post("/completion", json={"model": MODEL, "prompt": [IMAGE_TOKEN]})
        assert response.status == 400
        assert (await response.json())["error"]["reason"] == "images_not_placed"
        # Anthropic's shape.
        response = await client.post("/v1/messages/count_tokens", json={
            "model": "blind-template", "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(PNG).decode()}}]}]})
        body = await response.json()
        assert response.status == 400 and body["error"]["type"] == "invalid_request_error"
        assert "did not place the images" in body["error"]["message"]

    serve(models, check)


async def count(client: TestClient, *urls: str) -> tuple[int, dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    response = await client.post("/v1/chat/completions/input_tokens",
                                 json={"model": MODEL, "messages": user(*parts)})
    return response.status, await response.json()


def test_media_limits_take_effect(models: Path) -> None:
    def expect(code: str, *urls: str) -> Callable[[TestClient], Awaitable[None]]:
        async def check(client: TestClient) -> None:
            status, body = await count(client, *urls)
            assert (status, body["error"]["code"]) == (400, code), body
        return check

    serve(models, expect("too_many_images", uri(PNG), uri(PNG2)), "--media-max-images", "1")
    serve(models, expect("image_too_large", uri(PNG)), "--media-max-bytes", str(len(PNG) - 1))
    serve(models, expect("too_many_image_tokens", uri(PNG)), "--media-max-image-tokens", "7")

    async def fits(client: TestClient) -> None:
        status, body = await count(client, uri(PNG), uri(PNG2))
        assert status == 200, body

    serve(models, fits, "--media-max-images", "2", "--media-max-bytes", str(len(PNG)),
          "--media-max-image-tokens", "14")


def test_private_urls_need_the_flag_and_fetches_time_out(models: Path) -> None:
    async def run() -> None:
        async def image(_: web.Request) -> web.Response:
            return web.Response(body=PNG, content_type="image/png")

        async def slow(_: web.Request) -> web.Response:
            await asyncio.sleep(5)
            return web.Response(body=PNG, content_type="image/png")

        app = web.Application()
        app.router.add_get("/cat.png", image)
        app.router.add_get("/slow.png", slow)
        async with TestServer(app, host="127.0.0.1") as images:
            url, slow_url = str(images.make_url("/cat.png")), str(images.make_url("/slow.png"))
            async with router(models) as client:
                status, body = await count(client, url)
                assert (status, body["error"]["code"]) == (400, "image_url_refused"), body
            async with router(models, "--media-allow-private-urls") as client:
                status, body = await count(client, url)
                assert status == 200, body
                assert body["input_tokens"] == (await count(client, uri(PNG)))[1]["input_tokens"]
            async with router(models, "--media-allow-private-urls",
                              "--media-fetch-timeout", "0.3") as client:
                status, body = await count(client, slow_url)
                assert (status, body["error"]["code"]) == (400, "image_fetch_timeout"), body
                assert "0.3 s" in body["error"]["message"]

    asyncio.run(run())


def test_a_vision_model_without_a_processor_config_does_not_start(tmp_path: Path,
                                                                  tiny_qwen3_dir: Path) -> None:
    model = vl_model(tmp_path / "no-processor", tiny_qwen3_dir, processor=False)
    for argv in ([str(model)], ["--models-dir", str(tmp_path)]):
        with pytest.raises(ValueError, match=r"preprocessor_config\.json") as caught:
            build_catalog(parse_serve_command(["serve", *argv, "--vision"]))
        assert "'no-processor' is served with --vision" in str(caught.value)
        build_catalog(parse_serve_command(["serve", *argv]))  # without --vision it serves text
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"model\.gguf is a GGUF text model: give its vision "
                                         r"projector with --mmproj"):
        build_catalog(parse_serve_command(["serve", str(gguf), "--vision"]))


def test_media_flags_are_checked() -> None:
    from router.cli import CommandLineError

    config = parse_serve_command(["serve", "--models-dir", os.devnull, "--media-max-bytes", "10",
                                  "--media-fetch-timeout", "2.5", "--media-max-images", "3",
                                  "--media-max-image-tokens", "99", "--media-allow-private-urls"])
    assert config.media == MediaLimits(max_image_bytes=10, fetch_timeout_s=2.5, max_images=3,
                                       max_image_tokens=99)
    assert config.media_allow_private_urls
    assert parse_serve_command(["serve", "--models-dir", os.devnull]).media == MediaLimits()
    with pytest.raises(CommandLineError, match="--media-max-images must be more than 0"):
        parse_serve_command(["serve", "--models-dir", os.devnull, "--media-max-images", "0"])
