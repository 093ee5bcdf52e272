"""The continuous-batching scheduler: one token budget per step, no separate prefill and decode phases.

Never imports jax: it decides which requests run and how many tokens each gets, and the batch
builder turns that decision into arrays.
"""

from __future__ import annotations

import dataclasses
import time

from jaxserve.config import SchedulerConfig
from jaxserve.kv.cache_manager import KVCacheManager, pages_for_tokens
from jaxserve.request import Logprob, Request, RequestStatus
from jaxserve.sampling_params import MAX_EOS_TOKEN_IDS


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: `num_new_tokens` tokens starting at `num_computed_tokens`."""

    request: Request
    num_new_tokens: int
    num_computed_tokens: int
    page_ids: tuple[int, ...]
    samples: bool  # the chunk reaches the end of the request's tokens, so its last logits sample a token
    page_copies: tuple[tuple[int, int], ...] = ()  # (source, copy) pages to copy before this step writes
    # Leading tokens of the chunk whose KV the request's pages already hold (a fork's last prompt
    # token, computed again only for its logits): the step must not write them into shared pages.
    num_present_tokens: int = 0
    sample_index: int = 0  # the output index of the token this chunk samples (when it samples)
    # Tokens the chunk samples: 1, or up to num_scheduler_steps for a decode run as several iterations in
    # one device call, each computing the token the last one sampled (pages for them all are allocated).
    num_steps: int = 1

    @property
    def num_samples(self) -> int:
        """Tokens this step samples for the request: num_steps, or 0 for a chunk that stops mid-prompt."""
        return self.num_steps if self.samples else 0

    @property
    def num_positions(self) -> int:
        """Positions whose KV this step computes: the chunk's tokens and the extra iterations' inputs."""
        return self.num_new_tokens + self.num_steps - 1


@dataclasses.dataclass
class SchedulerOutput:
    """The decision for one step: plain Python, no arrays."""

    scheduled: list[ScheduledRequest]  # in batch row order
    preempted_ids: list[str]

    @property
    def page_copies(self) -> list[tuple[int, int]]:
        """Every (source, copy) page copy the step makes before it writes."""
        return [copy for item in self.scheduled for copy in item.page_copies]

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
    """FCFS or priority scheduling with a single per-step token budget and preemption by recompute.

    With `static_batching` it is the pre-paging baseline instead: waiting requests form a batch only
    once every request of the previous batch has finished, each member reserves the pages of
    max_model_len tokens when the batch forms, and members share no pages (no forks, no prefix cache).
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []  # admission order (priority policy: picked by key)
        self.running: list[Request] = []  # admission order; the last is preempted first (FCFS)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # prompt tokens of requests that produced their first token
        self.num_generation_tokens = 0  # sampled tokens appended to outputs
        self.num_prefix_cache_queries = 0  # tokens of admitted requests looked up in the prefix cache
        self.num_prefix_cache_hits = 0  # of those, tokens found computed in cached pages
        self.static_batch: list[Request] = []  # static batching: the members of the current batch

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
        self._end(request, status)

    def _end(self, request: Request, status: RequestStatus) -> None:
        """Take an unfinished request out of its queue and finish it."""
        (self.running if request in self.running else self.waiting).remove(request)
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
            if self._ends_on_the_device(request):
                index += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            victims = self._grow_or_preempt(request, num_new)
            preempted += [victim.request_id for victim, _ in victims]
            # A victim already given tokens this step leaves the batch and gives its tokens back (one that
            # only waits for its last samples was passed over: it had none).
            for victim, victim_index in victims:
                if victim_index < index:
                    index -= 1
                    entry = next((s for s in scheduled if s.request is victim), None)
                    if entry is not None:
                        scheduled.remove(entry)
                        budget += entry.num_new_tokens
            if any(victim is request for victim, _ in victims):
                continue  # the request preempted itself; the list has shifted under `index`
            scheduled.append(self._schedule_one(request, num_new))
            budget -= num_new
            index += 1

        if self.config.static_batching:
            candidates = self._static_batch_waiting()
        else:
            candidates = [r for r in self._waiting_in_order() if not self._waits_for_fork(r)]
        for request in candidates:
            if budget <= 0 or preempted or len(self.running) >= self.config.max_num_seqs:
                break
            item = self._admit(request, budget)
            if item is None:
                break
            scheduled.append(item)
            budget -= item.num_new_tokens

        if self.config.num_scheduler_steps > 1 and not preempted:
            scheduled = self._take_steps(scheduled)
        for item in scheduled:
            self._advance(item)
        return SchedulerOutput(scheduled=scheduled, preempted_ids=preempted)

    def _advance(self, item: ScheduledRequest) -> None:
        """Count a scheduled chunk as computed and its samples (if any) as placeholders until update()
        brings their ids: the next step can then be planned before this one's tokens reach the host."""
        item.request.num_computed_tokens = item.num_computed_tokens + item.num_positions
        item.request.num_output_placeholders += item.num_samples

    def _take_steps(self, scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """Multi-step decoding: when every row is a plain decode, give each up to num_scheduler_steps samples
        (fewer near its max_tokens or max_model_len), with pages for them all; a row whose pages cannot be
        had takes one step. Otherwise the step stays as it is."""
        if not scheduled or not all(_decodes_plainly(item) for item in scheduled):
            return scheduled
        stepped = []
        for item in scheduled:
            request, computed = item.request, item.num_computed_tokens
            steps = min(self.config.num_scheduler_steps, request.max_tokens - item.sample_index,
                        self.config.max_model_len - 1 - computed)
            if steps > 1 and self.kv.allocate_slots(request.request_id, computed + 1, computed + steps):
                pages = self.kv.page_ids(request.request_id)[:pages_for_tokens(computed + steps, self.kv.page_size)]
                item = dataclasses.replace(item, num_steps=steps, page_ids=tuple(pages),
                                           page_copies=item.page_copies + tuple(self.kv.pop_copies(request.request_id)))
            stepped.append(item)
        return stepped

    def _ends_on_the_device(self, request: Request) -> bool:
        """True for a request whose sampled tokens still on the device already reach max_tokens or
        max_model_len: there is nothing more to compute for it, only its last token to wait for."""
        return request.num_output_placeholders > 0 and (
            request.num_sampled_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len)

    def _admit(self, request: Request, budget: int) -> ScheduledRequest | None:
        """Give a waiting request its pages, move it to running and schedule it; None (and no change)
        when it does not fit.

        Its computed start comes from a sibling that has computed the same prompt (a fork: the prompt's
        pages are shared and only the last prompt token is computed again, for its logits, without
        writing its KV, which the shared page already holds), or else from the prefix cache (the
        longest run of its full pages already computed by anyone).
        """
        source = self._fork_source(request)
        cached: list[int] = []
        num_present = 0
        if source is not None:
            self.kv.fork(request.request_id, source.request_id, len(request.prompt_token_ids))
            num_computed, num_present = len(request.prompt_token_ids) - 1, 1
        else:
            if request.prompt_logprobs is None:  # scoring the prompt needs every position computed
                cached = self.kv.find_cached_prefix(request.token_ids(0, request.num_tokens), request.cache_salt)
            num_computed = len(cached) * self.kv.page_size
        remaining = request.num_tokens - num_computed
        num_new = min(remaining, budget)
        fits = num_new == remaining or self.config.enable_chunked_prefill
        first_written = num_computed + num_present
        if not fits or not self.kv.allocate_slots(request.request_id, first_written, num_computed + num_new, cached):
            if source is not None:
                self.kv.free(request.request_id)  # a fork's shared pages go back
            return None
        if source is None and self.kv.enable_prefix_caching:
            self.num_prefix_cache_queries += request.num_tokens
            self.num_prefix_cache_hits += num_computed
        if source is None and request.first_scheduled_time is None:
            request.num_cached_tokens = num_computed
        request.num_computed_tokens = num_computed
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        request.first_scheduled_time = request.first_scheduled_time or time.monotonic()
        self.running.append(request)
        return self._schedule_one(request, num_new, num_present)

    def _static_batch_waiting(self) -> list[Request]:
        """Static batching: the current batch's members still waiting to start, after forming a new
        batch when every member of the last one has finished: the waiting requests in order, up to
        max_num_seqs, while the pool can reserve max_model_len tokens of pages for each."""
        if all(member.is_finished for member in self.static_batch):
            self.static_batch = []
            for request in self._waiting_in_order():
                if len(self.static_batch) == self.config.max_num_seqs or not self.kv.allocate_slots(
                        request.request_id, 0, self.config.max_model_len):
                    break
                self.static_batch.append(request)
        return [member for member in self.static_batch if member.status is not RequestStatus.RUNNING
                and not member.is_finished]

    def _sibling(self, request: Request) -> Request | None:
        """The sibling this request forks from, while it is unfinished (finished requests leave
        `self.requests`); None for a first sample and under static batching (nothing is shared)."""
        if not request.fork_source or self.config.static_batching:
            return None
        return self.requests.get(request.fork_source)

    def _fork_source(self, request: Request) -> Request | None:
        """The sibling whose computed prompt this request can share now, if any (a sibling waiting or
        preempted has computed nothing)."""
        source = self._sibling(request)
        return source if source is not None and source.num_computed_tokens >= len(request.prompt_token_ids) else None

    def _waits_for_fork(self, request: Request) -> bool:
        """True while the sibling this request will fork from is alive but has not computed the prompt yet
        (admitting it now would compute the same prompt twice)."""
        source = self._sibling(request)
        return source is not None and source.num_computed_tokens < len(request.prompt_token_ids)

    def unschedule(self, output: SchedulerOutput) -> None:
        """Take back a step that never ran: the requests keep their pages and the tokens computed before it,
        and their next step makes the page copies this one did not."""
        for item in output.scheduled:
            item.request.num_computed_tokens = item.num_computed_tokens
            item.request.num_output_placeholders -= item.num_samples
            self.kv.restore_copies(item.request.request_id, list(item.page_copies))

    def update(self, output: SchedulerOutput, sampled: list[list[SampledToken]]) -> list[Request]:
        """Bring a finished step's samples: each replaces a placeholder and stop checks may finish requests
        (tokens after a stop are dropped; a request preempted since the step was planned keeps its tokens);
        returns requests that changed.

        `sampled[i]` holds the tokens `output.scheduled[i]` sampled, in order (none for a chunk that does
        not sample).
        """
        changed = []
        now = time.monotonic()
        for item, samples in zip(output.scheduled, sampled, strict=True):
            request = item.request
            if request.is_finished:
                continue  # finished from outside, or by an earlier token, after the step was planned
            if request.status is RequestStatus.RUNNING:  # pages full of KV whose token ids the host has
                self.kv.cache_full_pages(request.request_id, min(request.num_computed_tokens,
                                         request.num_known_tokens), request.token_ids, request.cache_salt)
            if not samples:
                continue
            if request.max_tokens == 0:  # the prompt ran (for its logprobs); nothing is generated
                self._end(request, RequestStatus.FINISHED_LENGTH_CAPPED)
            else:
                for sample in samples:
                    if self._append(request, sample, now):
                        break
            changed.append(request)
        return changed

    def _append(self, request: Request, sample: SampledToken, now: float) -> bool:
        """Replace one placeholder by its sampled token and apply the stop checks; True when that ended the
        request."""
        request.num_output_placeholders -= 1
        request.output_token_ids.append(sample.token_id)
        if sample.logprobs is not None:
            request.output_logprobs.append(sample.logprobs)
        self.num_generation_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = now
            self.num_prompt_tokens += len(request.prompt_token_ids)
        status = self._stop_status(request, sample.token_id)
        if status is not None:
            self._end(request, status)
        return status is not None

    # ---- internals -------------------------------------------------------------------------

    def _schedule_one(self, request: Request, num_new: int, num_present: int = 0) -> ScheduledRequest:
        # Only the pages the step's tokens reach (static batching reserves more than that).
        num_pages = pages_for_tokens(request.num_computed_tokens + num_new, self.kv.page_size)
        return ScheduledRequest(
            request=request,
            num_new_tokens=num_new,
            num_computed_tokens=request.num_computed_tokens,
            page_ids=tuple(self.kv.page_ids(request.request_id)[:num_pages]),
            samples=request.num_computed_tokens + num_new == request.num_tokens,
            page_copies=tuple(self.kv.pop_copies(request.request_id)),
            num_present_tokens=num_present,
            sample_index=request.num_sampled_tokens,
        )

    def _grow_or_preempt(self, request: Request, num_new: int) -> list[tuple[Request, int]]:
        """Allocate pages for `request`, preempting victims until it fits (or it is the victim).

        Returns each victim with the index it had in `running` when it was preempted.
        """
        victims = []
        total = request.num_computed_tokens + num_new
        while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens, total):
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

    def _waiting_in_order(self) -> list[Request]:
        """FCFS: queue order; priority: the lowest priority value, then the earliest arrival."""
        if self.config.policy == "priority":
            return sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time))
        return list(self.waiting)

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
        if request.num_output_tokens >= request.max_tokens or request.num_known_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None


def _decodes_plainly(item: ScheduledRequest) -> bool:
    """True for a one-token decode whose sampling reads nothing but its logits and seed (no penalties, bans,
    biases, allowed ids or logprobs), so several of its tokens can be sampled on the device in a row."""
    request, params = item.request, item.request.sampling_params
    return (item.samples and item.num_new_tokens == 1 and not request.needs_output_on_host
            and item.sample_index >= params.min_tokens and not params.allowed_token_ids and not params.logit_bias
            and params.logprobs is None and not request.num_prompt_logprobs_missing
            and len(request.eos_token_ids) <= MAX_EOS_TOKEN_IDS)
