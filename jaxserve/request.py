"""Request: the host-side state of one sequence being generated."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import TYPE_CHECKING

from jaxserve.pooling.pooled import PooledPrompt
from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # for type hints only
    from jaxserve.structured.constraint import ReplyConstraint


class RequestStatus(enum.IntEnum):
    """Lifecycle states; every status above PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # the engine failed this request alone (bad input found late); the engine goes on

    @property
    def is_finished(self) -> bool:
        """True once the request will never be scheduled again."""
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI/vLLM finish_reason: 'stop', 'length', 'abort', or None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclasses.dataclass(frozen=True)
class Logprob:
    """Log-probability of one token (vLLM's shape)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence: its tokens so far and how many of them have K/V in the cache.

    The scheduler's one rule: each step a request is given tokens so that `num_computed_tokens`
    catches up with `num_tokens`. A decode is simply a request one token behind.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    seed: int  # resolved per-request seed: the user's, or one drawn by the engine
    max_tokens: int  # resolved: sampling_params.max_tokens or what fits in max_model_len
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    priority: int = 0
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)
    # Filled as the prompt is computed, for the one sample of a user request that reports them: None
    # for the first prompt token, then one dict per prompt token. None when not asked for.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    bad_words_token_ids: list[list[int]] = dataclasses.field(default_factory=list)  # each word, tokenized
    # A sibling sample with the same prompt: once it has computed the prompt, this request shares its
    # prompt pages (copy-on-write) instead of computing the prompt again. None for the first sample.
    fork_source: str | None = None
    cache_salt: str | None = None  # requests share cached prefix pages only when their salts are equal
    lora_slot: int = -1  # the slot of the LoRA adapter it runs with (model/lora.py); -1: the base model
    num_computed_tokens: int = 0
    # Tokens sampled by steps still on the device: they count in num_tokens (the next step computes the
    # last of them, reading its id on the device) but their ids reach output_token_ids only later.
    num_output_placeholders: int = 0
    num_cached_tokens: int = 0  # prompt tokens found computed at first admission (prefix cache or a fork)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    error: str | None = None  # why the engine failed this request (status FINISHED_ERROR)
    # What its next token may be (structured/constraint.py): a thinking budget's forced end, an answer's grammar
    constraint: ReplyConstraint | None = None
    # A pooling (embedding) request's pool of its prompt's final hidden states; it generates nothing (max_tokens 0)
    pooled: PooledPrompt | None = None
    num_preemptions: int = 0
    # Preemptions by other requests since this one last yielded (preempted itself for lack of pages): under the
    # priority policy, a request at max_preemptions is not preempted by another again until it yields or ends.
    num_preemptions_in_a_row: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens, those still on the device included."""
        return self.num_known_tokens + self.num_output_placeholders

    @property
    def num_known_tokens(self) -> int:
        """Prompt plus generated tokens whose ids the host has."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens whose ids the host has."""
        return len(self.output_token_ids)

    @property
    def num_sampled_tokens(self) -> int:
        """Generated tokens, those still on the device included (the next sample's index)."""
        return len(self.output_token_ids) + self.num_output_placeholders

    @property
    def needs_output_on_host(self) -> bool:
        """True when building this request's next sampling row reads its output token ids (penalties,
        bad words), so a step must not be planned while one of its tokens is still on the device. (A constraint's mask
        is filled after planning, once the step in flight is back: EngineCore._launch.)"""
        return self.sampling_params.needs_penalties or bool(self.bad_words_token_ids)

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Token ids at positions [start, stop) of prompt + output."""
        prompt_len = len(self.prompt_token_ids)
        if stop <= prompt_len:
            return self.prompt_token_ids[start:stop]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : stop - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - prompt_len]

    @property
    def num_prompt_logprobs_missing(self) -> int:
        """Prompt tokens whose logprob is still to be computed (0 when none was asked for)."""
        if self.prompt_logprobs is None:
            return 0
        return len(self.prompt_token_ids) - len(self.prompt_logprobs)

    @property
    def needs_every_prompt_position(self) -> bool:
        """True when the request reads the states of prompt positions before the last (prompt logprobs, mean or
        first-token pooling), so it cannot skip a cached prefix."""
        return self.prompt_logprobs is not None or (self.pooled is not None and self.pooled.uses_every_position)

    @property
    def is_finished(self) -> bool:
        """True once the request will never be scheduled again."""
        return self.status.is_finished
