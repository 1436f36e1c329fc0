"""llama.cpp's timings object of a generation: rates stay sane at the edges."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from router.generation import Generation


def generation(completion_tokens: int, *, first: float, ended: float) -> Generation:
    spec: Any = SimpleNamespace(prompt_ids=[1, 2, 3, 4],
                                params=SimpleNamespace(stop_token_ids=[], ignore_eos=False))
    text: Any = SimpleNamespace(eos_token_ids=[0])
    run = Generation(client=None, text=text, request_id="cmpl-1", spec=spec)  # type: ignore[arg-type]
    run._started, run._first_token, run._ended = 10.0, first, ended
    run.completion_tokens = completion_tokens
    return run


def test_one_token_has_no_generation_rate() -> None:
    """The one token ends the prompt phase; the microseconds after it are no
    generation phase (it read 10,683 tokens/s)."""
    timings = generation(1, first=10.2, ended=10.2000936).timings()
    assert timings["predicted_n"] == 1
    assert timings["predicted_per_second"] == 0.0
    assert abs(timings["prompt_per_second"] - 4 / 0.2) < 1e-6


def test_several_tokens_have_their_rate() -> None:
    timings = generation(5, first=10.2, ended=10.3).timings()
    assert abs(timings["predicted_per_second"] - 50.0) < 1e-6
    assert abs(timings["predicted_ms"] - 100.0) < 1e-6


def test_draft_counts_appear_only_when_the_request_drafted() -> None:
    plain = generation(5, first=10.2, ended=10.3).timings()
    assert "draft_n" not in plain and "draft_n_accepted" not in plain
    run = generation(5, first=10.2, ended=10.3)
    run.draft_tokens, run.draft_accepted = 8, 3
    timings = run.timings()
    assert (timings["draft_n"], timings["draft_n_accepted"]) == (8, 3)
