"""Everything the router needs to turn one model's messages into token ids and back.

Loading reads metadata only (GGUF key-values, or the small JSON files of a
Hugging Face directory), never weights, so /tokenize and chat rendering work
for a model that is not loaded, and loading a catalog stays quick.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from protocol.gguf_file import read_gguf_metadata
from router.text.chat_template import CHATML_TEMPLATE, ChatTemplate, TemplateError
from router.text.offload import off_loop
from router.text.tokenizer import Tokenizer, special_token_content

log = logging.getLogger(__name__)

# A split GGUF's metadata lives in its first shard.
_FIRST_SHARD = re.compile(r"-00001-of-\d{5}\.gguf$")

# Conversations up to about this many characters render in a millisecond or
# less: on the event loop, where a thread hop would cost more than it saves.
INLINE_RENDER_SIZE = 32_768
_MESSAGE_SIZE, _NESTED_SIZE = 256, 1024

# Template variables the server sets from the request itself; a request's
# chat_template_kwargs may not set them (router/openai/chat_request.py).
RENDERER_ARGUMENTS = frozenset({"messages", "tools", "add_generation_prompt",
                                "continue_final_message"})


@dataclass(frozen=True)
class ModelText:
    """One model's tokenizer, chat template and the token ids that end a generation."""

    path: Path
    tokenizer: Tokenizer
    template: ChatTemplate
    template_origin: str  # where the template came from, e.g. "tokenizer_config.json" or "chatml-fallback"
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    context_length: int | None
    special_tokens: Mapping[str, str]  # bos_token, eos_token, ... as the template sees them
    # --chat-template-kwargs: variables every rendering gets unless the request sets them.
    template_defaults: Mapping[str, Any] = field(default_factory=dict)

    def with_overrides(self, template: str | None, template_defaults: Mapping[str, Any]) -> ModelText:
        """This text side with the server's --chat-template (source text, already
        known to compile) and --chat-template-kwargs applied."""
        changed = replace(self, template_defaults=dict(template_defaults))
        if template is not None:
            changed = replace(changed, template=ChatTemplate(template), template_origin="--chat-template")
        return changed

    @classmethod
    def load(cls, path: str | Path) -> ModelText:
        """Load from a .gguf file, a Hugging Face directory, or a directory holding one GGUF."""
        path = Path(path)
        if path.is_file():
            if path.suffix != ".gguf":
                raise ValueError(f"{path} is not a .gguf file or a model directory")
            return cls._from_gguf(path)
        if not path.is_dir():
            raise ValueError(f"{path} does not exist")
        if (path / "tokenizer.json").is_file():
            return cls._from_hf_dir(path)
        ggufs = sorted(path.glob("*.gguf"))
        shards = [p for p in ggufs if _FIRST_SHARD.search(p.name)]
        if len(ggufs) == 1 or (len(shards) == 1 and all("-of-" in p.name for p in ggufs)):
            return cls._from_gguf(shards[0] if shards else ggufs[0])
        if ggufs:
            names = ", ".join(p.name for p in ggufs)
            raise ValueError(f"{path} holds several GGUF files ({names}); name the one to use")
        if (path / "tokenizer.model").is_file():
            raise ValueError(f"{path} has only a SentencePiece tokenizer.model; "
                             "a tokenizer.json (Hugging Face fast tokenizer) is needed")
        raise ValueError(f"{path} has no tokenizer.json and no .gguf file")

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    **template_kwargs: Any) -> str:
        """The prompt text for a conversation; TemplateError if the template rejects it."""
        kwargs = {**self.special_tokens, **self.template_defaults, **template_kwargs}
        return self.template.render(messages, add_generation_prompt=add_generation_prompt,
                                    tools=tools, **kwargs)

    async def render_chat_async(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        """render_chat() off the event loop for a long conversation, which
        renders for as long as it is long; a short one (nearly every chat)
        renders in place, so that it never queues behind other text work."""
        if _rough_size(messages, kwargs.get("tools")) <= INLINE_RENDER_SIZE:
            return self.render_chat(messages, **kwargs)
        return await off_loop(self.render_chat, messages, **kwargs)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids for a rendered prompt or raw completion text, with BOS exactly once if wanted."""
        return self._with_bos(self.tokenizer.encode(text))

    async def encode_prompt_async(self, text: str) -> list[int]:
        """encode_prompt() off the event loop, for long prompts."""
        return self._with_bos(await self.tokenizer.encode_async(text))

    def _with_bos(self, ids: list[int]) -> list[int]:
        bos = self.tokenizer.bos_token_id
        # Chat templates usually write BOS themselves; a second one hurts quality.
        if self.tokenizer.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    @classmethod
    def _from_gguf(cls, path: Path) -> ModelText:
        metadata = read_gguf_metadata(path)
        if "tokenizer.ggml.model" not in metadata and "tokenizer.huggingface.json" not in metadata:
            raise ValueError(f"{path} carries no tokenizer (no tokenizer.ggml.* metadata)")
        tokenizer = Tokenizer.from_gguf(metadata)
        eos_ids = _unique(metadata.get(f"tokenizer.ggml.{key}")
                          for key in ("eos_token_id", "eot_token_id", "eom_token_id"))
        if not eos_ids:
            raise ValueError(f"{path} names no end-of-sequence token (tokenizer.ggml.eos_token_id)")
        names = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                 "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
        specials = {name: token for name, key in names.items()
                    if (token := _token_text(tokenizer, metadata.get(f"tokenizer.ggml.{key}")))}
        source = metadata.get("tokenizer.chat_template")
        tool_use = metadata.get("tokenizer.chat_template.tool_use")
        context = metadata.arch_value("context_length")
        return cls._assemble(path, tokenizer, source, tool_use, "gguf", eos_ids, specials,
                             int(context) if isinstance(context, int) else None)

    @classmethod
    def _from_hf_dir(cls, path: Path) -> ModelText:
        config = _read_json_if_present(path / "tokenizer_config.json")
        tokenizer = Tokenizer.from_tokenizer_json(path / "tokenizer.json", config)
        model_config = _read_json_if_present(path / "config.json")
        generation = _read_json_if_present(path / "generation_config.json")
        eos_ids = _unique(_as_list(generation.get("eos_token_id")))
        if not eos_ids:
            eos_ids = _unique(_as_list(model_config.get("eos_token_id")))
        if not eos_ids:
            eos_ids = _unique([_token_id(tokenizer, config.get("eos_token"))])
        if not eos_ids:
            raise ValueError(f"{path} names no end-of-sequence token (generation_config.json, "
                             "config.json or tokenizer_config.json eos_token)")
        specials = {name: token for name in ("bos_token", "eos_token", "unk_token", "pad_token")
                    if (token := special_token_content(config.get(name)))}
        if "bos_token" not in specials and tokenizer.add_bos_token:
            specials["bos_token"] = _token_text(tokenizer, tokenizer.bos_token_id) or ""
        source, tool_use, origin = _hf_template(path, config)
        text_config = model_config.get("text_config")
        context = model_config.get("max_position_embeddings")
        if context is None and isinstance(text_config, dict):
            context = text_config.get("max_position_embeddings")
        return cls._assemble(path, tokenizer, source, tool_use, origin, eos_ids, specials,
                             int(context) if isinstance(context, int) else None)

    @classmethod
    def _assemble(cls, path: Path, tokenizer: Tokenizer, source: Any, tool_use: Any,
                  origin: str, eos_ids: tuple[int, ...], specials: dict[str, str],
                  context_length: int | None) -> ModelText:
        template: ChatTemplate | None = None
        if isinstance(source, str) and source.strip():
            try:
                template = ChatTemplate(source, tool_use_source=tool_use if isinstance(tool_use, str)
                                        else None)
            except TemplateError as exc:
                # llama.cpp does the same: serve with ChatML rather than not at all.
                log.warning("%s: chat template from %s does not compile (%s); using ChatML",
                            path, origin, exc)
        else:
            log.info("%s has no chat template; using ChatML", path)
        if template is None:
            template, origin = ChatTemplate(CHATML_TEMPLATE), "chatml-fallback"
        return cls(path=path, tokenizer=tokenizer, template=template, template_origin=origin,
                   eos_token_ids=eos_ids, bos_token_id=tokenizer.bos_token_id,
                   context_length=context_length, special_tokens=specials)


def _rough_size(messages: Sequence[Mapping[str, Any]], tools: Any) -> int:
    """The work of rendering a conversation, in characters and erring high:
    each message costs as much as a short text besides its own, and each list
    or object in it (content parts, tool calls) or in the tools as a long one."""
    size = 0
    for message in messages:
        size += _MESSAGE_SIZE
        for value in message.values() if isinstance(message, Mapping) else (message,):
            if isinstance(value, str):
                size += len(value)
            elif isinstance(value, list | tuple | Mapping):
                size += _NESTED_SIZE
    return size + _NESTED_SIZE * len(tools or ())


def _hf_template(path: Path, config: Mapping[str, Any]) -> tuple[Any, Any, str]:
    """(template, tool-use template, origin): chat_template.jinja wins over tokenizer_config.json."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), None, "chat_template.jinja"
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {item.get("name"): item.get("template") for item in source if isinstance(item, dict)}
        return named.get("default"), named.get("tool_use"), "tokenizer_config.json"
    return source, None, "tokenizer_config.json"


def _read_json_if_present(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _unique(values: Any) -> tuple[int, ...]:
    return tuple(dict.fromkeys(v for v in values if isinstance(v, int) and not isinstance(v, bool)))


def _token_id(tokenizer: Tokenizer, token: Any) -> int | None:
    text = special_token_content(token)
    return tokenizer.token_to_id(text) if text else None


def _token_text(tokenizer: Tokenizer, token_id: Any) -> str | None:
    return tokenizer.id_to_token(token_id) if isinstance(token_id, int) else None
