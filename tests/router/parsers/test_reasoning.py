"""ReasoningParser: <think> blocks split from the answer, whitespace rules, tags cut anywhere, token counts."""

from __future__ import annotations

import pytest

from router.chat.events import ContentDelta as C
from router.chat.events import ReasoningDelta as R
from router.parsers import ReasoningParser
from tests.router.parsers.support import reasoning_events


def test_qwen3_shape_trims_the_newlines_around_the_tags() -> None:
    text = "<think>\nThe user asks 2+2.\nEasy.\n</think>\n\nThe answer is 4."
    assert reasoning_events(text) == [R("The user asks 2+2.\nEasy."), C("The answer is 4.")]


def test_all_newlines_at_the_edges_are_trimmed_but_spaces_are_kept() -> None:
    text = "<think>\r\n\n  a \n\n\n</think>\n\r\n  b \n"
    assert reasoning_events(text) == [R("  a "), C("  b \n")]


def test_whitespace_before_the_opening_tag_is_dropped() -> None:
    assert reasoning_events("\n \n<think>x</think>y") == [R("x"), C("y")]


def test_empty_reasoning_sends_no_reasoning_delta() -> None:
    # Qwen3 with thinking off writes this (when the template does not put it in the prompt).
    assert reasoning_events("<think>\n\n</think>\n\nHello") == [C("Hello")]


def test_output_without_a_tag_is_content_exactly() -> None:
    text = "\n  Hello <think>not reasoning</think>\n\n"
    assert reasoning_events(text) == [C(text)]


def test_an_opening_tag_after_the_start_is_text() -> None:
    text = "Answer first.\n<think>\nlater</think>\n"
    assert reasoning_events(text) == [C(text)]


def test_after_the_close_everything_is_content_tags_included() -> None:
    assert reasoning_events("<think>a</think>b<think>c</think>d") == [R("a"), C("b<think>c</think>d")]


def test_start_in_reasoning_without_an_opening_tag() -> None:
    text = "\nOkay, the user wants X.\n</think>\n\nHere is X."
    assert reasoning_events(text, start_in_reasoning=True) == [R("Okay, the user wants X."), C("Here is X.")]


def test_start_in_reasoning_drops_a_repeated_opening_tag() -> None:
    text = " \n<think>\nhmm\n</think>\n\nok"
    assert reasoning_events(text, start_in_reasoning=True) == [R("hmm"), C("ok")]


def test_start_in_reasoning_a_later_opening_tag_is_reasoning_text() -> None:
    text = "I wonder about <think> tags\n</think>\n\nok"
    assert reasoning_events(text, start_in_reasoning=True) == [R("I wonder about <think> tags"), C("ok")]


def test_start_in_reasoning_with_an_immediate_close() -> None:
    assert reasoning_events("</think>\n\nDirect.", start_in_reasoning=True) == [C("Direct.")]


def test_unterminated_reasoning_stays_reasoning_as_written() -> None:
    # Only a closing tag trims the newlines before it; a cut-off keeps them.
    assert reasoning_events("<think>\nstill going\n\n") == [R("still going\n\n")]
    assert reasoning_events("<think>\nstill going</thi") == [R("still going</thi")]
    assert reasoning_events("more thoughts", start_in_reasoning=True) == [R("more thoughts")]


def test_a_partial_opening_tag_at_the_end() -> None:
    assert reasoning_events("  <thi") == [C("  <thi")]
    assert reasoning_events("<thi", start_in_reasoning=True) == [R("<thi")]
    assert reasoning_events("\n\n", start_in_reasoning=True) == []
    assert reasoning_events("") == []


def test_tags_cut_across_pieces_are_never_emitted_as_text() -> None:
    parser = ReasoningParser()
    assert parser.feed("<thi") == []
    assert parser.feed("nk>\nI think") == [R("I think")]
    assert parser.feed(" so.\n</th") == [R(" so.")]  # the newline waits: a close may follow
    assert parser.feed("ink") == []
    assert parser.feed(">\n") == []
    assert parser.feed("\nYes") == [C("Yes")]
    assert parser.flush() == []


def test_a_near_miss_is_released_as_soon_as_it_is_decided() -> None:
    parser = ReasoningParser()
    assert parser.feed("<think>a\n</thin") == [R("a")]
    assert parser.feed("g>") == [R("\n</thing>")]
    assert parser.feed("<the") == [R("<the")]  # cannot start </think>
    assert parser.feed("\n") == []
    assert parser.feed("x") == [R("\nx")]


def test_a_start_that_is_not_the_tag_is_released_at_once() -> None:
    parser = ReasoningParser()
    assert parser.feed(" <thx") == [C(" <thx")]
    parser = ReasoningParser()
    assert parser.feed("\n") == []
    assert parser.feed("Hi") == [C("\nHi")]


def test_unicode_and_emoji() -> None:
    text = "<think>\n🤔 ünïcödé 思考\n</think>\n\n答案是 ✅ 4"
    assert reasoning_events(text) == [R("🤔 ünïcödé 思考"), C("答案是 ✅ 4")]


def test_custom_tags() -> None:
    parser = ReasoningParser(open_tag="<reasoning>", close_tag="</reasoning>")
    events = parser.feed("<reasoning>\nr\n</reasoning>\n\nc</think>") + parser.flush()
    assert events == [R("r"), C("c</think>")]


def test_empty_tags_are_refused() -> None:
    with pytest.raises(ValueError):
        ReasoningParser(close_tag="")


def _count(steps: list[tuple[str, int]], *, start_in_reasoning: bool = False) -> tuple[int, list[bool]]:
    """Feed (text, tokens) steps; return reasoning_tokens and in_reasoning after each step."""
    parser = ReasoningParser(start_in_reasoning=start_in_reasoning)
    states = []
    for text, tokens in steps:
        parser.feed(text, tokens)
        states.append(parser.in_reasoning)
    parser.flush()
    return parser.reasoning_tokens, states


def test_reasoning_tokens_count_the_tags_but_not_the_newlines_after() -> None:
    steps = [("<think>", 1), ("\n", 1), ("Let", 1), (" me", 1), ("\n", 1), ("</think>", 1), ("\n\n", 1), ("Four", 1)]
    tokens, states = _count(steps)
    assert tokens == 6
    assert states == [True, True, True, True, True, False, False, False]


def test_reasoning_tokens_when_the_output_starts_inside_reasoning() -> None:
    tokens, states = _count([("Hmm", 1), ("</think>", 1), ("\n\n", 1), ("Yes", 1)], start_in_reasoning=True)
    assert (tokens, states) == (2, [True, False, False, False])


def test_a_step_counts_where_most_of_its_text_went() -> None:
    assert _count([("<think>", 1), ("long thought</think>\n\nA", 3)])[0] == 4
    assert _count([("<think>", 1), ("a</think>\n\nThe long answer", 3)])[0] == 1


def test_steps_of_an_undecided_start_are_counted_once_decided() -> None:
    assert _count([("\n", 1), ("<th", 1), ("ink>", 1), ("x", 1)])[0] == 4
    assert _count([("\n", 1), ("<th", 1), ("e", 1), ("x", 1)])[0] == 0
    assert _count([("<th", 2)])[0] == 0  # decided by flush: content
    assert _count([("<th", 2)], start_in_reasoning=True)[0] == 2


def test_empty_steps_count_where_the_stream_stands() -> None:
    assert _count([("<think>a", 1), ("", 1), ("</think>", 1), ("", 1), ("b", 1)])[0] == 3


def test_no_reasoning_no_reasoning_tokens() -> None:
    tokens, states = _count([("Just", 1), (" an answer", 2)])
    assert (tokens, states) == (0, [False, False])


def test_reasoning_chars() -> None:
    parser = ReasoningParser()
    parser.feed("<think>\nabc\n</think>\n\nde")
    assert parser.reasoning_chars == 3
