"""What a model serves, as /v1/models, /models and /props list it.

Every model generates (completions and chat, with log probabilities and
prompt scoring) and embeds (its final hidden states pooled); rerank needs
--reranking (router/rerank/), and images in need --vision (docs/vision.md),
which llama.cpp lists as the `multimodal` capability. Ollama calls the same
list `capabilities`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from router.errors import invalid
from router.media.types import ImageRef
from router.settings import ModelSettings

if TYPE_CHECKING:
    from router.catalog import CatalogEntry

ALWAYS = ("completion", "chat", "logprobs", "embeddings")
VISION_DISABLED = "vision_disabled"


def model_capabilities(settings: ModelSettings) -> list[str]:
    return [*ALWAYS, *(("multimodal",) if settings.engine.vision else ()),
            *(("rerank",) if settings.reranking else ())]


def input_modalities(settings: ModelSettings) -> list[str]:
    """What the model reads: text, and images when it is served with --vision."""
    return ["text", "image"] if settings.engine.vision else ["text"]


def require_vision(images: Sequence[ImageRef], model: CatalogEntry) -> None:
    """The one check every API makes of a request's images, before they are
    fetched or rendered: a model served without --vision takes none (400
    vision_disabled naming the first image's field). The message names the
    field too, since Anthropic's error shape has no `param`."""
    if not images or model.settings.engine.vision:
        return
    first = images[0].param
    raise invalid(f"{first}: model {model.id!r} is not served with vision, so it takes no images; "
                  "serve it with --vision (or `vision = true` in its preset section) if it is "
                  "a vision-language model", first, VISION_DISABLED)
