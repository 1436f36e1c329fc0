"""The relevance judge: a causal LM asked Qwen3-Reranker's question.

Each document gets its own prompt, Qwen3-Reranker's (its model card), in
ChatML:

    <|im_start|>system
    Judge whether the Document meets the requirements based on the Query and
    the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>
    <|im_start|>user
    <Instruct>: {instruction}
    <Query>: {query}
    <Document>: {document}<|im_end|>
    <|im_start|>assistant
    <think>

    </think>

(the system text is one line). As the model card does, the part before the
user's text, that text and the part after it are tokenized apart and put
together. The relevance is the judge's probability of "yes" against "no" as
its next token: softmax over those two log probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from router.errors import InvalidRequest
from router.text.model_text import ModelText
from router.text.offload import off_loop
from router.text.tokenizer import INLINE_ENCODE_CHARS

SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the '
          'Instruct provided. Note that the answer can only be "yes" or "no".')
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
PREFIX = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
# The tokens the prompt and the answer need as single tokens of the vocabulary.
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
ANSWERS = ("yes", "no")


def user_text(instruction: str, query: str, document: str) -> str:
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


def relevance(yes_logprob: float, no_logprob: float) -> float:
    """P(yes) / (P(yes) + P(no)): the softmax over the two, written so that
    neither exponent can overflow."""
    gap = no_logprob - yes_logprob
    if math.isnan(gap):
        return 0.0
    if gap > 0:
        odds = math.exp(-gap)
        return odds / (1.0 + odds)
    return 1.0 / (1.0 + math.exp(gap))


@dataclass(frozen=True)
class Judge:
    """A model's judge prompt as token ids, and its answer tokens."""

    text: ModelText
    prefix_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]
    yes_id: int
    no_id: int

    @classmethod
    def of(cls, model: str, text: ModelText) -> Judge:
        """The judge for a model, or a 400 saying why the model cannot be one:
        its vocabulary must hold ChatML's markers and "yes" and "no" as
        single tokens."""
        tokenizer = text.tokenizer
        single = {word: tokenizer.encode(word) for word in (*CHATML_TOKENS, *ANSWERS)}
        missing = [word for word, ids in single.items() if len(ids) != 1]
        if missing:
            listed = ", ".join(f'"{word}"' for word in missing)
            raise InvalidRequest(
                f"model '{model}' cannot judge relevance: {listed} "
                f"{'is not a single token' if len(missing) == 1 else 'are not single tokens'} "
                "of its vocabulary; rerank needs a Qwen3-Reranker-style model (ChatML, with "
                '"yes" and "no" as single tokens)', code="reranking_not_supported", param="model")
        (yes_id,), (no_id,) = single["yes"], single["no"]
        return cls(text, tuple(text.encode_prompt(PREFIX)), tuple(tokenizer.encode(SUFFIX)),
                   yes_id, no_id)

    async def prompts(self, instruction: str, query: str, documents: Sequence[str]
                      ) -> list[list[int]]:
        """One prompt's token ids per document. A few short texts are
        tokenized in place; more go to the text pool in one batch, which
        lets go of the GIL while it works."""
        texts = [user_text(instruction, query, document) for document in documents]
        if sum(map(len, texts)) <= INLINE_ENCODE_CHARS:
            bodies = [self.text.tokenizer.encode(body) for body in texts]
        else:
            bodies = await off_loop(self._encode_all, texts)
        prefix, suffix = list(self.prefix_ids), list(self.suffix_ids)
        return [prefix + body + suffix for body in bodies]

    def _encode_all(self, texts: list[str]) -> list[list[int]]:
        backend = self.text.tokenizer.backend
        return [encoded.ids for encoded in backend.encode_batch_fast(texts, add_special_tokens=False)]
