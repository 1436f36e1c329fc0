"""/completion's prompt shapes and the token ids they become."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from router.errors import RouterError
from router.http.errors import api_error
from router.llamacpp.prompt import prompt_ids, prompt_parts
from router.text.model_text import ModelText


@pytest.fixture(scope="module")
def bos_text(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path) -> ModelText:
    """The Qwen3 tokenizer, asking for <|endoftext|> (151643) as BOS."""
    target = tmp_path_factory.mktemp("bos")
    (target / "tokenizer.json").symlink_to(qwen3_tokenizer_dir / "tokenizer.json")
    config = json.loads((qwen3_tokenizer_dir / "tokenizer_config.json").read_text())
    config.update(add_bos_token=True, bos_token="<|endoftext|>")
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    (target / "config.json").write_text(json.dumps({"eos_token_id": 151645}))
    return ModelText.load(target)


@pytest.mark.parametrize(("prompt", "parts"), [
    ("text", "text"), ([1, 2], [1, 2]), ([1, "a", 2], [1, "a", 2]), (["a", 3], ["a", 3]),
    (["text"], "text"), ([[1, 2]], [1, 2]), ([["a", 1]], ["a", 1]),
    ({"prompt_string": "text"}, "text"), ([{"prompt_string": "t", "multimodal_data": []}], "t"),
])
def test_prompt_shapes(prompt: object, parts: object) -> None:
    assert prompt_parts(prompt) == parts  # type: ignore[arg-type]


@pytest.mark.parametrize(("prompt", "code"), [
    (["a", "b"], "invalid_value"), ([[1], [2]], "invalid_value"), ([], "invalid_value"),
    ([True], "invalid_type"), ([1.5], "invalid_type"), ([["a", "b"]], "invalid_type"),
    ({"prompt_string": "x", "multimodal_data": ["AAAA"]}, "invalid_value"),
    ({"text": "x"}, "invalid_type"),
])
def test_prompts_refused(prompt: object, code: str) -> None:
    with pytest.raises(RouterError) as refused:
        prompt_parts(prompt)  # type: ignore[arg-type]
    assert api_error(refused.value).status == 400 and refused.value.code == code


def test_bos_only_before_a_leading_string(bos_text: ModelText) -> None:
    hi = bos_text.tokenizer.encode("hi")
    ids = asyncio.run(prompt_ids(prompt_parts("hi"), bos_text))
    assert ids == [151643, *hi]
    assert asyncio.run(prompt_ids(["hi", 5, "hi"], bos_text)) == [151643, *hi, 5, *hi]
    assert asyncio.run(prompt_ids([5, "hi"], bos_text)) == [5, *hi]
    assert asyncio.run(prompt_ids([5, 6], bos_text)) == [5, 6]
    with pytest.raises(RouterError):
        asyncio.run(prompt_ids([5, -1], bos_text))
