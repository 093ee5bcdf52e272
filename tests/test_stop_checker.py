"""Tests for jaxserve.engine.stop_checker."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.engine.stop_checker import StopMatch, StopStringChecker


def _stream(checker: StopStringChecker, deltas: list[str]):
    """Feed `deltas` as an engine would; return (streamed chunks, final text, match)."""
    text, sent, streamed = "", 0, []
    for delta in deltas:
        text += delta
        match = checker.check(text, len(delta))
        if match is not None:
            text = text[: match.truncate_to]
        chunk = checker.streamable_delta(text, sent, finished=match is not None)
        streamed.append(chunk)
        sent += len(chunk)
        if match is not None:
            return streamed, text, match
    streamed.append(checker.streamable_delta(text, sent, finished=True))
    return streamed, text, None


def _first_completed(text: str, stops: list[str]) -> tuple[str, int] | None:
    """Brute force: the stop string completed first in `text`, and its start."""
    for end in range(1, len(text) + 1):
        ending_here = [s for s in stops if text[:end].endswith(s)]
        if ending_here:
            stop = max(ending_here, key=len)
            return stop, end - len(stop)
    return None


def test_no_stop_strings():
    checker = StopStringChecker([], include_stop_str_in_output=False)
    assert checker.holdback == 0
    assert checker.check("anything at all", 5) is None
    assert checker.streamable_delta("anything", 3, finished=False) == "thing"


@pytest.mark.parametrize(("include", "truncate_to"), [(False, 6), (True, 10)])
def test_single_stop(include, truncate_to):
    checker = StopStringChecker(["STOP"], include_stop_str_in_output=include)
    text = "hello STOP world"
    assert checker.check(text, len(text)) == StopMatch("STOP", truncate_to)
    assert checker.check("hello world", 11) is None


@pytest.mark.parametrize(("include", "expected"), [(False, "hello "), (True, "hello STOP")])
def test_stop_split_across_two_deltas(include, expected):
    checker = StopStringChecker(["STOP"], include_stop_str_in_output=include)
    assert checker.check("hello ST", 8) is None
    match = checker.check("hello STOP!", 3)
    assert match == StopMatch("STOP", len(expected))
    assert "hello STOP!"[: match.truncate_to] == expected


def test_only_the_tail_is_searched():
    """Text before the new chars was checked already, so it is not searched again."""
    checker = StopStringChecker(["ab"], include_stop_str_in_output=False)
    assert checker.check("ab" + "x" * 10 + "yz", 2) is None
    assert checker.check("xxxa" + "b", 1) == StopMatch("ab", 3)


def test_earliest_match_wins_regardless_of_list_order():
    checker = StopStringChecker(["world", "hello"], include_stop_str_in_output=False)
    assert checker.check("say hello world", 15) == StopMatch("hello", 4)


@pytest.mark.parametrize(("include", "truncate_to"), [(False, 1), (True, 2)])
def test_the_stop_completed_first_wins(include, truncate_to):
    """"b" is complete before "abc" is, as it would be if chars came one at a time."""
    checker = StopStringChecker(["abc", "b"], include_stop_str_in_output=include)
    assert checker.check("abc", 3) == StopMatch("b", truncate_to)


def test_equal_ends_take_the_longer_stop():
    checker = StopStringChecker(["bc", "abc"], include_stop_str_in_output=False)
    assert checker.check("xabc", 4) == StopMatch("abc", 1)


def test_holdback():
    assert StopStringChecker(["STOP", "ab"], False).holdback == 3
    assert StopStringChecker(["STOP", "ab"], True).holdback == 0
    assert StopStringChecker(["x"], False).holdback == 0


def test_streaming_holds_back_a_possible_stop_start():
    checker = StopStringChecker(["STOP"], include_stop_str_in_output=False)
    streamed, text, match = _stream(checker, ["hello S", "T", "OP and more"])
    assert streamed == ["hell", "o", " "]
    assert text == "hello " and match == StopMatch("STOP", 6)


def test_streaming_releases_the_held_back_text_at_the_end():
    checker = StopStringChecker(["STOP"], include_stop_str_in_output=False)
    streamed, text, match = _stream(checker, ["hello S", "TO"])
    assert streamed == ["hell", "o ", "STO"]
    assert text == "hello STO" and match is None


def test_streamable_delta_with_less_text_than_the_holdback():
    checker = StopStringChecker(["STOP"], include_stop_str_in_output=False)
    assert checker.streamable_delta("ab", 0, finished=False) == ""
    assert checker.streamable_delta("ab", 1, finished=False) == ""
    assert checker.streamable_delta("abcdef", 2, finished=False) == "c"


@pytest.mark.parametrize("stop", [[""], ["ok", ""], [None], [3]])
def test_rejects_bad_stop_strings(stop):
    with pytest.raises(ValueError, match="non-empty strings"):
        StopStringChecker(stop, include_stop_str_in_output=False)


@pytest.mark.parametrize("count", [-1, 4])
def test_rejects_a_bad_new_char_count(count):
    with pytest.raises(ValueError, match="new_char_count"):
        StopStringChecker(["a"], False).check("abc", count)


def test_rejects_a_bad_sent_count():
    with pytest.raises(ValueError, match="num_sent"):
        StopStringChecker(["a"], False).streamable_delta("abc", 4, finished=True)


def test_no_new_chars_means_no_match():
    assert StopStringChecker(["a"], False).check("a", 0) is None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text("abc", max_size=16),
    stops=st.lists(st.text("abc", min_size=1, max_size=6), max_size=3),
    cuts=st.lists(st.integers(0, 16)),
    include=st.booleans(),
)
def test_streaming_matches_one_shot_search(text, stops, cuts, include):
    """However the text is split into deltas: same match, nothing streamed is cut."""
    points = sorted({c for c in cuts if 0 < c < len(text)})
    deltas = [text[i:j] for i, j in zip([0, *points], [*points, len(text)], strict=True)]
    checker = StopStringChecker(stops, include_stop_str_in_output=include)
    streamed, final, match = _stream(checker, deltas)
    assert "".join(streamed) == final

    expected = _first_completed(text, stops)
    if expected is None:
        assert match is None and final == text
        return
    stop, start = expected
    assert match == StopMatch(stop, start + len(stop) if include else start)
    if include:
        assert final.endswith(stop) and not any(s in final[:-1] for s in stops)
    else:
        assert not any(s in final for s in stops)
