"""Chat rendering must equal transformers' apply_chat_template(tokenize=False), then the same ids."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import pytest

from router.text import ChatTemplate, ModelText, TemplateError

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather <now> & \"later\", in °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}

MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan? 日本"},
]
NO_SYSTEM = [{"role": "user", "content": "Hi there"}]
TOOL_ROUND = [
    {"role": "system", "content": "Use tools when useful."},
    {"role": "user", "content": "Weather in Paris and Tōkyō?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "c2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Tōkyō"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 21}'},
    {"role": "tool", "tool_call_id": "c2", "content": '{"temp_c": 17}'},
]
REASONING = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "6", "reasoning_content": "add again"},
]

SMOLLM2_CASES: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    (MULTI_TURN, {}),
    (NO_SYSTEM, {}),
    (MULTI_TURN[:3], {"add_generation_prompt": False}),
]
QWEN3_CASES: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    (MULTI_TURN, {}),
    (NO_SYSTEM, {"enable_thinking": False}),
    (TOOL_ROUND, {"tools": [WEATHER_TOOL]}),
    (TOOL_ROUND[1:], {"tools": [WEATHER_TOOL], "enable_thinking": False}),
    (REASONING, {"add_generation_prompt": False}),
    (REASONING[:2], {}),
]


def _case_id(case: tuple[list[dict[str, Any]], dict[str, Any]]) -> str:
    messages, kwargs = case
    return f"{len(messages)}msgs-" + "-".join(f"{k}={v!s:.8}" for k, v in kwargs.items())


def _check_same_as_transformers(model: ModelText, hf, messages: list[dict[str, Any]],
                                kwargs: dict[str, Any], reference_ids) -> None:
    kwargs = dict(kwargs)
    add_generation_prompt = kwargs.pop("add_generation_prompt", True)
    expected = hf.apply_chat_template(messages, tokenize=False,
                                      add_generation_prompt=add_generation_prompt, **kwargs)
    rendered = model.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    assert rendered == expected
    assert model.encode_prompt(rendered) == reference_ids(expected)


@pytest.mark.parametrize("case", SMOLLM2_CASES, ids=_case_id)
def test_smollm2_renders_like_transformers(smollm2_text: ModelText, hf_smollm2,
                                           hf_smollm2_digits, case) -> None:
    _check_same_as_transformers(smollm2_text, hf_smollm2, *case,
                                lambda text: hf_smollm2_digits.encode(text).ids)


def test_smollm2_inserts_its_default_system_prompt(smollm2_text: ModelText) -> None:
    rendered = smollm2_text.render_chat(NO_SYSTEM)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("case", QWEN3_CASES, ids=_case_id)
def test_qwen3_renders_like_transformers(qwen3_text: ModelText, hf_qwen3, case) -> None:
    _check_same_as_transformers(qwen3_text, hf_qwen3, *case,
                                lambda text: hf_qwen3.encode(text, add_special_tokens=False))


def test_qwen3_tool_rendering_details(qwen3_text: ModelText) -> None:
    rendered = qwen3_text.render_chat(TOOL_ROUND, tools=[WEATHER_TOOL], enable_thinking=False)
    # tojson keeps <, >, &, quotes and non-ASCII as they are.
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in rendered
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rendered
    assert rendered.count("<tool_response>") == 2
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_null_fields_are_dropped_like_transformers(qwen3_text: ModelText, hf_qwen3) -> None:
    messages = [{"role": "user", "content": "hi", "name": None},
                {"role": "assistant", "content": "yo", "reasoning_content": None}]
    assert qwen3_text.render_chat(messages, add_generation_prompt=False) == \
        hf_qwen3.apply_chat_template(messages, tokenize=False)


def test_reasoning_aliases_reach_the_template(qwen3_text: ModelText, hf_qwen3) -> None:
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "reasoning": "because"}]
    rendered = qwen3_text.render_chat(messages, add_generation_prompt=False)
    assert "<think>\nbecause\n</think>" in rendered
    assert rendered == hf_qwen3.apply_chat_template(messages, tokenize=False)


@pytest.mark.parametrize("content", ["The answer is", "The answer is  ", "<think>\nhm"])
def test_continue_final_message_like_transformers(qwen3_text: ModelText, hf_qwen3,
                                                  content: str) -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}]
    expected = hf_qwen3.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert qwen3_text.render_chat(messages, add_generation_prompt=False,
                                  continue_final_message=True) == expected


def test_template_rejections_are_template_errors(qwen3_text: ModelText) -> None:
    strict = ChatTemplate("{% if messages[0].role != 'user' %}"
                          "{{ raise_exception('first message must be from the user') }}{% endif %}ok")
    assert strict.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TemplateError, match="first message must be from the user"):
        strict.render([{"role": "assistant", "content": "x"}])
    with pytest.raises(TemplateError):
        qwen3_text.render_chat([])
    with pytest.raises(TemplateError):  # Qwen3 reads message.content of every message
        qwen3_text.render_chat([{"role": "assistant", "tool_calls": []}])
    with pytest.raises(TemplateError):
        qwen3_text.render_chat(["not a message"])  # type: ignore[list-item]
    assert issubclass(TemplateError, ValueError)


def test_string_methods_on_list_content_are_template_errors(qwen3_text: ModelText) -> None:
    # A text model's template given an image part: Python's own string
    # methods, called by the template on a list, must answer 400, not 500.
    parts = [{"type": "text", "text": "hi"}, {"type": "image"}]
    for source in ("{% for m in messages %}{{ m.content.startswith('x') }}{% endfor %}",
                   "{% for m in messages %}{{ m.content.strip() }}{% endfor %}",
                   "{{ messages[0].content.split('x') }}"):
        with pytest.raises(TemplateError, match="chat template error"):
            ChatTemplate(source).render([{"role": "user", "content": parts}])
    with pytest.raises(TemplateError):
        qwen3_text.render_chat([{"role": "user", "content": parts}])


def test_syntax_errors_surface_at_construction() -> None:
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}{{ m.content }}")


def test_environment_matches_transformers(hf_qwen3) -> None:
    source = ("{{ bos_token }}{% for m in messages %}\n"
              "  {{ m | tojson }}|{{ m | tojson(indent=2) }}|{{ strftime_now('%Y') }}\n"
              "    {% if loop.last %}{% break %}{% endif %}\n"
              "{% endfor %}{% generation %}{{ eos_token }}{% endgeneration %}\n")
    messages = [{"role": "user", "content": "<b>é</b>"}, {"role": "user", "content": "never"}]
    rendered = ChatTemplate(source).render(messages[:1], bos_token="<s>", eos_token="</s>")
    assert rendered == hf_qwen3.apply_chat_template(
        messages[:1], chat_template=source, tokenize=False, bos_token="<s>", eos_token="</s>")
    compact = '{"role": "user", "content": "<b>é</b>"}'
    indented = '{\n  "role": "user",\n  "content": "<b>é</b>"\n}'
    # trim_blocks eats the newline after a block tag, lstrip_blocks the indent
    # before one; the template's own final newline is dropped.
    assert rendered == f"<s>  {compact}|{indented}|{datetime.now():%Y}\n</s>"


def test_undefined_special_tokens_render_empty() -> None:
    assert ChatTemplate("[{{ bos_token }}]{{ bos_token is defined }}").render(
        [{"role": "user", "content": "x"}]) == "[]False"


def test_tool_use_variant_is_chosen_when_tools_are_given() -> None:
    template = ChatTemplate("plain", tool_use_source="tools:{{ tools | length }}")
    message = [{"role": "user", "content": "x"}]
    assert template.render(message) == "plain"
    assert template.render(message, tools=[WEATHER_TOOL]) == "tools:1"


def test_messages_are_not_mutated(qwen3_text: ModelText) -> None:
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "reasoning": "r", "extra": None}]
    snapshot = json.dumps(messages)
    qwen3_text.render_chat(messages, add_generation_prompt=False)
    qwen3_text.render_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert json.dumps(messages) == snapshot
