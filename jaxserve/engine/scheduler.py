"""The continuous-batching scheduler: one token budget per step, no separate prefill and decode phases.

Never imports jax: it decides which requests run and how many tokens each gets, and the batch
builder turns that decision into arrays.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time

from jaxserve.config import SchedulerSettings
from jaxserve.kv.cache_manager import KVCacheManager, pages_for_tokens
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import MAX_EOS_TOKEN_IDS
from jaxserve.spec_decode.proposer import Proposer
from jaxserve.step import SampledToken, ScheduledRequest, SchedulerOutput


class Scheduler:
    """FCFS or priority scheduling with a single per-step token budget and preemption by recompute or swap.

    With `static_batching` it is the pre-paging baseline instead: waiting requests form a batch only
    once every request of the previous batch has finished, each member reserves the pages of
    max_model_len tokens when the batch forms, and members share no pages (no forks, no prefix cache).
    """

    def __init__(self, config: SchedulerSettings, kv: KVCacheManager, proposer: Proposer | None = None):
        self.config = config
        self.kv = kv
        self.proposer = proposer  # speculative decoding's guesses, asked for in the steps that verify them
        self.waiting: list[Request] = []  # admission order (priority policy: picked by key)
        self.running: list[Request] = []  # admission order; the last is preempted first (FCFS)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # prompt tokens of requests that produced their first token
        self.num_generation_tokens = 0  # sampled tokens appended to outputs
        self.num_prefix_cache_queries = 0  # tokens of admitted requests looked up in the prefix cache
        self.num_prefix_cache_hits = 0  # of those, tokens found computed in cached pages
        self.num_swapped_out_requests = 0  # preemptions by swap
        self.num_swapped_out_pages = 0  # pages copied to the host pool
        self.num_swapped_in_pages = 0  # pages copied back
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

    def queue_lengths_by_priority(self) -> dict[int, dict[str, int]]:
        """{priority: {"running": n, "waiting": n, "swapped": n}}: swapped requests wait too."""
        counts = {"running": collections.Counter(r.priority for r in self.running),
                  "waiting": collections.Counter(r.priority for r in self.waiting),
                  "swapped": collections.Counter(self.requests[i].priority for i in self.kv.swapped_request_ids())}
        priorities = sorted(set(counts["running"]) | set(counts["waiting"]))
        return {priority: {queue: count[priority] for queue, count in counts.items()} for priority in priorities}

    def has_unfinished_requests(self) -> bool:
        """True while anything waits or runs."""
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Give each running request, then each waiting one, tokens from one budget (priority: the
        most urgent first, preempting less urgent running requests for a waiting one that outranks them)."""
        plan = _StepPlan(budget=self.config.max_num_batched_tokens)
        for request in self._running_in_order():
            if plan.budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING or self._ends_on_the_device(request):
                continue  # preempted earlier in this step, or only waits for its last samples
            num_new = min(request.num_tokens - request.num_computed_tokens, plan.budget)
            if self._grow_or_preempt(request, num_new, plan):
                plan.add(self._schedule_one(request, num_new))

        if self.config.static_batching:
            candidates = self._static_batch_waiting()
        else:
            candidates = [r for r in self._waiting_in_order() if not self._waits_for_fork(r)]
        # a request whose grammar is compiling waits; one whose compile failed is ended by fail_grammars
        candidates = [r for r in candidates
                      if r.constraint is None or (r.constraint.ready and r.constraint.error is None)]
        for request in candidates:
            if request.request_id in plan.preempted_ids:
                continue  # never readmitted in the step that preempted it
            if plan.preempted_ids and self.config.policy == "fcfs":
                break  # pages were short: nothing new joins this step
            item = self._admit_or_preempt(request, plan)
            if item is None:
                break
            plan.add(item)

        scheduled = plan.scheduled
        if self.config.num_scheduler_steps > 1 and not plan.preempted_ids:
            scheduled = self._take_steps(scheduled)
        if self.proposer is not None and not plan.preempted_ids:
            scheduled = self._take_proposals(scheduled, plan.budget)
        for item in scheduled:
            self._advance(item)
        self.num_swapped_out_pages += len(plan.swap_out)
        self.num_swapped_in_pages += len(plan.swap_in)
        return SchedulerOutput(scheduled=scheduled, preempted_ids=plan.preempted_ids, swap_out=plan.swap_out,
                               swap_in=plan.swap_in)

    def pending_compiles(self) -> list[concurrent.futures.Future]:
        """The grammar compiles that waiting requests wait for."""
        return [r.constraint.grammar.compile for r in self.waiting
                if r.constraint is not None and not r.constraint.ready]

    def fail_grammars(self) -> list[Request]:
        """End the waiting requests whose constraint failed to compile (the server refuses those before they get
        here; this catches the rest), with the compiler's reason; returns them."""
        failed = [r for r in self.waiting if r.constraint is not None and r.constraint.error is not None]
        for request in failed:
            request.error = request.constraint.error
            self._end(request, RequestStatus.FINISHED_ERROR)
        return failed

    def _advance(self, item: ScheduledRequest) -> None:
        """Count a scheduled chunk as computed and its samples (if any) as placeholders until update()
        brings their ids: the next step can then be planned before this one's tokens reach the host."""
        item.request.num_computed_tokens = item.num_computed_tokens + item.num_positions
        item.request.num_output_placeholders += item.num_samples

    def _take_steps(self, scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """Multi-step decoding: when every row is a plain decode, give each up to num_scheduler_steps samples
        (fewer near its max_tokens or max_model_len), with pages for them all; a row whose pages cannot be
        had takes one step. Otherwise the step stays as it is."""
        if not scheduled or not all(_decodes_plainly(item, self.config.num_scheduler_steps) for item in scheduled):
            return scheduled
        stepped = []
        for item in scheduled:
            steps = min(self.config.num_scheduler_steps, item.request.max_tokens - item.sample_index,
                        self.config.max_model_len - 1 - item.num_computed_tokens)
            if steps > 1:
                item = self._extend_decode(item, steps - 1, num_steps=steps) or item
            stepped.append(item)
        return stepped

    def _take_proposals(self, scheduled: list[ScheduledRequest], budget: int) -> list[ScheduledRequest]:
        """Speculative decoding with the budget the step leaves (`budget`): the proposer guesses the next tokens of
        the scheduled decodes that can propose and have room for any (before their max_tokens and max_model_len),
        in running order, as many as the budget could take whole guesses of, and each feeds its guess after its
        token, as much of it as the budget left and free pages allow. The step verifies them beside whatever else
        it holds (prompt chunks, rows that do not propose). Proposals come after waiting prompts, so a backlog of
        prompts squeezes speculation out."""
        room = {item.request.request_id: min(self.config.num_speculative_tokens,
                                             item.request.max_tokens - item.sample_index - 1,
                                             self.config.max_model_len - 2 - item.num_computed_tokens)
                for item in scheduled if _can_propose(item.request, self.config.num_speculative_tokens)}
        asking, wanted = [], 0
        for item in scheduled:
            if wanted < budget and room.get(item.request.request_id, 0) > 0:
                asking.append(item.request)
                wanted += room[item.request.request_id]
        guesses = dict(zip((r.request_id for r in asking), self.proposer.propose(asking) if asking else []))
        verifying = []
        for item in scheduled:
            guess = tuple(guesses.get(item.request.request_id, ())[: min(room.get(item.request.request_id, 0), budget)])
            if guess:
                extended = self._extend_decode(item, len(guess), num_new_tokens=1 + len(guess), spec_token_ids=guess)
                if extended is not None:
                    item, budget = extended, budget - len(guess)
            verifying.append(item)
        return verifying

    def _extend_decode(self, item: ScheduledRequest, extra: int, **changes) -> ScheduledRequest | None:
        """A one-token decode that also computes `extra` positions after its token (multi-step iterations or
        proposals): `item` with `changes` and the pages (and page copies) for them all; None, and no change,
        when those pages cannot be had."""
        request_id, total = item.request.request_id, item.num_computed_tokens + 1 + extra
        if not self.kv.allocate_slots(request_id, item.num_computed_tokens + 1, total):
            return None
        pages = self.kv.page_tuple(request_id, pages_for_tokens(total, self.kv.page_size))
        return dataclasses.replace(item, page_ids=pages,
                                   page_copies=item.page_copies + tuple(self.kv.pop_copies(request_id)), **changes)

    def _ends_on_the_device(self, request: Request) -> bool:
        """True for a request whose sampled tokens still on the device already reach max_tokens or
        max_model_len: there is nothing more to compute for it, only its last token to wait for."""
        return request.num_output_placeholders > 0 and (
            request.num_sampled_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len)

    def _admit_or_preempt(self, request: Request, plan: "_StepPlan") -> ScheduledRequest | None:
        """Admit a waiting request; under the priority policy, preempt the running requests it outranks, least
        urgent first, until it fits. None when it does not fit.

        When nothing runs and it still does not fit, the shared pages that swapped-out requests keep on the
        device are what blocks it: those requests drop their pages and will be recomputed."""
        while True:
            if plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
                item = self._admit(request, plan)
                if item is not None:
                    return item
            victim = self._outranked_victim(request)
            if victim is not None:
                self._preempt(victim, plan, by=request)
            elif self.running or not self._drop_swapped_device_pages(keep=request):
                return None

    def _admit(self, request: Request, plan: "_StepPlan") -> ScheduledRequest | None:
        """Give a waiting request its pages, move it to running and schedule it; None (and no change)
        when it does not fit.

        A swapped-out request gets its pages back from the host pool and goes on where it stopped. Else its
        computed start comes from a sibling that has computed the same prompt (a fork: the prompt's pages
        are shared and only the last prompt token is computed again, for its logits, without writing its
        KV, which the shared page already holds), or from the prefix cache (the longest run of its full
        pages already computed by anyone).
        """
        budget = plan.budget
        if self.kv.is_swapped(request.request_id):
            num_computed = request.num_computed_tokens
            num_new = min(request.num_tokens - num_computed, budget)
            fits = num_new > 0 and (num_computed + num_new == request.num_tokens or self.config.enable_chunked_prefill)
            copies = self.kv.swap_in(request.request_id, num_computed, num_computed + num_new) if fits else None
            if copies is None:
                return None
            plan.swap_in += copies
            return self._start_running(request, num_new)
        source = self._fork_source(request)
        cached: list[int] = []
        num_present = 0
        if source is not None:
            self.kv.fork(request.request_id, source.request_id, len(request.prompt_token_ids))
            num_computed, num_present = len(request.prompt_token_ids) - 1, 1
        else:
            if not request.needs_every_prompt_position:
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
        return self._start_running(request, num_new, num_present)

    def _start_running(self, request: Request, num_new: int, num_present: int = 0) -> ScheduledRequest:
        """Move an admitted request (holding its pages) from waiting to running and schedule its chunk."""
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
        return source if source is not None and self._has_computed_prompt(source, request) else None

    def _waits_for_fork(self, request: Request) -> bool:
        """True while the sibling this request will fork from is alive but has not computed the prompt yet, or
        has it swapped out (admitting it now would compute the same prompt twice)."""
        source = self._sibling(request)
        return source is not None and not self._has_computed_prompt(source, request)

    def _has_computed_prompt(self, source: Request, request: Request) -> bool:
        """True when `source` holds the computed KV of `request`'s prompt on the device now (not swapped out)."""
        return (source.num_computed_tokens >= len(request.prompt_token_ids)
                and not self.kv.is_swapped(source.request_id))

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
            if item.spec_token_ids:
                # Proposals the target rejected sampled nothing, and their positions were not computed: their KV
                # slots are written again later. (Speculative steps are brought before the next is planned, so
                # the request is still running.)
                rejected = item.num_samples - len(samples)
                request.num_output_placeholders -= rejected
                if request.status is RequestStatus.RUNNING:
                    request.num_computed_tokens -= rejected
            if request.status is RequestStatus.RUNNING:  # pages full of KV whose token ids the host has
                self.kv.cache_full_pages(request.request_id, min(request.num_computed_tokens,
                                         request.num_known_tokens), request.token_ids, request.cache_salt)
            if not samples:
                continue
            if request.max_tokens == 0:  # the prompt ran (for its logprobs, or pooled); nothing is generated
                pooled = request.pooled is not None
                self._end(request, RequestStatus.FINISHED_STOPPED if pooled else RequestStatus.FINISHED_LENGTH_CAPPED)
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
        if request.constraint is not None and status is None:  # the sampler drew it from the constraint's mask
            if not request.constraint.accept(sample.token_id):
                request.error = f"token {sample.token_id} is outside the request's constraint"
                status = RequestStatus.FINISHED_ERROR
            elif request.constraint.is_finished:
                status = RequestStatus.FINISHED_STOPPED  # the output is complete
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
            page_ids=self.kv.page_tuple(request.request_id, num_pages),
            samples=request.num_computed_tokens + num_new == request.num_tokens,
            page_copies=tuple(self.kv.pop_copies(request.request_id)),
            num_present_tokens=num_present,
            sample_index=request.num_sampled_tokens,
        )

    def _grow_or_preempt(self, request: Request, num_new: int, plan: "_StepPlan") -> bool:
        """Allocate pages for `request`'s next `num_new` tokens, preempting victims until it fits; False when
        it had to preempt itself."""
        total = request.num_computed_tokens + num_new
        while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens, total):
            victim = self._pick_victim(request)
            self._preempt(victim, plan, by=request)
            if victim is request:
                return False
        return True

    def _pick_victim(self, request: Request) -> Request:
        """Whom `request` preempts for pages. FCFS: the most recently admitted running request. Priority: the
        least urgent (then latest) of itself and the running requests not protected by max_preemptions."""
        if self.config.policy == "priority":
            candidates = [r for r in self.running if r is request or not self._protected(r)]
            return max(candidates, key=_urgency)
        return self.running[-1]

    def _outranked_victim(self, request: Request) -> Request | None:
        """Priority policy: the least urgent running request that `request` outranks (lower priority value)
        and that is not protected by max_preemptions; None under FCFS, under static batching (members hold
        their reservation until the batch ends) or when there is none."""
        if self.config.policy != "priority" or self.config.static_batching:
            return None
        candidates = [r for r in self.running if r.priority > request.priority and not self._protected(r)]
        return max(candidates, key=_urgency, default=None)

    def _protected(self, request: Request) -> bool:
        """True for a request preempted max_preemptions times in a row by others (no starvation)."""
        return request.num_preemptions_in_a_row >= self.config.max_preemptions

    def _running_in_order(self) -> list[Request]:
        """FCFS: admission order; priority: the most urgent first, so it takes the budget first."""
        if self.config.policy == "priority":
            return sorted(self.running, key=_urgency)
        return list(self.running)

    def _waiting_in_order(self) -> list[Request]:
        """FCFS: queue order; priority: the lowest priority value, then the earliest arrival."""
        if self.config.policy == "priority":
            return sorted(self.waiting, key=_urgency)
        return list(self.waiting)

    def _preempt(self, victim: Request, plan: "_StepPlan", by: Request) -> None:
        """Preempt a running request for `by` (itself: it yields): take it out of this step's batch, swap its
        pages to the host pool (preemption_mode swap, or auto for a context longer than the step budget, while
        the host pool has room) or drop them to be recomputed, and re-queue it at the front."""
        plan.remove(victim, self.kv)
        self.running.remove(victim)
        copies = self.kv.swap_out(victim.request_id, victim.num_computed_tokens) if self._swaps(victim) else None
        if copies is None:
            self.kv.free(victim.request_id)
            victim.num_computed_tokens = 0
        else:
            plan.swap_out += copies
            self.num_swapped_out_requests += 1
        victim.status = RequestStatus.PREEMPTED
        if self.proposer is not None:
            self.proposer.release(victim.request_id)
        victim.num_preemptions += 1
        victim.num_preemptions_in_a_row = 0 if by is victim else victim.num_preemptions_in_a_row + 1
        self.num_preemptions += 1
        plan.preempted_ids.append(victim.request_id)
        self.waiting.insert(0, victim)

    def _swaps(self, victim: Request) -> bool:
        """Whether a victim's pages go to the host pool rather than being recomputed."""
        mode = self.config.preemption_mode
        return mode == "swap" or (mode == "auto" and victim.num_computed_tokens > self.config.max_num_batched_tokens)

    def _drop_swapped_device_pages(self, keep: Request) -> bool:
        """Make every swapped-out request but `keep` that holds device pages drop all its pages, to be
        recomputed; True when any did."""
        dropped = [r for r in self.waiting if r is not keep and self.kv.device_pages_kept(r.request_id)]
        for request in dropped:
            self.kv.free(request.request_id)
            request.num_computed_tokens = 0
        return bool(dropped)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.finished_time = time.monotonic()
        self.kv.free(request.request_id)
        if self.proposer is not None:
            self.proposer.release(request.request_id)
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


def _urgency(request: Request) -> tuple[int, float]:
    """Priority order: the lower priority value first, then the earlier arrival."""
    return request.priority, request.arrival_time


@dataclasses.dataclass
class _StepPlan:
    """One schedule() call's decision while it is made: the batch, the budget left, the preemptions and the
    page copies between the device and the host pool."""

    budget: int
    scheduled: list[ScheduledRequest] = dataclasses.field(default_factory=list)
    preempted_ids: list[str] = dataclasses.field(default_factory=list)
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (device page, host page)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (host page, device page)

    def add(self, item: ScheduledRequest) -> None:
        """Put a chunk in the batch, spending its tokens."""
        self.scheduled.append(item)
        self.budget -= item.num_new_tokens

    def remove(self, request: Request, kv: KVCacheManager) -> None:
        """Take a request that is being preempted out of the batch: its tokens return to the budget and its
        page copies to the cache manager (a swap-out reads them)."""
        entry = next((item for item in self.scheduled if item.request is request), None)
        if entry is not None:
            self.scheduled.remove(entry)
            self.budget += entry.num_new_tokens
            kv.restore_copies(request.request_id, list(entry.page_copies))


def _decodes_plainly(item: ScheduledRequest, steps: int) -> bool:
    """True for a one-token decode whose sampling reads nothing but its logits and seed (no penalties, bans,
    constraint over its next `steps` tokens, biases, allowed ids or logprobs), so several of its tokens can be
    sampled on the device in a row."""
    request, params = item.request, item.request.sampling_params
    return (item.samples and item.num_new_tokens == 1 and not request.needs_output_on_host
            and (request.constraint is None or request.constraint.is_free(item.sample_index + steps - 1))
            and item.sample_index >= params.min_tokens and not params.allowed_token_ids and not params.logit_bias
            and params.logprobs is None and not request.num_prompt_logprobs_missing
            and len(request.eos_token_ids) <= MAX_EOS_TOKEN_IDS)


def _can_propose(request: Request, num_proposals: int) -> bool:
    """True for a scheduled decode (one token to compute, sampled) that can verify proposals: the device draws
    the samples of the positions after its token knowing only the proposals (penalties, logit biases and
    allowed ids apply there, the proposals joining the penalty history; logprobs are those of each emitted
    token); not with bad words, a constraint over the tokens it may emit (its token and `num_proposals` more), or
    min_tokens still banning stop ids (whose bans at the next positions the host decides)."""
    params = request.sampling_params
    return (request.num_tokens - request.num_computed_tokens == 1
            and not request.num_output_placeholders and not request.bad_words_token_ids
            and (request.constraint is None or request.constraint.is_free(request.num_sampled_tokens + num_proposals))
            and request.num_sampled_tokens >= params.min_tokens and not request.num_prompt_logprobs_missing)
