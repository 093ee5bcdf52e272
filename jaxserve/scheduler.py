"""The continuous-batching scheduler: one token budget per step, no separate prefill and decode phases.

Never imports jax: it decides which requests run and how many tokens each gets, and the batch
builder turns that decision into arrays.
"""

from __future__ import annotations

import dataclasses
import time

from jaxserve.config import SchedulerConfig
from jaxserve.kv.cache_manager import KVCacheManager
from jaxserve.request import Logprob, Request, RequestStatus


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: `num_new_tokens` tokens starting at `num_computed_tokens`."""

    request: Request
    num_new_tokens: int
    num_computed_tokens: int
    page_ids: tuple[int, ...]
    samples: bool  # the chunk reaches the end of the request's tokens, so its last logits sample a token


@dataclasses.dataclass
class SchedulerOutput:
    """The decision for one step: plain Python, no arrays."""

    scheduled: list[ScheduledRequest]  # in batch row order
    preempted_ids: list[str]

    @property
    def total_num_tokens(self) -> int:
        """Tokens in this step before padding."""
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """True when nothing runs this step."""
        return not self.scheduled


@dataclasses.dataclass(frozen=True)
class SampledToken:
    """What the device produced for one sampling row."""

    token_id: int
    logprobs: dict[int, Logprob] | None = None


class Scheduler:
    """FCFS or priority scheduling with a single per-step token budget and preemption by recompute."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []  # admission order (priority policy: picked by key)
        self.running: list[Request] = []  # admission order; the last is preempted first (FCFS)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # prompt tokens of requests that produced their first token
        self.num_generation_tokens = 0  # sampled tokens appended to outputs

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request from outside the step (abort, stop string); a no-op when it already ended."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, status)

    def has_unfinished_requests(self) -> bool:
        """True while anything waits or runs."""
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Give each running request, then each waiting one, tokens from one budget."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            victims = self._grow_or_preempt(request, num_new)
            preempted += [victim.request_id for victim, _ in victims]
            # A victim already given tokens this step leaves the batch and gives its tokens back.
            for victim, victim_index in victims:
                if victim_index < index:
                    index -= 1
                    entry = next(s for s in scheduled if s.request is victim)
                    scheduled.remove(entry)
                    budget += entry.num_new_tokens
            if any(victim is request for victim, _ in victims):
                continue  # the request preempted itself; the list has shifted under `index`
            scheduled.append(self._schedule_one(request, num_new))
            budget -= num_new
            index += 1

        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self._next_waiting()
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, budget)
            if num_new < remaining and not self.config.enable_chunked_prefill:
                break
            if not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
                break
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            request.first_scheduled_time = request.first_scheduled_time or time.monotonic()
            self.running.append(request)
            scheduled.append(self._schedule_one(request, num_new))
            budget -= num_new

        return SchedulerOutput(scheduled=scheduled, preempted_ids=preempted)

    def update(self, output: SchedulerOutput, sampled: list[SampledToken | None]) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish requests; returns requests that changed.

        `sampled[i]` belongs to `output.scheduled[i]` and is None for a chunk that does not sample.
        """
        changed = []
        now = time.monotonic()
        for item, sample in zip(output.scheduled, sampled, strict=True):
            request = item.request
            if request.is_finished:
                continue  # finished from outside during the step
            request.num_computed_tokens = item.num_computed_tokens + item.num_new_tokens
            if sample is None:
                continue
            if request.max_tokens == 0:  # the prompt ran (for its logprobs); nothing is generated
                self.running.remove(request)
                self._finish(request, RequestStatus.FINISHED_LENGTH_CAPPED)
                changed.append(request)
                continue
            request.output_token_ids.append(sample.token_id)
            if sample.logprobs is not None:
                request.output_logprobs.append(sample.logprobs)
            self.num_generation_tokens += 1
            if request.first_token_time is None:
                request.first_token_time = now
                self.num_prompt_tokens += len(request.prompt_token_ids)
            status = self._stop_status(request, sample.token_id)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            changed.append(request)
        return changed

    # ---- internals -------------------------------------------------------------------------

    def _schedule_one(self, request: Request, num_new: int) -> ScheduledRequest:
        return ScheduledRequest(
            request=request,
            num_new_tokens=num_new,
            num_computed_tokens=request.num_computed_tokens,
            page_ids=tuple(self.kv.page_ids(request.request_id)),
            samples=request.num_computed_tokens + num_new == request.num_tokens,
        )

    def _grow_or_preempt(self, request: Request, num_new: int) -> list[tuple[Request, int]]:
        """Allocate pages for `request`, preempting victims until it fits (or it is the victim).

        Returns each victim with the index it had in `running` when it was preempted.
        """
        victims = []
        while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
            victim = self._pick_victim()
            victims.append((victim, self.running.index(victim)))
            self._preempt(victim)
            if victim is request:
                break
        return victims

    def _pick_victim(self) -> Request:
        """FCFS: the most recently admitted running request; priority: the lowest-priority, latest one."""
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _next_waiting(self) -> Request:
        """FCFS: the head of the queue; priority: the lowest priority value, then the earliest arrival."""
        if self.config.policy == "priority":
            return min(self.waiting, key=lambda r: (r.priority, r.arrival_time))
        return self.waiting[0]

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop its pages and re-queue it at the front."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.finished_time = time.monotonic()
        self.kv.free(request.request_id)
        del self.requests[request.request_id]

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        """Token-level stop checks (stop strings are the output processor's)."""
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None
