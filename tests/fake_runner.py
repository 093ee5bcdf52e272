"""A pure-Python stand-in for the model runner, and an engine-like loop that checks the scheduler.

Nothing here imports jax. The fake "model" makes the token sampled at position `p` of request
`r` a fixed function of `(r, p)`, so a request's output does not depend on batching, chunking or
preemption: running it alone, in any workload, or after any number of recomputes must give the
same tokens. `oracle_output` applies the stop rules to those tokens directly, independent of the
scheduler.
"""

from __future__ import annotations

import dataclasses
import hashlib

from jaxserve.config import SchedulerSettings
from jaxserve.kv.cache_manager import KVCacheManager, pages_for_tokens
from jaxserve.kv.page_pool import NULL_PAGE, PagePool
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler
from jaxserve.step import SampledToken, SchedulerOutput

VOCAB = 1000


def fake_token(request_id: str, position: int) -> int:
    """The token the fake model produces for `request_id` at sequence position `position`."""
    digest = hashlib.blake2b(f"{request_id}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


def fake_step(output: SchedulerOutput) -> list[list[SampledToken]]:
    """One runner step: the tokens of every chunk that reaches the end of its request (one, or `num_steps` for a
    multi-step decode), at the positions after the chunk's last token; none for the other chunks. A chunk
    verifying proposals keeps those equal to the model's tokens, up to the first that is not, then the model's
    token after them."""
    return [_verified(item) if item.spec_token_ids else
            [SampledToken(fake_token(item.request.request_id, item.num_computed_tokens + item.num_new_tokens + step))
             for step in range(item.num_steps)] if item.samples else []
            for item in output.scheduled]


def _verified(item) -> list[SampledToken]:
    """The fake model's verification of a chunk's proposals (greedy: a proposal is kept when it is the model's
    token at its position)."""
    request_id, last = item.request.request_id, item.num_computed_tokens  # the request's own last token
    tokens = []
    for offset, proposal in enumerate(item.spec_token_ids, start=1):
        if proposal != fake_token(request_id, last + offset):
            break
        tokens.append(proposal)
    tokens.append(fake_token(request_id, last + len(tokens) + 1))
    return [SampledToken(token) for token in tokens]


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """Everything needed to build one request, so it can be built twice (workload and alone)."""

    request_id: str
    prompt_len: int
    max_tokens: int  # SamplingParams.max_tokens
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    priority: int = 0
    arrival_step: int = 0
    arrival_time: float = 0.0
    resolve_max_tokens: bool = True  # cap max_tokens at max_model_len - prompt_len, as the engine does
    abort_step: int | None = None  # steps after arrival at which the request is aborted
    abort_mid_step: bool = False  # abort between schedule() and update() rather than before schedule()

    def build(self, max_model_len: int) -> Request:
        params = SamplingParams(
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
        )
        max_tokens = self.max_tokens
        if self.resolve_max_tokens:
            max_tokens = min(max_tokens, max_model_len - self.prompt_len)
        return Request(
            request_id=self.request_id,
            prompt_token_ids=[(7 * i + len(self.request_id)) % VOCAB for i in range(self.prompt_len)],
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            seed=0,
            max_tokens=max_tokens,
            arrival_time=self.arrival_time,
            priority=self.priority,
        )


def oracle_output(spec: RequestSpec, max_model_len: int) -> tuple[list[int], str, int | None]:
    """The tokens, finish reason and stop_reason the stop rules give, computed without any scheduler."""
    max_tokens = min(spec.max_tokens, max_model_len - spec.prompt_len) if spec.resolve_max_tokens else spec.max_tokens
    out: list[int] = []
    while True:
        token = fake_token(spec.request_id, spec.prompt_len + len(out))
        out.append(token)
        if len(out) >= spec.min_tokens:
            if not spec.ignore_eos and token in spec.eos_token_ids:
                return out, "stop", None
            if token in spec.stop_token_ids:
                return out, "stop", token
        if len(out) >= max_tokens or spec.prompt_len + len(out) >= max_model_len:
            return out, "length", None


class FakeProposer:
    """A Proposer whose guesses come from `guess(request) -> token ids`; checks that it is asked only about
    requests one token behind, and remembers which requests were released."""

    def __init__(self, guess):
        self.guess = guess
        self.released: set[str] = set()

    def propose(self, requests: list[Request]) -> list[list[int]]:
        assert all(r.num_tokens - r.num_computed_tokens == 1 for r in requests), "asked about a non-decode"
        assert all(r.num_output_placeholders == 0 for r in requests), "asked before the last samples came"
        return [self.guess(request) for request in requests]

    def release(self, request_id: str) -> None:
        self.released.add(request_id)


def make_scheduler(
    *,
    page_size: int,
    num_pages: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    enable_chunked_prefill: bool = True,
    policy: str = "fcfs",
    static_batching: bool = False,
    num_scheduler_steps: int = 1,
    preemption_mode: str = "recompute",
    num_host_pages: int = 0,
    max_preemptions: int = 3,
    num_speculative_tokens: int = 0,
    proposer: FakeProposer | None = None,
) -> Scheduler:
    config = SchedulerSettings(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        policy=policy,
        static_batching=static_batching,
        num_scheduler_steps=num_scheduler_steps,
        preemption_mode=preemption_mode,
        max_preemptions=max_preemptions,
        num_speculative_tokens=num_speculative_tokens,
    )
    host_pool = PagePool(num_host_pages) if preemption_mode != "recompute" else None
    return Scheduler(config, KVCacheManager(PagePool(num_pages), page_size, host_pool=host_pool), proposer)


# ---- invariants ------------------------------------------------------------------------------


def _reserved(scheduler: Scheduler, request) -> bool:
    """True for a member of the current static batch (it holds its reservation from the batch's start)."""
    return scheduler.config.static_batching and any(member is request for member in scheduler.static_batch)


def check_pages(scheduler: Scheduler) -> None:
    """Running requests hold disjoint pages (ref count 1, never the null page); waiting ones hold none
    (static batching: but the current batch's members, which hold max_model_len of pages from the
    batch's start); the free count plus the held pages is every usable page."""
    kv, pool = scheduler.kv, scheduler.kv.pool
    held: list[int] = []
    reservation = pages_for_tokens(scheduler.config.max_model_len, kv.page_size)
    for request in scheduler.running:
        pages = kv.page_ids(request.request_id)
        assert pages, f"running request {request.request_id} holds no pages"
        if scheduler.config.static_batching:
            assert len(pages) == reservation and _reserved(scheduler, request)
        held.extend(pages)
    host_held: list[int] = []
    for request in scheduler.waiting:
        host_held.extend(kv.host_pages(request.request_id))
        if _reserved(scheduler, request):
            assert len(kv.page_ids(request.request_id)) == reservation
            held.extend(kv.page_ids(request.request_id))
        else:
            assert kv.page_ids(request.request_id) == [], f"waiting request {request.request_id} holds pages"
    assert NULL_PAGE not in held
    assert len(held) == len(set(held)), f"a page is held twice: {sorted(held)}"
    for page in held:
        assert 0 < page < pool.num_pages
        assert pool.ref_count(page) == 1, f"page {page} has ref count {pool.ref_count(page)}"
    assert pool.ref_count(NULL_PAGE) == 0
    assert pool.num_free + len(held) == pool.num_usable
    assert kv.num_requests == len(scheduler.running) + sum(_reserved(scheduler, r) for r in scheduler.waiting)
    assert 0.0 <= pool.usage() <= 1.0
    if kv.host_pool is not None:  # swapped-out requests hold disjoint host pages; the rest are free
        assert len(host_held) == len(set(host_held)) and NULL_PAGE not in host_held
        assert kv.host_pool.num_free + len(host_held) == kv.host_pool.num_usable
    else:
        assert not host_held


def check_schedule(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """What must hold for a schedule() decision, checked before the runner sees it."""
    config, kv = scheduler.config, scheduler.kv
    assert output.total_num_tokens <= config.max_num_batched_tokens
    assert len(output.scheduled) <= config.max_num_seqs
    assert len(scheduler.running) <= config.max_num_seqs
    ids = [item.request.request_id for item in output.scheduled]
    assert len(ids) == len(set(ids)), f"a request is scheduled twice: {ids}"
    assert not set(ids) & set(output.preempted_ids), (
        f"requests {sorted(set(ids) & set(output.preempted_ids))} are both in the batch and preempted"
    )
    seen_pages: set[int] = set()
    for item in output.scheduled:
        request = item.request
        assert item.num_new_tokens >= 1
        # schedule() counts the chunk (and a multi-step decode's extra iterations) as computed and its samples
        # as placeholders at once.
        assert request.num_computed_tokens == item.num_computed_tokens + item.num_positions
        assert request.num_computed_tokens + item.samples <= request.num_tokens
        if item.spec_token_ids:  # a decode verifying proposals, beside anything else
            assert item.samples and item.num_new_tokens == 1 + len(item.spec_token_ids)
            assert len(item.spec_token_ids) <= config.num_speculative_tokens
            assert item.sample_index + len(item.spec_token_ids) < request.max_tokens
            assert request.num_computed_tokens < config.max_model_len
        if item.num_steps > 1:
            assert item.samples and item.num_new_tokens == 1 and not output.preempted_ids
            assert item.sample_index + item.num_steps <= request.max_tokens
            assert request.num_computed_tokens < config.max_model_len
        assert request.status == RequestStatus.RUNNING
        assert request in scheduler.running
        assert NULL_PAGE not in item.page_ids
        assert len(item.page_ids) * kv.page_size >= request.num_computed_tokens, (
            f"{request.request_id}: {len(item.page_ids)} pages for {request.num_computed_tokens} tokens"
        )
        # A step sees only the pages its tokens reach. Static batching holds a reservation beyond them; a request
        # whose proposals were rejected may hold the pages of up to num_speculative_tokens more positions.
        held = kv.page_ids(request.request_id)
        if not config.static_batching:
            extra = config.num_speculative_tokens
            assert len(held) <= pages_for_tokens(request.num_computed_tokens + extra, kv.page_size), (
                f"{request.request_id} holds {len(held)} pages for {request.num_computed_tokens} tokens")
        held = held[: pages_for_tokens(request.num_computed_tokens, kv.page_size)]
        assert item.page_ids == tuple(held), (
            f"{request.request_id} is scheduled with pages {item.page_ids} but holds {kv.page_ids(request.request_id)}"
        )
        assert not seen_pages & set(item.page_ids), f"page(s) {seen_pages & set(item.page_ids)} in two batch rows"
        seen_pages.update(item.page_ids)
        if not config.enable_chunked_prefill:
            assert item.samples, "without chunked prefill every scheduled chunk runs to the end of its request"
    for request_id in output.preempted_ids:
        request = scheduler.requests[request_id]
        assert request.status == RequestStatus.PREEMPTED and request in scheduler.waiting
    check_pages(scheduler)


def check_after_update(scheduler: Scheduler) -> None:
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        if scheduler.kv.is_swapped(request.request_id):  # its computed tokens' KV waits in the host pool
            assert request.status == RequestStatus.PREEMPTED
            num_pages = scheduler.kv.num_swapped_pages(request.request_id)
            assert num_pages == pages_for_tokens(request.num_computed_tokens, scheduler.kv.page_size)
            continue
        assert request.num_computed_tokens == 0, (
            f"waiting request {request.request_id} has {request.num_computed_tokens} computed tokens but no pages"
        )
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING
        # Behind its tokens, unless it only waits for its last sample to come back (asynchronous).
        assert request.num_computed_tokens < request.num_tokens or request.num_output_placeholders > 0
        assert len(scheduler.kv.page_ids(request.request_id)) * scheduler.kv.page_size >= request.num_computed_tokens
    assert set(scheduler.requests) == {r.request_id for r in scheduler.waiting + scheduler.running}
    if scheduler.config.policy == "priority":  # nobody is preempted by others more than this in a row
        for request in scheduler.waiting + scheduler.running:
            assert request.num_preemptions_in_a_row <= scheduler.config.max_preemptions
    check_pages(scheduler)


class FakeKV:
    """What every device and host page slot holds: the (request id, position, token id) whose KV was written
    there (the token None when its id was still on the device, under asynchronous scheduling).

    `run(output)` makes a step's copies in the runner's order (swap-ins read the host pool, swap-outs
    copy device pages to it, swap-ins write the device, copy-on-write copies) after checking that every
    scheduled request's pages hold its computed positions, then writes the step's positions. A swap or
    copy that lost or misplaced KV fails here even though the fake model's tokens ignore the KV.
    """

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.device: dict[int, dict[int, tuple]] = {}  # page -> slot -> (request id, position, token id)
        self.host: dict[int, dict[int, tuple]] = {}

    def run(self, output: SchedulerOutput) -> None:
        incoming = [(device, dict(self.host.get(host, {}))) for host, device in output.swap_in]
        for device, host in output.swap_out:
            self.host[host] = dict(self.device.get(device, {}))
        for device, content in incoming:
            self.device[device] = content
        for source, copy in output.page_copies:
            self.device[copy] = dict(self.device.get(source, {}))
        size = self.page_size
        for item in output.scheduled:
            request = item.request
            request_id, known = request.request_id, request.num_known_tokens
            for position in range(item.num_computed_tokens):
                held = self.device.get(item.page_ids[position // size], {}).get(position % size)
                token = request.token_ids(position, position + 1)[0] if position < known else None
                assert held is not None and held[:2] == (request_id, position) and held[2] in (token, None), (
                    f"{request_id}: position {position} (token {token}) holds the KV of {held} when its step runs")
            first, proposed = item.num_computed_tokens, len(item.spec_token_ids)
            own = item.num_positions - proposed
            for offset in range(item.num_positions):
                position = first + offset
                if offset >= own:  # a proposal: its KV is of the proposed token
                    token = item.spec_token_ids[offset - own]
                else:
                    token = request.token_ids(position, position + 1)[0] if position < known else None
                self.device.setdefault(item.page_ids[position // size], {})[position % size] = (
                    request_id, position, token)


# ---- an engine-like loop -----------------------------------------------------------------------


@dataclasses.dataclass
class WorkloadResult:
    requests: dict[str, Request]
    arrival_step: dict[str, int]
    first_token_step: dict[str, int]  # the step whose update() brought the request's first token
    finish_step: dict[str, int]
    num_steps: int
    num_preemptions: int
    max_running: int


def run_workload(scheduler: Scheduler, specs: list[RequestSpec], max_steps: int, lag: int = 0) -> WorkloadResult:
    """Add requests at their arrival steps, abort some, step until nothing is left; check every step.

    `lag=1` is asynchronous scheduling: step N's samples reach update() after step N + 1 is scheduled
    (a scheduler with a proposer needs lag 0: the engine brings speculative steps before planning the next)."""
    max_model_len = scheduler.config.max_model_len
    by_step: dict[int, list[RequestSpec]] = {}
    for spec in specs:
        by_step.setdefault(spec.arrival_step, []).append(spec)
    last_arrival = max(by_step) if by_step else 0
    oracle = {spec.request_id: oracle_output(spec, max_model_len)[0] for spec in specs}
    requests: dict[str, Request] = {}
    arrival_step: dict[str, int] = {}
    finish_step: dict[str, int] = {}
    first_token_step: dict[str, int] = {}
    aborts_before: dict[int, list[str]] = {}
    aborts_mid: dict[int, list[str]] = {}
    preempted_seen = 0
    max_running = 0
    in_flight: list[tuple[SchedulerOutput, list[list[SampledToken]]]] = []  # scheduled, not yet updated
    kv_contents = FakeKV(scheduler.kv.page_size)

    step = 0
    while step <= last_arrival or scheduler.has_unfinished_requests():
        assert step < max_steps, f"no progress after {max_steps} steps: {len(scheduler.running)} running, " \
            f"{len(scheduler.waiting)} waiting"
        for spec in by_step.get(step, []):
            request = spec.build(max_model_len)
            requests[spec.request_id] = request
            arrival_step[spec.request_id] = step
            scheduler.add_request(request)
            if spec.abort_step is not None:
                target = aborts_mid if spec.abort_mid_step else aborts_before
                target.setdefault(step + spec.abort_step, []).append(spec.request_id)
        for request_id in aborts_before.get(step, []):
            scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        check_pages(scheduler)

        output = scheduler.schedule()
        check_schedule(scheduler, output)
        kv_contents.run(output)
        preempted_seen += len(output.preempted_ids)
        max_running = max(max_running, len(scheduler.running))
        in_flight.append((output, fake_step(output)))
        for request_id in aborts_mid.get(step, []):
            scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        while len(in_flight) > (lag if not output.is_empty else 0):
            scheduler.update(*in_flight.pop(0))
        check_after_update(scheduler)

        for request_id, request in requests.items():
            assert request.output_token_ids == oracle[request_id][: request.num_output_tokens], (
                f"{request_id} produced {request.output_token_ids}, expected a prefix of {oracle[request_id]}"
            )
            if request.num_output_tokens and request_id not in first_token_step:
                first_token_step[request_id] = step
            if request.is_finished and request_id not in finish_step:
                finish_step[request_id] = step
        step += 1

    assert scheduler.num_preemptions == preempted_seen
    assert scheduler.num_preemptions == sum(r.num_preemptions for r in requests.values())
    if scheduler.proposer is not None:
        assert scheduler.proposer.released == set(requests), "a finished request was not released"
    return WorkloadResult(requests, arrival_step, first_token_step, finish_step, step, scheduler.num_preemptions,
                          max_running)


def run_alone(spec: RequestSpec, config: SchedulerSettings, page_size: int) -> Request:
    """Run one request (never aborted) through a fresh scheduler whose pool holds it many times over."""
    num_pages = 4 * pages_for_tokens(config.max_model_len, page_size) + 1
    scheduler = Scheduler(config, KVCacheManager(PagePool(num_pages), page_size))
    alone = dataclasses.replace(spec, arrival_step=0, abort_step=None)
    result = run_workload(scheduler, [alone], max_steps=spec.prompt_len + spec.max_tokens + 2)
    assert result.num_preemptions == 0
    return result.requests[spec.request_id]
