"""Which generated tokens' log probabilities an output_text lists
(`include: ["message.output_text.logprobs"]`, `top_logprobs` 0..20).

OpenAI's shape gives log probabilities to output_text parts only: reasoning
items and function calls have none. The turn's text goes through the
reasoning parser and the tool-call parser before it becomes items, so a
token's entry goes where its text went, by this rule:

- Reasoning comes first and ends once (router/parsers/reasoning.py), and
  the parser counts as reasoning a prefix of the generated tokens, whole
  engine steps at a time (a step whose characters are mostly reasoning;
  the <think> tags are reasoning, the newlines after </think> are not).
  Those tokens never get an entry.
- Every other token waits until text is written to a message: that delta
  lists the waiting tokens (so a token whose text was held back, such as
  the start of a possible tool call that turned out to be text, is listed
  with the delta that shows it). A tool call's events drop the waiting
  tokens: they spelled the call. Whitespace-only tokens in front of a
  message whose text starts with none were trimmed by the parsers (the
  newlines after </think>, around a tool call) and get no entry, nor do
  tokens still waiting at the end (text never shown).

Attribution is exact while the engine sends one token per step (always,
unless a drafter verifies several): a step that ends reasoning and starts
the answer, or ends text and starts a call, goes to one side as a whole.
A hidden end-of-sequence token has no entry (router/generation.py).
Values are the model's raw log probabilities (SamplingParams.logprobs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from protocol import TokenLogprobs
from router.text.token_pieces import TokenPieces, pieces_for

if TYPE_CHECKING:
    from router.chat.turn import TurnRun

# A content part's entry: token, bytes, logprob, top_logprobs [{token, bytes, logprob}].
Entry = dict[str, Any]


class OutputLogprobs:
    def __init__(self, run: TurnRun):
        self._run = run
        self._pieces: TokenPieces = pieces_for(run.prepared.text.tokenizer)
        self._seen = 0  # entries of the generation's logprobs looked at
        self._waiting: list[int] = []  # their indices, not yet listed or dropped

    def take(self, text: str, opens: bool) -> list[Entry]:
        """The entries of the tokens waiting, for message text being written
        now (opens: the message's first text)."""
        self._catch_up()
        first_answer_token = self._run.reasoning_tokens
        generation = self._run.generation
        answer = [i for i in self._waiting if i >= first_answer_token]
        if opens and not text[:1].isspace():
            while answer and not self._pieces.text(generation.token_ids[answer[0]]).strip():
                answer.pop(0)
        self._waiting.clear()
        return [self._entry(generation.token_ids[i], generation.logprobs[i]) for i in answer]

    def drop(self) -> None:
        """The tokens waiting spelled something that is not message text."""
        self._catch_up()
        self._waiting.clear()

    def _catch_up(self) -> None:
        # The generation has made every piece whose events are being fed.
        count = len(self._run.generation.logprobs)
        self._waiting.extend(range(self._seen, count))
        self._seen = count

    def _entry(self, token_id: int, logprobs: TokenLogprobs) -> Entry:
        entry = self._one(token_id, logprobs.logprob)
        entry["top_logprobs"] = [self._one(i, value) for i, value in
                                 zip(logprobs.top_ids, logprobs.top_logprobs, strict=True)]
        return entry

    def _one(self, token_id: int, logprob: float) -> Entry:
        return {"token": self._pieces.text(token_id),
                "bytes": list(self._pieces.token_bytes(token_id)), "logprob": logprob}


def delta_shape(entries: list[Entry]) -> list[Entry]:
    """output_text.delta and .done events list entries without bytes, as the
    API documents them."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                              for t in e["top_logprobs"]]}
            for e in entries]
