"""Model directories for the scripted engine (tests/support/scripted_engine.py):
the tiny Qwen3's tokenizer, template and config, plus the script it answers from."""

from __future__ import annotations

import json
from pathlib import Path

ENGINE_ENV = {"ROUNDHOUSE_ENGINE_MODULE": "tests.support.scripted_engine"}

WEATHER_CALL = {"city": "Paris", "unit": "celsius"}

QWEN3_SCRIPT = {
    "rules": [
        {"when": "What's the weather in Paris",
         "reply": "<think>\nThe user asks about the weather, so I call the tool.\n</think>\n\n"
                  "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                  + json.dumps(WEATHER_CALL) + "}\n</tool_call>"},
        {"when": "Compare Paris and Rome",
         "reply": "<think>\nTwo cities, two calls.\n</think>\n\n"
                  "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
                  "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>"},
        {"when": "<tool_response>",
         "reply": "<think>\nThe tool says it is sunny.\n</think>\n\nIt is sunny and 24°C in Paris."},
        {"when": "Say hello",
         "reply": "<think>\nA greeting deserves a greeting.\n</think>\n\nHello! How can I help you today?"},
        {"when": "How do tools work",
         "reply": "<think>\nExplain, don't call.\n</think>\n\n"
                  "The model writes `<tool_call>` and a JSON object; in a code block:\n"
                  "```\n<tool_call>\n{\"name\": \"x\"}\n</tool_call>\n```\nThat is all."},
        {"when": "Break the call",
         "reply": "<tool_call>\n{\"name\": \n</tool_call> sorry"},
        {"when": "Tell me a long story",
         "reply": "Once upon a time " + "there was a roundhouse full of engines, " * 150 + "the end."},
    ],
    "default": "<think>\nNothing to do.\n</think>\n\nI can only help with the weather.",
}

CODER_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call one as <tool_call>
<function=NAME>
<parameter=NAME>
value
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CODER_SCRIPT = {
    "rules": [
        {"when": "What's the weather in Paris",
         "reply": "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"},
    ],
    "default": "No tools needed.",
}


def scripted_model(target: Path, base: Path, script: dict, template: str | None = None) -> Path:
    """A model directory answering from `script`, on `base`'s tokenizer."""
    target.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        if (base / name).exists():
            (target / name).symlink_to(base / name)
    if template is not None:
        (target / "chat_template.jinja").write_text(template)
    (target / "script.json").write_text(json.dumps(script))
    return target
