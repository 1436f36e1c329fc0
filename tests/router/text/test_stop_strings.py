"""Stop strings over streamed text: nothing of a stop is ever emitted, everything before it exactly once."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from router.text import StopStringMatcher


def _run(stops: Sequence[str], pieces: Sequence[str]) -> tuple[list[str], str | None, str]:
    """Feed pieces until a match; return (emitted per feed, matched stop, flushed tail)."""
    matcher = StopStringMatcher(stops)
    emitted: list[str] = []
    for piece in pieces:
        out, matched = matcher.feed(piece)
        emitted.append(out)
        if matched is not None:
            return emitted, matched, matcher.flush()
    return emitted, None, matcher.flush()


def _reference(stops: Sequence[str], text: str) -> tuple[str, str | None]:
    """What a character-by-character check would do: stop at the first stop to complete."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if s and text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)  # of those ending here, the one starting first
            return text[:end - len(stop)], stop
    return text, None


def test_stop_within_one_piece() -> None:
    emitted, matched, tail = _run(["STOP"], ["Hello STOP world"])
    assert emitted == ["Hello "] and matched == "STOP" and tail == ""


def test_stop_split_across_many_pieces() -> None:
    emitted, matched, _ = _run(["<|end|>"], ["abc<", "|", "en", "d", "|> more"])
    assert "".join(emitted) == "abc" and matched == "<|end|>"
    assert emitted[0] == "abc"  # released before the possible stop, not after


def test_possible_stop_is_held_then_released() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("x </ans") == ("x ", None)
    assert matcher.feed("wer is 5") == ("</answer is 5", None)
    assert matcher.feed("</") == ("", None)
    assert matcher.flush() == "</"


def test_stop_at_the_very_start() -> None:
    emitted, matched, _ = _run(["\n\n"], ["\n", "\nrest"])
    assert emitted == ["", ""] and matched == "\n\n"


def test_several_stops_first_to_complete_wins() -> None:
    # "bc" completes before "abcd" could, whatever the piece boundaries.
    for pieces in (["xabcd"], ["xab", "cd"], list("xabcd")):
        emitted, matched, _ = _run(["abcd", "bc"], pieces)
        assert "".join(emitted) == "xa" and matched == "bc"
    # Both complete at the same character: the longer, earlier-starting one wins.
    emitted, matched, _ = _run(["bc", "abc"], ["xab", "c"])
    assert "".join(emitted) == "x" and matched == "abc"


def test_overlapping_prefixes() -> None:
    # "aab" must be found in "aaab" even though the first "aa" leads nowhere.
    emitted, matched, _ = _run(["aab"], ["a", "a", "a", "b"])
    assert "".join(emitted) == "a" and matched == "aab"
    emitted, matched, tail = _run(["ab", "aac"], ["a", "a", "a", "d"])
    assert matched is None and "".join(emitted) + tail == "aaad"


def test_unicode_stops() -> None:
    emitted, matched, _ = _run(["。終", "🛑"], ["日本語", "。", "終わり"])
    assert "".join(emitted) == "日本語" and matched == "。終"
    emitted, matched, _ = _run(["。終", "🛑"], ["ok 🛑 no"])
    assert emitted == ["ok "] and matched == "🛑"


def test_no_stops_and_empty_stops_pass_everything() -> None:
    for stops in ([], [""]):
        matcher = StopStringMatcher(stops)
        assert matcher.feed("anything") == ("anything", None)
        assert matcher.flush() == ""


def test_finished_after_a_match() -> None:
    matcher = StopStringMatcher(["#"])
    assert matcher.feed("a#b") == ("a", "#")
    assert matcher.matched == "#"
    assert matcher.feed("more") == ("", None)
    assert matcher.flush() == ""


@pytest.mark.parametrize("seed", range(40))
def test_random_streams_match_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab c\n日🙂"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
             for _ in range(rng.randint(1, 3))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 12))))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    emitted, matched, tail = _run(stops, pieces)
    expected_text, expected_stop = _reference(stops, text)
    assert "".join(emitted) + tail == expected_text
    assert matched == expected_stop
    if matched is None:
        # Only text that could still start a stop is ever held back.
        for i in range(len(pieces)):
            fed, out = "".join(pieces[:i + 1]), "".join(emitted[:i + 1])
            held = fed[len(out):]
            assert fed.startswith(out)
            assert held == "" or any(s.startswith(held) and s != held for s in stops)


def test_a_long_stop_costs_memory_linear_in_its_length() -> None:
    # Every prefix of a 20,000-character stop would take 200 MB; the KMP
    # table takes 80 KB.
    import tracemalloc

    tracemalloc.start()
    try:
        matcher = StopStringMatcher(["y" * 20_000 + "z"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000
    assert matcher.feed("y" * 30_000) == ("y" * 10_000, None)
    assert matcher.feed("z!") == ("", "y" * 20_000 + "z")


def test_matching_long_stops_over_long_text_is_fast() -> None:
    # The most (16) and longest (1,000 characters) stops a request may bring,
    # over text that keeps almost completing them and then breaks off.
    import time

    from router.text.stop_strings import MAX_STOP_CHARS, MAX_STOP_STRINGS

    stops = [chr(0x61 + i) * (MAX_STOP_CHARS - 1) + "!" for i in range(MAX_STOP_STRINGS - 1)]
    stops.append("ab" * (MAX_STOP_CHARS // 2))
    text = ("a" * (MAX_STOP_CHARS - 1) + "?" + "ab" * 400 + "b") * 60
    matcher = StopStringMatcher(stops)
    started = time.perf_counter()
    out = [matcher.feed(text[i:i + 7])[0] for i in range(0, len(text), 7)]
    elapsed = time.perf_counter() - started
    assert "".join(out) + matcher.flush() == text
    assert elapsed < 5.0, f"{len(text)} characters took {elapsed:.2f} s"


@pytest.mark.parametrize(("stops", "fragment"), [
    (["x"] * 17, "at most 16 strings"),
    (["ok", "y" * 1001], "at most 1000 characters"),
])
def test_check_stops_refuses_too_many_or_too_long(stops: list[str], fragment: str) -> None:
    from router.errors import InvalidRequest
    from router.text.stop_strings import check_stops

    with pytest.raises(InvalidRequest) as caught:
        check_stops(stops, "stop_sequences")
    assert caught.value.param == "stop_sequences" and fragment in caught.value.message


def test_check_stops_keeps_the_non_empty_ones() -> None:
    from router.text.stop_strings import check_stops

    assert check_stops(["", "a", "y" * 1000], "stop") == ("a", "y" * 1000)
