"""What a model serves, as /v1/models, /models and /props list it.

Every model generates (completions and chat, with log probabilities and
prompt scoring) and embeds (its final hidden states pooled); rerank needs
--reranking (router/rerank/). Ollama calls the same list `capabilities`.
"""

from __future__ import annotations

from router.settings import ModelSettings

ALWAYS = ("completion", "chat", "logprobs", "embeddings")


def model_capabilities(settings: ModelSettings) -> list[str]:
    return [*ALWAYS, *(("rerank",) if settings.reranking else ())]
