"""/infill's prompt assembly (llama.cpp's format_prompt_infill) on real vocabularies."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from router.llamacpp.infill import ExtraChunk, FimTokens, InfillParts, _extra_ids, _plain_ids
from router.text.model_text import ModelText


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer_dir: Path) -> ModelText:
    return ModelText.load(qwen3_tokenizer_dir)


def test_qwen_vocabulary_has_every_fim_token(qwen3: ModelText) -> None:
    fim = FimTokens.of(qwen3.tokenizer)
    ids = qwen3.tokenizer.token_to_id
    assert (fim.pre, fim.suf, fim.mid) == (ids("<|fim_prefix|>"), ids("<|fim_suffix|>"),
                                           ids("<|fim_middle|>"))
    assert (fim.rep, fim.sep, fim.pad) == (ids("<|repo_name|>"), ids("<|file_sep|>"), ids("<|fim_pad|>"))
    assert fim.missing() == "" and set(fim.end_ids) == {fim.pad, fim.rep, fim.sep}


def test_smollm2_has_none_and_says_so_as_llamacpp_does(smollm2_gguf: Path) -> None:
    fim = FimTokens.of(ModelText.load(smollm2_gguf).tokenizer)
    assert fim.missing() == ("prefix token is missing. suffix token is missing. "
                             "middle token is missing. ")
    assert fim.rep is not None  # <reponame>, as llama.cpp finds it too


def parts(text: ModelText, prefix: str, suffix: str, prompt: str = "",
          extra: list[ExtraChunk] | None = None) -> InfillParts:
    tokenizer, fim = text.tokenizer, FimTokens.of(text.tokenizer)

    async def build() -> InfillParts:
        return InfillParts(await _plain_ids(tokenizer, prefix, "input_prefix"),
                           await _plain_ids(tokenizer, suffix, "input_suffix"),
                           tokenizer.encode(prompt), await _extra_ids(tokenizer, fim, extra or []))

    return asyncio.run(build())


def test_repo_level_prompt(qwen3: ModelText) -> None:
    fim = FimTokens.of(qwen3.tokenizer)
    built = parts(qwen3, "def f():\n", "\nprint(f())\n", "    ret",
                  [ExtraChunk("X = 1\n", "a.py"), ExtraChunk("Y = 2\n")])
    ids = built.assemble(fim, qwen3.tokenizer, n_batch=2048, n_ctx=4096, n_predict=-1)
    assert qwen3.tokenizer.decode(ids, skip_special_tokens=False) == (
        "<|repo_name|>myproject\n<|file_sep|>a.py\nX = 1\n<|file_sep|>tmp\nY = 2\n"
        "<|file_sep|>filename\n<|fim_prefix|>def f():\n    ret<|fim_suffix|>\nprint(f())\n<|fim_middle|>")


def test_special_tokens_in_the_text_are_plain_text(qwen3: ModelText) -> None:
    fim = FimTokens.of(qwen3.tokenizer)
    end = qwen3.tokenizer.token_to_id("<|im_end|>")
    built = parts(qwen3, "a<|im_end|>b", "<|im_end|>")
    assert end not in built.assemble(fim, qwen3.tokenizer, 2048, 4096, -1)


def test_prefix_suffix_and_extra_are_cut_as_llamacpp_cuts_them(qwen3: ModelText) -> None:
    fim = FimTokens.of(qwen3.tokenizer)
    built = parts(qwen3, " one" * 100, " two" * 100, " go", [ExtraChunk(" three" * 100, "b.py")])
    assert len(built.prefix) == len(built.suffix) == 100 and len(built.prompt) == 1
    ids = built.assemble(fim, qwen3.tokenizer, n_batch=64, n_ctx=200, n_predict=10)
    pre, suf, mid = ids.index(fim.pre), ids.index(fim.suf), ids.index(fim.mid)
    # The prefix keeps its last 3/4 of a batch, the suffix its first quarter
    # less the prompt and two, the extra its last n_ctx - n_batch - 2 n_predict.
    assert ids[pre + 1:suf] == built.prefix[-48:] + built.prompt
    assert ids[suf + 1:mid] == built.suffix[:16 - 3]
    assert ids[:pre] == built.extra[-(200 - 64 - 20):]
    assert mid == len(ids) - 1
