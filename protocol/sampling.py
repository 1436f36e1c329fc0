"""How one request is sampled and why it finished."""

from __future__ import annotations

from typing import Literal

import msgspec

# "stop": an end-of-sequence or stop token (the router also reports "stop" when
# it matched a stop string and aborted); "length": max_tokens or the context
# ran out; "abort": the router asked; "error": the engine refused the request.
FinishReason = Literal["stop", "length", "abort", "error"]


GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "structural_tag"]


class GrammarSpec(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """A constraint on what may be generated, enforced by the engine with
    xgrammar token masks. `source` is a JSON schema (json_schema), ignored
    (json_object: any JSON object), a regular expression (regex), GBNF/EBNF
    (ebnf) or an xgrammar structural tag as JSON (structural_tag: e.g. free
    text with tool calls that must match their schemas once opened)."""

    kind: GrammarKind
    source: str = ""


# The most alternatives a token's log probabilities list (OpenAI's top_logprobs
# bound; llama.cpp's n_probs is capped to it).
MAX_TOP_LOGPROBS = 20


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """Per-request sampling settings, already validated by the router.

    top_k <= 0 and top_p == 1.0 and min_p == 0.0 each mean "off";
    temperature == 0.0 means greedy.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    # Every token that ends the request: the model's end-of-sequence ids
    # (the router's, unless ignore_eos) plus the client's. The engine has no
    # end-of-sequence list of its own; ignore_eos is for the router's text.
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    grammar: GrammarSpec | None = None
    # Which tokens the penalties look at. 0: OpenAI's rule (the repetition
    # penalty over the whole context, presence and frequency over generated
    # tokens). N > 0: all three over the last N tokens of the context, as
    # llama.cpp's repeat_last_n does.
    penalty_last_n: int = 0
    # Send a RequestOutput after every prefill chunk with num_computed_tokens
    # (llama.cpp's return_progress).
    report_progress: bool = False
    # Added to the logits of these token ids before anything else (OpenAI's
    # and llama.cpp's logit_bias); -inf bans a token. Ids are checked against
    # the vocabulary by the router.
    logit_bias: dict[int, float] = {}
    # Log probabilities returned with each sampled token, from the model's own
    # distribution (before logit_bias, penalties, grammar masks and
    # temperature): -1 none; 0 the sampled token's; k > 0 also the k most
    # likely tokens' (at most MAX_TOP_LOGPROBS).
    logprobs: int = -1
    # The same for every prompt token after the first (each given the tokens
    # before it): OpenAI's echo with logprobs, lm-eval's loglikelihood. With
    # it max_tokens may be 0: the prompt is scored and nothing generated.
    # Such a request does not take its prompt from the prefix cache.
    prompt_logprobs: int = -1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
