"""User-facing sampling parameters, with vLLM's field names, defaults and checks."""

from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar

# Temperatures below this are treated as greedy decoding (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE_EPS = 1e-5


def _is_int(value: object) -> bool:
    """True for a Python or numpy integer that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_range(name: str, value: float, low: float, high: float) -> None:
    """Raise ValueError unless low <= value <= high."""
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}.")


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request's output tokens (see vLLM's SamplingParams).

    `stop` and `stop_token_ids` are normalised to lists; `top_k` of -1 and 0
    both mean "no limit"; `max_tokens=None` means "until max_model_len";
    `logprobs=None` returns no logprobs, `logprobs=k` returns the chosen
    token's logprob plus the top-k alternatives.
    """

    MAX_LOGPROBS: ClassVar[int] = 20

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        self._verify_sampling_args()
        self._verify_length_args()
        self._verify_output_args()

    @staticmethod
    def _normalise_stop(stop: str | list[str] | None) -> list[str]:
        """Return `stop` as a list of non-empty strings."""
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {s!r}.")
        return stops

    @staticmethod
    def _normalise_stop_token_ids(ids: list[int] | None) -> list[int]:
        """Return `stop_token_ids` as a list of non-negative ints."""
        ids = list(ids or [])
        for token_id in ids:
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(
                    f"stop_token_ids must contain only ints >= 0, got {token_id!r}."
                )
        return ids

    def _verify_sampling_args(self) -> None:
        """Check the fields that shape the next-token distribution."""
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}.")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not self.repetition_penalty > 0.0:
            raise ValueError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}."
            )
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k must be -1 or 0 (no limit) or an int >= 1, got {self.top_k!r}."
            )
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}.")

    def _verify_length_args(self) -> None:
        """Check max_tokens and min_tokens."""
        if self.max_tokens is not None and (
            not _is_int(self.max_tokens) or self.max_tokens < 1
        ):
            raise ValueError(
                f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}."
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )

    def _verify_output_args(self) -> None:
        """Check the logprobs request."""
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= self.MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an int in [0, {self.MAX_LOGPROBS}] or None, "
                f"got {self.logprobs!r}."
            )

    @property
    def is_greedy(self) -> bool:
        """True when decoding is argmax (temperature below 1e-5, as in vLLM)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def needs_penalties(self) -> bool:
        """True when any presence/frequency/repetition penalty is not neutral."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes) -> SamplingParams:
        """Return a validated copy with `changes` applied (e.g. for n>1 children)."""
        return dataclasses.replace(self, **changes)
