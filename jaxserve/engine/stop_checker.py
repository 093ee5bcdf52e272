"""Stop strings: find them in a request's growing output text (as vLLM does).

Each call searches only the tail the newest characters can affect, so the
whole check is linear in the output length. When several stop strings occur
in the new text, the one that is *completed* first wins (earliest end; for
equal ends the earlier start), which is what char-by-char arrival would
find, so the result does not depend on how the text was split into deltas.
(vLLM takes the first matching stop string in list order instead.)
"""

from __future__ import annotations

from typing import NamedTuple


class StopMatch(NamedTuple):
    """A stop string found in the output text."""

    stop: str  # The stop string that matched.
    truncate_to: int  # How many leading characters of the text to keep.


class StopStringChecker:
    """Finds stop strings in a request's output text as it grows.

    `check` gives where to cut the text: before the stop string, or after it
    when `include_stop_str_in_output`. A streaming API must hold back the
    last `holdback` characters until more text (or the end) shows they do
    not begin a stop string that is excluded from the output; `streamable_delta`
    does that bookkeeping.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"Stop strings must be non-empty strings, got {s!r}.")
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        max_len = max((len(s) for s in self.stop), default=0)
        # Text kept in the output (include_stop_str_in_output) never needs hiding.
        self.holdback = 0 if include_stop_str_in_output else max(max_len - 1, 0)
        self._max_len = max_len

    def check(self, text: str, new_char_count: int) -> StopMatch | None:
        """Find a stop string ending in the last `new_char_count` chars of `text`.

        Returns None when there is none; the caller must have checked the
        text before those chars already (it holds no stop string).
        """
        if not 0 <= new_char_count <= len(text):
            raise ValueError(
                f"new_char_count must be in [0, {len(text)}], got {new_char_count}."
            )
        if not new_char_count or not self.stop:
            return None
        search_from = max(len(text) - new_char_count - self._max_len + 1, 0)
        best = None  # (end, start, stop)
        for s in self.stop:
            start = text.find(s, search_from)
            if start != -1 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is None:
            return None
        end, start, s = best
        return StopMatch(s, end if self.include_stop_str_in_output else start)

    def streamable_delta(self, text: str, num_sent: int, finished: bool) -> str:
        """The part of `text` after its first `num_sent` chars that is safe to stream.

        While not `finished`, the last `holdback` chars are withheld; once
        finished (text already truncated at any stop), all the rest is given.
        """
        if not 0 <= num_sent <= len(text):
            raise ValueError(f"num_sent must be in [0, {len(text)}], got {num_sent}.")
        end = len(text) if finished else max(len(text) - self.holdback, num_sent)
        return text[num_sent:end]
