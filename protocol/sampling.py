"""How one request is sampled and why it finished."""

from __future__ import annotations

from typing import Literal

import msgspec

# "stop": an end-of-sequence or stop token (the router also reports "stop" when
# it matched a stop string and aborted); "length": max_tokens or the context
# ran out; "abort": the router asked; "error": the engine refused the request.
FinishReason = Literal["stop", "length", "abort", "error"]


GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "structural_tag"]

# How an embedding request's prompt becomes one vector, from the final-normed
# hidden states: the last token's (Qwen3-Embedding and other causal
# decoders), the mean over every prompt token, or the first token's (CLS).
Pooling = Literal["last", "mean", "cls"]

LogprobsMode = Literal["raw", "processed"]


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
# The most token ids one request may name in logprob_token_ids.
MAX_LOGPROB_TOKEN_IDS = 20


class ReasoningBudget(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """A thinking model's reasoning block, held to a budget by the engine
    (engine/sampling/forced_tokens.py).

    The block is open at the first generated token (the prompt opened it).
    The model may write `budget` tokens in it (-1: any number); when none of
    them closed it (the generated ids ending with close_ids, the model's own
    closing delimiter), the next tokens are end_ids, forced: the delimiter
    and what the model writes around it, e.g. "\n</think>\n\n". Once the
    block is closed, by the model or by end_ids, after_ids are forced (the
    opener of a forced tool call), then generation goes on freely. Forced
    tokens are output tokens like any other: they count toward max_tokens,
    can be stop tokens, pass through the grammar matcher, and reach the
    router as sampled ones (with the model's log probabilities for them)."""

    budget: int
    close_ids: list[int]
    end_ids: list[int] = []
    after_ids: list[int] = []


# Temperatures below this sample greedily (vLLM's threshold too).
GREEDY_TEMPERATURE = 1e-5


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """Per-request sampling settings, already validated by the router.

    top_k <= 0 and top_p == 1.0 and min_p == 0.0 each mean "off";
    temperature == 0.0 (or below GREEDY_TEMPERATURE) means greedy.
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
    # With logprobs >= 0: also these token ids' log probabilities from the
    # same raw distribution, at each sampled position, in this order
    # (TokenLogprobs.named_logprobs): a judge's "yes" and "no" for rerank.
    # At most MAX_LOGPROB_TOKEN_IDS; checked against the vocabulary.
    logprob_token_ids: list[int] = []
    # Set: an embedding request. max_tokens is 0; the prompt's final hidden
    # states are pooled this way into RequestOutput.embedding and nothing is
    # sampled (it finishes "length", like a scored prompt). Mean and CLS
    # pooling never take the prompt from the prefix cache; last pooling may.
    pooling: Pooling | None = None
    # How the pooled vector is normalised (llama.cpp's embd_normalize): -1
    # not at all, 0 scaled to a largest magnitude of 32760 (int16 range), 1
    # taxicab, 2 Euclidean (unit length: OpenAI's), p > 2 the p-norm.
    embd_normalize: int = 2
    # A thinking model's reasoning block held to a budget, and the tokens
    # forced once it closes (ReasoningBudget); None: the model is left free.
    reasoning: ReasoningBudget | None = None
    # Which distribution `logprobs` (not prompt_logprobs, not
    # logprob_token_ids) come from: "raw", the model's own (above);
    # "processed", the one the token was drawn from (llama.cpp's
    # post_sampling_probs): after logit_bias, penalties, the grammar mask,
    # temperature, top-k, top-p and min-p, renormalised over the tokens that
    # survive; cut tokens have -inf and rank last among the alternatives; a
    # greedy row's is one-hot at its argmax (log 1 = 0).
    logprobs_mode: LogprobsMode = "raw"
    # False (llama.cpp's cache_prompt): the request stays out of the prefix
    # cache: it reuses nothing and its pages are not registered there (nor
    # offered to the host and disk tiers).
    cache_prompt: bool = True

    @property
    def greedy(self) -> bool:
        # Below GREEDY_TEMPERATURE, logits / temperature overflows float32
        # (a 1e-40 temperature made the CPU sampler raise on inf and the
        # kernel pick token 0); the distribution is one-hot there anyway.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
