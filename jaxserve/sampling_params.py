"""User-facing sampling parameters, with vLLM's field names, defaults and checks.

Every numeric field is range-checked here against the array it is later packed into (int32 ids and
counts, float32 values, a 64-bit seed), so no value that passes can fail inside an engine step.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from typing import ClassVar

from jaxserve.structured.params import StructuredOutputsParams

# Temperatures below this are treated as greedy decoding (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE_EPS = 1e-5
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
# Longest token lists a request may send; they bound the sampler's per-row token list (batch/builder.py).
MAX_STOP_TOKEN_IDS = 64
MAX_EOS_TOKEN_IDS = 16  # multi-step decoding checks this many EOS ids on the device (more: one token per step)
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_ALLOWED_TOKEN_IDS = 1024
MAX_BAD_WORDS = 64


def _is_int(value: object) -> bool:
    """True for a Python or numpy integer that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """True for a Python or numpy real number that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    """ValueError unless `value` is a finite number in [low, high] (or (low, high] when `low_open`)."""
    ok = _is_real(value) and math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        if high >= FLOAT32_MAX:  # no real upper bound: say only the lower one
            raise ValueError(f"{name} must be a finite number {'>' if low_open else '>='} {low}, got {value!r}.")
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be a finite number in {bracket}{low}, {high}], got {value!r}.")


def check_int(name: str, value: object, low: int, high: int) -> None:
    """ValueError unless `value` is an int in [low, high]."""
    if not _is_int(value) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}.")


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request holds (vLLM's): CUMULATIVE everything generated so far, at every step it
    moves; DELTA only what is new since its previous output (a sample's new text, token ids and logprobs; the
    cumulative logprob stays cumulative); FINAL_ONLY one output, once it has finished."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request's output tokens (see vLLM's SamplingParams).

    `stop` and `stop_token_ids` are normalised to lists; `top_k` of -1 and 0
    both mean "no limit"; `max_tokens=None` means "until max_model_len" and
    `max_tokens=0` generates nothing (the prompt is still run, for
    `prompt_logprobs`); `logprobs=None` returns no logprobs, `logprobs=k` returns
    the chosen token's logprob plus the top-k alternatives; `prompt_logprobs=k`
    does the same for every prompt token after the first. `best_of` samples are
    generated (None: `n`) and the `n` with the highest cumulative logprob are
    returned. `logit_bias` adds to the logits of token ids, `allowed_token_ids`
    keeps only those ids, and
    `bad_words` bans each word's last token wherever the output already ends with
    the rest of it. `truncate_prompt_tokens=k` keeps the prompt's last k tokens, or with
    `truncation_side="right"` its first k (vLLM's).
    """

    MAX_LOGPROBS: ClassVar[int] = 20

    n: int = 1
    best_of: int | None = None
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
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"  # which end truncate_prompt_tokens cuts: "left" keeps the last tokens
    # The output must match a JSON schema, regex, choice, grammar or structural tag (jaxserve/structured/); a
    # mapping of StructuredOutputsParams' fields is taken too.
    structured_outputs: StructuredOutputsParams | None = None
    # A reasoning model's thinking ends after at most this many tokens (vLLM's): the end of thinking is then forced
    # (structured/constraint.py); None (or vLLM's -1): no bound but max_tokens.
    thinking_token_budget: int | None = None
    # What the request's outputs hold (RequestOutputKind); `LLM.generate` runs its requests FINAL_ONLY.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                    StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or a mapping of its fields.")
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_token_ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        self._verify_sampling_args()
        self._verify_length_args()
        self._verify_output_args()
        self._verify_logits_processing_args()
        # True only on the copy `engine_params` makes for best_of > n: logprobs computed to rank the samples
        # but not asked for, so not shown (an attribute, not a field: asdict, replace and == ignore it).
        self._logprobs_for_ranking_only = False

    @staticmethod
    def _normalise_stop(stop: str | list[str] | None) -> list[str]:
        """Return `stop` as a list of non-empty strings."""
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {s!r}.")
        return stops

    @staticmethod
    def _normalise_token_ids(name: str, ids: list[int] | None, max_len: int) -> list[int]:
        """Return a token-id list as a list of at most `max_len` ints in [0, 2**31 - 1]."""
        ids = list(ids or [])
        if len(ids) > max_len:
            raise ValueError(f"{name} may name at most {max_len} token ids, got {len(ids)}.")
        for token_id in ids:
            if not _is_int(token_id) or not 0 <= token_id <= INT32_MAX:
                raise ValueError(f"{name} must contain only ints in [0, {INT32_MAX}], got {token_id!r}.")
        return [int(token_id) for token_id in ids]

    def _verify_sampling_args(self) -> None:
        """Check the fields that shape the next-token distribution."""
        check_int("n", self.n, 1, INT32_MAX)
        if self.best_of is not None:
            check_int("best_of", self.best_of, 1, INT32_MAX)
            if self.best_of < self.n:
                raise ValueError(
                    f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}."
                )
        check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_float("repetition_penalty", self.repetition_penalty, 0.0, FLOAT32_MAX, low_open=True)
        check_float("temperature", self.temperature, 0.0, FLOAT32_MAX)
        check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise ValueError(
                f"top_k must be -1 or 0 (no limit) or an int in [1, {INT32_MAX}], got {self.top_k!r}."
            )
        check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            check_int("seed", self.seed, INT64_MIN, INT64_MAX)

    def _verify_length_args(self) -> None:
        """Check max_tokens, min_tokens, thinking_token_budget and truncate_prompt_tokens."""
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            raise ValueError(f"max_tokens must be an int >= 0 or None, got {self.max_tokens!r}.")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None
        if self.thinking_token_budget is not None and (
            not _is_int(self.thinking_token_budget) or self.thinking_token_budget < 0
        ):
            raise ValueError(
                f"thinking_token_budget must be an int >= 0, or -1 or None for no budget, got "
                f"{self.thinking_token_budget!r}."
            )
        if self.truncate_prompt_tokens is not None and (
            not _is_int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens < 1
        ):
            raise ValueError(
                f"truncate_prompt_tokens must be an int >= 1 or None, got {self.truncate_prompt_tokens!r}."
            )
        if self.truncation_side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}.")

    def _verify_output_args(self) -> None:
        """Check the logprobs requests and the output kind."""
        if not _is_int(self.output_kind) or int(self.output_kind) not in set(RequestOutputKind):
            kinds = ", ".join(f"{kind.name} ({kind.value})" for kind in RequestOutputKind)
            raise ValueError(f"output_kind must be a RequestOutputKind: {kinds}; got {self.output_kind!r}.")
        self.output_kind = RequestOutputKind(int(self.output_kind))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= self.MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be an int in [0, {self.MAX_LOGPROBS}] or None, got {value!r}."
                )

    def _verify_logits_processing_args(self) -> None:
        """Check logit_bias, allowed_token_ids and bad_words (ids against the vocabulary: the engine)."""
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise ValueError(
                    f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(self.logit_bias)}."
                )
            bias = {}
            for token_id, value in dict(self.logit_bias).items():
                if isinstance(token_id, str) and token_id.lstrip("-").isdigit():
                    token_id = int(token_id)  # JSON object keys are strings
                if not _is_int(token_id) or not 0 <= token_id <= INT32_MAX:
                    raise ValueError(f"logit_bias keys must be token ids in [0, {INT32_MAX}], got {token_id!r}.")
                check_float(f"logit_bias[{token_id}]", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
                bias[int(token_id)] = float(value)
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = self._normalise_token_ids(
                "allowed_token_ids", self.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS
            )
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must name at least one token id when given.")
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
            if len(words) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words may hold at most {MAX_BAD_WORDS} words, got {len(words)}.")
            for word in words:
                if not isinstance(word, str) or not word.strip():
                    raise ValueError(f"bad_words must contain only non-blank strings, got {word!r}.")
            self.bad_words = words

    @property
    def num_samples(self) -> int:
        """How many samples the engine generates: `best_of`, or `n` when it is unset."""
        return self.n if self.best_of is None else self.best_of

    @property
    def output_logprobs(self) -> int | None:
        """The logprobs the output shows per token (None: none), whatever the engine computes."""
        return None if self._logprobs_for_ranking_only else self.logprobs

    def engine_params(self) -> SamplingParams:
        """The params each sample runs with in the engine. With best_of > n the samples are ranked by
        cumulative logprob, so each must compute its chosen tokens' logprobs even when none were asked
        for: it runs with logprobs=0 (the chosen token alone), and `output_logprobs` stays None."""
        if self.num_samples == self.n or self.logprobs is not None:
            return self
        ranked = self.clone(logprobs=0)
        ranked._logprobs_for_ranking_only = True
        return ranked

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
