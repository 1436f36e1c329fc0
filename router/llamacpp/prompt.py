"""/completion's `prompt` in every shape llama.cpp accepts, turned into token ids.

    "text"                                    a string
    [12, 34, 56]                              token ids
    [12, 34, "text", 56]                      a mix: strings are tokenized in place
    {"prompt_string": "text"}                 llama.cpp's multimodal form, without media
    ["text"], [[12, 34]], [[12, "text"]]      a list holding one of the above

A BOS token is put in front, when the model wants one, only if the prompt
starts with a string (llama.cpp's rule). Several prompts in one request
(["a", "b"]) are refused: this server answers one prompt per request.
"""

from __future__ import annotations

from typing import Any

from router.http.errors import invalid
from router.llamacpp.params import not_supported
from router.text.model_text import ModelText

PromptParts = str | list[int | str]


def _is_id(item: Any) -> bool:
    return isinstance(item, int) and not isinstance(item, bool)


def _is_mix(items: list[Any]) -> bool:
    """Token ids, or ids and strings together (llama.cpp's "mixed" prompt)."""
    return all(_is_id(i) or isinstance(i, str) for i in items) and any(_is_id(i) for i in items)


def _from_object(value: dict[str, Any]) -> str:
    if value.get("multimodal_data"):
        raise not_supported("multimodal_data", "'multimodal_data' is not supported: this server "
                            "serves text models only")
    text = value.get("prompt_string")
    if not isinstance(text, str):
        raise invalid("a prompt object needs a string 'prompt_string'", "prompt.prompt_string",
                      "invalid_type")
    return text


def prompt_parts(prompt: str | list[Any] | dict[str, Any]) -> PromptParts:
    """The one prompt of a request, as a string or a list of ids and strings."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        return _from_object(prompt)
    if not prompt:
        raise invalid("'prompt' is empty", "prompt")
    if _is_mix(prompt):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str | dict | list):
        (single,) = prompt
        if isinstance(single, list) and not _is_mix(single):
            raise invalid("'prompt[0]' must be token ids or token ids mixed with strings", "prompt[0]",
                          "invalid_type")
        return prompt_parts(single)
    if len(prompt) > 1 and all(isinstance(p, str | list | dict) for p in prompt):
        raise invalid(f"'prompt' holds {len(prompt)} prompts; send one prompt per request", "prompt")
    raise invalid("'prompt' must be a string, token ids, or token ids mixed with strings", "prompt",
                  "invalid_type")


async def prompt_ids(parts: PromptParts, text: ModelText) -> list[int]:
    if isinstance(parts, str):
        ids = await text.encode_prompt_async(parts)
    else:
        ids = []
        for index, item in enumerate(parts):
            if isinstance(item, str):
                # Only a leading string gets the model's BOS.
                ids += (await text.encode_prompt_async(item) if index == 0
                        else await text.tokenizer.encode_async(item))
            else:
                ids.append(item)
    if not ids:
        raise invalid("'prompt' is empty", "prompt")
    bad = next((t for t in ids if t < 0), None)
    if bad is not None:
        raise invalid(f"token id {bad} in 'prompt' is negative", "prompt")
    return ids
