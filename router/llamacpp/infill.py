"""POST /infill: llama.cpp's fill-in-the-middle completion for code models.

The client sends the text around the cursor as plain text; the server finds
the model's FIM tokens in its vocabulary and builds the prompt the way
llama.cpp's server does (format_prompt_infill, the repo-level pattern of
Qwen2.5-Coder):

    <|repo_name|>myproject\\n                 (when the vocabulary has one)
    <|file_sep|>{filename}\\n{text}           one per input_extra chunk
    <|file_sep|>filename\\n                    (when the vocabulary has one)
    [BOS]<|fim_prefix|>{input_prefix}{prompt}<|fim_suffix|>{input_suffix}<|fim_middle|>

A vocabulary without a file separator gets "\\n\\n--- snippet ---\\n\\n" before
each chunk instead. Prefix, suffix and extra chunks are tokenized with special
tokens read as plain text; `prompt` (text to continue from) with them parsed.
The prefix keeps its last 3/4 of a step's budget (--max-batched-tokens,
llama.cpp's n_batch), the suffix its first 1/4 less the prompt, and the extra
context its last tokens that fit in the context less a step's budget and
twice n_predict. The generation is /completion's (router/llamacpp/completion.py)
and so is the answer; the model's FIM pad, repo and file separator tokens
also end it, as in llama.cpp. A model without FIM prefix, suffix and middle
tokens is refused with llama.cpp's message (400; llama.cpp itself says 501).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from aiohttp import web

from router.http.errors import ApiError, decode_body, invalid
from router.http.keys import MANAGER
from router.lifecycle import ModelSlot
from router.llamacpp.completion import serve_completion
from router.llamacpp.grammar import grammar_spec
from router.llamacpp.params import completion_settings
from router.llamacpp.schemas import CompletionRequest
from router.text.token_pieces import pieces_for
from router.text.tokenizer import Tokenizer

# The spellings llama.cpp's vocabulary loader recognizes, per role.
FIM_SPELLINGS: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
# llama.cpp's fixed names: the project before the extra files, the file being edited after.
REPO_NAME = "myproject\n"
CURRENT_FILE = "filename\n"
DEFAULT_FILENAME = "tmp"
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"


class ExtraChunk(msgspec.Struct):
    text: str
    filename: str = DEFAULT_FILENAME


class InfillRequest(CompletionRequest, kw_only=True):
    # A string, or token ids mixed with strings (as /completion's prompt).
    input_prefix: str | list[int | str]
    input_suffix: str | list[int | str]
    input_extra: list[ExtraChunk] = msgspec.field(default_factory=list)
    # Text the middle starts with, after the prefix.
    prompt: str = ""  # type: ignore[assignment]


@dataclass(frozen=True)
class FimTokens:
    pre: int | None
    suf: int | None
    mid: int | None
    pad: int | None
    rep: int | None
    sep: int | None

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> FimTokens:
        def find(role: str) -> int | None:
            return next((i for s in FIM_SPELLINGS[role] if (i := tokenizer.token_to_id(s)) is not None),
                        None)

        return cls(**{role: find(role) for role in FIM_SPELLINGS})

    def missing(self) -> str:
        """llama.cpp's list of what is missing ("" when infill works)."""
        return "".join(f"{name} token is missing. " for name, token in
                       (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid))
                       if token is None)

    @property
    def end_ids(self) -> tuple[int, ...]:
        return tuple(t for t in (self.pad, self.rep, self.sep) if t is not None)


@dataclass(frozen=True)
class InfillParts:
    """The request's pieces as token ids, before the context is known."""

    prefix: list[int]
    suffix: list[int]
    prompt: list[int]
    extra: list[int]

    def assemble(self, fim: FimTokens, tokenizer: Tokenizer, n_batch: int, n_ctx: int,
                 n_predict: int) -> list[int]:
        assert fim.pre is not None and fim.suf is not None and fim.mid is not None
        prefix_take = min(len(self.prefix), 3 * (n_batch // 4))
        suffix_take = min(len(self.suffix), max(0, n_batch // 4 - (2 + len(self.prompt))))
        extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(self.extra))
        head = [fim.pre, *self.prefix[len(self.prefix) - prefix_take:], *self.prompt]
        if tokenizer.add_bos_token and tokenizer.bos_token_id is not None:
            head.insert(0, tokenizer.bos_token_id)
        extra = self.extra[len(self.extra) - extra_take:]
        return [*extra, *head, fim.suf, *self.suffix[:suffix_take], fim.mid]


async def _plain_ids(tokenizer: Tokenizer, value: str | list[int | str], name: str) -> list[int]:
    pieces = pieces_for(tokenizer)
    if isinstance(value, str):
        return await pieces.encode_plain(value)
    ids: list[int] = []
    for index, item in enumerate(value):
        if isinstance(item, str):
            ids += await pieces.encode_plain(item)
        elif 0 <= item < tokenizer.vocab_size:
            ids.append(item)
        else:
            raise invalid(f"token id {item} in '{name}' is outside the vocabulary "
                          f"(0..{tokenizer.vocab_size - 1})", f"{name}[{index}]")
    return ids


async def _extra_ids(tokenizer: Tokenizer, fim: FimTokens, chunks: list[ExtraChunk]) -> list[int]:
    plain = pieces_for(tokenizer).encode_plain
    ids: list[int] = []
    if fim.rep is not None:
        ids += [fim.rep, *await plain(REPO_NAME)]
    for chunk in chunks:
        if fim.sep is not None:
            ids += [fim.sep, *await plain(chunk.filename + "\n")]
        else:
            ids += await plain(SNIPPET_SEPARATOR)
        ids += await plain(chunk.text)
    if fim.sep is not None:
        ids += [fim.sep, *await plain(CURRENT_FILE)]
    return ids


async def infill(request: web.Request) -> web.StreamResponse:
    req = decode_body(await request.read(), InfillRequest)
    settings = completion_settings(req)
    grammar = grammar_spec(req)

    manager = request.app[MANAGER]
    slot = manager.resolve(req.model)
    text = await manager.text_for(slot)
    tokenizer = text.tokenizer
    fim = FimTokens.of(tokenizer)
    missing = fim.missing()
    if missing:
        raise ApiError(400, f"Infill is not supported by this model: {missing}",
                       type="not_supported_error", code="infill_not_supported", param="model")
    parts = InfillParts(
        prefix=await _plain_ids(tokenizer, req.input_prefix, "input_prefix"),
        suffix=await _plain_ids(tokenizer, req.input_suffix, "input_suffix"),
        prompt=await tokenizer.encode_async(req.prompt),
        extra=await _extra_ids(tokenizer, fim, req.input_extra),
    )

    def build(leased: ModelSlot) -> list[int]:
        assert leased.ready is not None
        return parts.assemble(fim, tokenizer, leased.ready.kv.max_batched_tokens,
                              leased.max_context, settings.n_predict)

    return await serve_completion(request, req, slot, text, build, settings, grammar,
                                  extra_eos=fim.end_ids)

