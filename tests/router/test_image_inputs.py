"""Image inputs of every API parsed into one shape (router/chat/image_parts.py):
ImageRefs in order of appearance, each naming its request field, and
{"type": "image"} parts where the images stood; bad shapes are 400s naming
the field; text-only messages keep string content."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.anthropic.request import chat_request as anthropic_chat
from router.anthropic.schemas import MessagesRequest
from router.errors import RouterError
from router.http.errors import api_error
from router.llamacpp.prompt import MEDIA_MARKER, MediaPrompt, prompt_images, prompt_parts
from router.media.types import ImageRef
from router.openai.chat_request import chat_request as openai_chat
from router.openai.schemas import ChatCompletionRequest
from router.responses.request_map import build_plan
from router.responses.schema import ResponsesRequest
from router.responses.store import ResponseStore, stored

PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5E"
       "rkJggg==")
DATA_URI = f"data:image/png;base64,{PNG}"
URL = "https://example.com/cat.jpg"
TEXT, IMAGE = ({"type": "text", "text": "What is this?"}, {"type": "image"})


def refused(call: Any) -> RouterError:
    with pytest.raises(RouterError) as caught:
        call()
    assert api_error(caught.value).status == 400
    return caught.value


# ---- Chat Completions ----------------------------------------------------------


def openai(messages: list[dict[str, Any]]):  # type: ignore[no-untyped-def]
    return openai_chat(msgspec.convert({"model": "m", "messages": messages}, ChatCompletionRequest))


def test_chat_image_url_parts_become_refs_in_order() -> None:
    chat = openai([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": DATA_URI, "detail": "low"}},
            # vLLM's form: the URL as a bare string.
            {"type": "image_url", "image_url": URL}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": URL, "detail": "high"}}]},
    ])
    assert chat.images == (
        ImageRef(DATA_URI, "messages[1].content[1].image_url", "low"),
        ImageRef(URL, "messages[1].content[2].image_url", "auto"),
        ImageRef(URL, "messages[3].content[0].image_url", "high"),
    )
    assert [m["content"] for m in chat.messages] == [
        "Be brief.", [TEXT, IMAGE, IMAGE], "A cat.", [IMAGE]]


def test_chat_text_parts_alone_stay_a_string() -> None:
    chat = openai([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert chat.messages == [{"role": "user", "content": "a\nb"}] and chat.images == ()


@pytest.mark.parametrize(("part", "role", "param", "code"), [
    ({"type": "image_url", "image_url": {"url": URL}}, "system", "messages[0].content[0].type", "invalid_value"),
    ({"type": "image_url", "image_url": {"url": URL}}, "assistant", "messages[0].content[0].type", "invalid_value"),
    ({"type": "image_url", "image_url": {"url": URL}}, "tool", "messages[0].content[0].type", "invalid_value"),
    ({"type": "image_url", "image_url": {}}, "user", "messages[0].content[0].image_url.url",
     "missing_required_parameter"),
    ({"type": "image_url"}, "user", "messages[0].content[0].image_url", "missing_required_parameter"),
    ({"type": "image_url", "image_url": 7}, "user", "messages[0].content[0].image_url", "invalid_type"),
    ({"type": "image_url", "image_url": {"url": ""}}, "user", "messages[0].content[0].image_url.url",
     "invalid_value"),
    ({"type": "image_url", "image_url": {"url": URL, "detail": "ultra"}}, "user",
     "messages[0].content[0].image_url.detail", "invalid_value"),
    ({"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}, "user",
     "messages[0].content[0].type", "invalid_value"),
    ({"type": "file", "file": {"file_id": "file-1"}}, "user", "messages[0].content[0].type", "invalid_value"),
])
def test_chat_bad_image_parts(part: dict[str, Any], role: str, param: str, code: str) -> None:
    error = refused(lambda: openai([{"role": role, "content": [part]}, {"role": "user", "content": "hi"}]))
    assert (error.param, error.code) == (param, code)


# ---- Anthropic Messages --------------------------------------------------------


def anthropic(messages: list[dict[str, Any]], **fields: Any):  # type: ignore[no-untyped-def]
    return anthropic_chat(msgspec.convert({"model": "m", "max_tokens": 8, "messages": messages, **fields},
                                          MessagesRequest))


def test_anthropic_image_blocks_and_tool_results_become_refs_in_order() -> None:
    chat = anthropic([
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
            {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "is_error": True, "content": [
                {"type": "text", "text": "blurry"},
                {"type": "image", "source": {"type": "url", "url": URL}}]},
            {"type": "text", "text": "And now?"}]},
    ])
    assert chat.images == (ImageRef(DATA_URI, "messages[0].content[0].source"),
                           ImageRef(URL, "messages[2].content[0].content[1].source"))
    user, _, tool, after = chat.messages
    assert user == {"role": "user", "content": [IMAGE, TEXT]}
    # The error prefix stays in front of the text, as for a text-only result.
    assert tool["content"] == [{"type": "text", "text": "Error: "}, {"type": "text", "text": "blurry"}, IMAGE]
    assert after == {"role": "user", "content": "And now?"}


@pytest.mark.parametrize(("messages", "fields", "param"), [
    ([{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}], {},
     "messages[0].content[0].source.type"),
    ([{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/tiff",
                                                                 "data": PNG}}]}], {},
     "messages[0].content[0].source.media_type"),
    ([{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png"}}]}],
     {}, "messages[0].content[0].source.data"),
    ([{"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]}], {},
     "messages[0].content[0].source.url"),
    ([{"role": "user", "content": [{"type": "image"}]}], {}, "messages[0].content[0].source"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "image", "source": {"type": "url", "url": URL}}]}, {"role": "user", "content": "hi"}], {},
     "messages[1].content[0].type"),
    ([{"role": "user", "content": "hi"}], {"system": [{"type": "image", "source": {"type": "url", "url": URL}}]},
     "system[0].type"),
    ([{"role": "user", "content": [{"type": "document", "source": {"type": "url", "url": URL}}]}], {},
     "messages[0].content[0].type"),
])
def test_anthropic_bad_image_blocks(messages: list[dict[str, Any]], fields: dict[str, Any], param: str) -> None:
    error = refused(lambda: anthropic(messages, **fields))
    # Anthropic's envelope has no param: the message starts with the field.
    assert error.param == param and error.message.startswith(f"{param}: ")


# ---- Responses -----------------------------------------------------------------


def responses(store: ResponseStore | None = None, **fields: Any):  # type: ignore[no-untyped-def]
    req = msgspec.convert({"model": "m", **fields}, ResponsesRequest)
    return build_plan(req, store or ResponseStore(10, 1 << 20))


def test_responses_input_image_parts_become_refs_and_persist_across_turns() -> None:
    store = ResponseStore(10, 1 << 20)
    first = responses(store, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": DATA_URI, "detail": "high"}]}])
    assert first.chat.images == (ImageRef(DATA_URI, "input[0].content[1].image_url", "high"),)
    assert first.chat.messages == [{"role": "user", "content": [TEXT, IMAGE]}]
    # input_items lists the image as OpenAI does.
    assert first.input_items[0]["content"][1] == {"type": "input_image", "image_url": DATA_URI,
                                                  "detail": "high", "file_id": None}
    answer = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "A cat.", "annotations": []}]}
    store.put(stored({"id": "resp_1", "output": [answer]}, first.input_items, None))
    second = responses(store, previous_response_id="resp_1", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "And this one?"}, {"type": "input_image", "image_url": URL}]}])
    # The earlier turn's image comes first and names the field that brought it back.
    assert second.chat.images == (ImageRef(DATA_URI, "previous_response_id", "high"),
                                  ImageRef(URL, "input[0].content[1].image_url", "auto"))
    assert [m["content"] for m in second.chat.messages] == [
        [TEXT, IMAGE], "A cat.", [{"type": "text", "text": "And this one?"}, IMAGE]]


def test_responses_text_only_input_is_unchanged() -> None:
    plan = responses(input=[{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]}])
    assert plan.chat.messages == [{"role": "user", "content": "a\nb"}] and plan.chat.images == ()


@pytest.mark.parametrize(("part", "role", "param"), [
    ({"type": "input_image", "file_id": "file-abc"}, "user", "input[0].content[0].file_id"),
    ({"type": "input_image"}, "user", "input[0].content[0].image_url"),
    ({"type": "input_image", "image_url": URL, "detail": "max"}, "user", "input[0].content[0].detail"),
    ({"type": "input_image", "image_url": URL}, "developer", "input[0].content[0].type"),
    ({"type": "input_file", "file_data": "AA=="}, "user", "input[0].content[0].type"),
])
def test_responses_bad_image_parts(part: dict[str, Any], role: str, param: str) -> None:
    error = refused(lambda: responses(input=[{"role": role, "content": [part]},
                                             {"role": "user", "content": "hi"}]))
    assert error.param == param


# ---- llama.cpp /completion -----------------------------------------------------


def test_multimodal_prompt_is_cut_at_its_markers() -> None:
    parts = prompt_parts({"prompt_string": f"A {MEDIA_MARKER} and {MEDIA_MARKER}: compare.",
                          "multimodal_data": [PNG, DATA_URI]})
    assert parts == MediaPrompt(("A ", " and ", ": compare."), (
        ImageRef(DATA_URI, "prompt.multimodal_data[0]"), ImageRef(DATA_URI, "prompt.multimodal_data[1]")))
    assert prompt_images(parts) == parts.images
    assert parts.text == f"A {MEDIA_MARKER} and {MEDIA_MARKER}: compare."
    # A one-element list holds the same prompt; a prompt without media stays text.
    assert prompt_parts([{"prompt_string": f"{MEDIA_MARKER}", "multimodal_data": [PNG]}]).segments == ("", "")
    assert prompt_parts({"prompt_string": "text", "multimodal_data": []}) == "text"
    assert prompt_images("text") == ()


@pytest.mark.parametrize(("prompt", "param", "code"), [
    ({"prompt_string": "no marker", "multimodal_data": [PNG]}, "prompt.multimodal_data", "invalid_value"),
    ({"prompt_string": f"{MEDIA_MARKER}{MEDIA_MARKER}", "multimodal_data": [PNG]}, "prompt.multimodal_data",
     "invalid_value"),
    ({"prompt_string": MEDIA_MARKER, "multimodal_data": [3]}, "prompt.multimodal_data[0]", "invalid_type"),
    ({"prompt_string": MEDIA_MARKER, "multimodal_data": PNG}, "prompt.multimodal_data", "invalid_type"),
])
def test_bad_multimodal_prompts(prompt: dict[str, Any], param: str, code: str) -> None:
    error = refused(lambda: prompt_parts(prompt))
    assert (error.param, error.code) == (param, code)
