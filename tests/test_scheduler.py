"""The scheduler driven by a fake runner in pure Python (no jax): invariants, fairness, outputs.

`fake_runner.fake_token(request_id, position)` is the "model": a request's tokens depend only on
the request and the position, so batching, chunking and preemption-by-recompute must never
change what a request outputs. `fake_runner.run_workload` checks the per-step invariants
(budget, max_num_seqs, page coverage and ownership, pool balance) on every step.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from fake_runner import (
    FakeProposer,
    RequestSpec,
    check_after_update,
    check_schedule,
    fake_step,
    fake_token,
    make_scheduler,
    oracle_output,
    run_alone,
    run_workload,
)
from jaxserve.kv.cache_manager import pages_for_tokens
from jaxserve.request import RequestStatus
from jaxserve.step import SampledToken

# ---- random workloads ----------------------------------------------------------------------


@st.composite
def workloads(draw, policy: str | None = None, chunked: bool | None = None):
    """A scheduler configuration plus a list of request specs in arrival order."""
    page_size = draw(st.sampled_from([8, 16]))
    num_requests = draw(st.integers(1, 8))
    prompt_lens = [draw(st.integers(1, 3 * page_size)) for _ in range(num_requests)]
    max_model_len = draw(st.integers(max(prompt_lens) + 1, max(prompt_lens) + 40))
    if chunked is None:
        chunked = draw(st.booleans())
    budget = draw(st.integers(8, 64))
    if not chunked:
        # Without chunking a (re)computed request must fit one step whole; the engine needs this too.
        budget = max(budget, max_model_len)
    one_request = pages_for_tokens(max_model_len, page_size)
    extra_pages = draw(st.one_of(st.integers(0, 2), st.integers(0, 2), st.integers(0, one_request * num_requests)))
    config = dict(
        page_size=page_size,
        num_pages=one_request + extra_pages + 1,
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        policy=draw(st.sampled_from(["fcfs", "priority"])) if policy is None else policy,
    )
    arrival_steps = sorted(draw(st.integers(0, 20)) for _ in range(num_requests))
    specs = []
    for index, (prompt_len, arrival_step) in enumerate(zip(prompt_lens, arrival_steps)):
        request_id = f"r{index}"
        max_tokens = draw(st.integers(1, 40))
        min_tokens = draw(st.one_of(st.just(0), st.integers(0, max_tokens)))
        # A stop token the fake model will actually produce, at output index `stop_at`.
        stop_at = draw(st.integers(0, max_tokens - 1))
        stop_token = fake_token(request_id, prompt_len + stop_at)
        stop_kind = draw(st.sampled_from(["none", "eos", "stop_token_ids"]))
        abort = draw(st.one_of(st.none(), st.none(), st.integers(0, 30)))
        specs.append(RequestSpec(
            request_id=request_id,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop_token_ids=(stop_token,) if stop_kind == "stop_token_ids" else (),
            eos_token_ids=(stop_token,) if stop_kind == "eos" else (),
            ignore_eos=draw(st.booleans()) if stop_kind == "eos" else False,
            priority=draw(st.integers(0, 3)),
            arrival_step=arrival_step,
            arrival_time=arrival_step + index * 1e-3,  # add order == arrival order
            resolve_max_tokens=draw(st.sampled_from([True, True, True, False])),
            abort_step=abort,
            abort_mid_step=draw(st.booleans()),
        ))
    return config, specs


def _work(spec: RequestSpec, max_model_len: int) -> int:
    """Upper bound on the steps a request keeps the oldest running slot: one token per step at worst."""
    return spec.prompt_len + min(spec.max_tokens, max_model_len - spec.prompt_len) + 1


def _check_workload(config: dict, specs: list[RequestSpec], lag: int = 0, propose=None) -> None:
    scheduler = make_scheduler(**config, proposer=FakeProposer(propose) if propose else None)
    max_model_len = config["max_model_len"]
    total_work = sum(_work(spec, max_model_len) for spec in specs)
    last_arrival = max(spec.arrival_step for spec in specs)
    # A generous global bound (any policy): the property test fails rather than hang.
    max_steps = last_arrival + (len(specs) + 1) * total_work + 10
    result = run_workload(scheduler, specs, max_steps=max_steps, lag=lag)
    event(f"preempted: {result.num_preemptions > 0}")
    if scheduler.kv.host_pool is not None:
        event(f"swapped: {scheduler.num_swapped_out_requests > 0}; "
              f"recomputed: {scheduler.num_swapped_out_requests < result.num_preemptions}")

    # Everything is given back.
    pool, host_pool = scheduler.kv.pool, scheduler.kv.host_pool
    assert pool.num_free == pool.num_usable
    assert host_pool is None or host_pool.num_free == host_pool.num_usable
    assert scheduler.kv.num_requests == 0
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running
    assert not scheduler.has_unfinished_requests()

    for index, spec in enumerate(specs):
        request = result.requests[spec.request_id]
        assert request.is_finished
        expected, reason, stop_reason = oracle_output(spec, max_model_len)
        if request.status == RequestStatus.FINISHED_ABORTED:
            assert spec.abort_step is not None
            assert request.output_token_ids == expected[: request.num_output_tokens]
            continue
        # Same tokens, finish reason and stop_reason as the scheduler-free oracle, and as running alone.
        assert request.output_token_ids == expected
        assert request.status.finish_reason == reason
        assert request.stop_reason == stop_reason
        assert request.num_output_tokens >= min(spec.min_tokens, request.max_tokens, max_model_len - spec.prompt_len)
        alone = run_alone(spec, scheduler.config, config["page_size"])
        assert alone.output_token_ids == request.output_token_ids
        assert alone.status == request.status
        if config["policy"] == "fcfs":
            # No starvation: under FCFS the oldest running request is never preempted and advances
            # every step, and nothing that arrived later gets ahead, so a request waits at most for
            # the work of those that arrived before it.
            # Asynchronous scheduling learns of each finish one step late.
            bound = sum(_work(other, max_model_len) + lag for other in specs[: index + 1])
            waited = result.finish_step[spec.request_id] - result.arrival_step[spec.request_id]
            assert waited <= bound, f"{spec.request_id} took {waited} steps, bound {bound}"


@settings(max_examples=400, deadline=None)
@given(workloads(policy="fcfs"))
def test_random_workloads_fcfs(workload):
    """Per-step invariants, full page return, no starvation, outputs equal to running alone (FCFS)."""
    _check_workload(*workload)


@settings(max_examples=400, deadline=None)
@given(workloads(policy="priority"))
def test_random_workloads_priority(workload):
    """The same properties under the priority policy."""
    _check_workload(*workload)


@settings(max_examples=200, deadline=None)
@given(workloads(), st.sampled_from(["fcfs", "priority"]), st.sampled_from([0, 1]), st.sampled_from([1, 4, 8]))
def test_random_workloads_asynchronous_and_multi_step(workload, policy, lag, steps):
    """Asynchronous scheduling (each step planned before the last one's samples are known) and multi-step
    decoding (several samples per decode row and step): the same invariants, page return and outputs,
    under both policies."""
    config, specs = workload
    _check_workload({**config, "policy": policy, "num_scheduler_steps": steps}, specs, lag=lag)


@settings(max_examples=300, deadline=None)
@given(workloads(), st.sampled_from(["swap", "auto"]), st.sampled_from([2, 4, 64]), st.sampled_from([0, 1]),
       st.sampled_from([1, 4]))
def test_random_workloads_preempting_by_swap(workload, mode, num_host_pages, lag, steps):
    """Preemption by swap (and auto: swap contexts longer than the budget), with host pools from one page to
    plenty (a full one falls back to recompute): the same invariants and outputs, every position's KV where
    its next step reads it (FakeKV), every device and host page given back, under both policies,
    asynchronous scheduling and multi-step decoding."""
    config, specs = workload
    _check_workload({**config, "preemption_mode": mode, "num_host_pages": num_host_pages,
                     "num_scheduler_steps": steps}, specs, lag=lag)


@settings(max_examples=300, deadline=None)
@given(workloads(), st.integers(1, 4), st.floats(0.0, 1.0), st.integers(0, 2**32 - 1),
       st.sampled_from(["recompute", "swap"]))
def test_random_workloads_with_speculative_proposals(workload, num_speculative, hit_rate, seed, mode):
    """Speculative decoding: in each step, every decoding request proposes up to `num_speculative` tokens,
    each the fake model's next token with probability `hit_rate` (else a wrong one); the step verifies them
    and a rejected proposal's position is computed again later. The same invariants and outputs, every
    position's KV that of the request's real token when a step reads it (FakeKV), every page back."""
    config, specs = workload
    rng = random.Random(seed)

    def propose(request):
        guesses = []
        for offset in range(rng.randint(0, num_speculative)):
            right = fake_token(request.request_id, request.num_tokens + offset)
            guesses.append(right if rng.random() < hit_rate else (right + 1) % 1000)
        return guesses

    _check_workload({**config, "num_speculative_tokens": num_speculative, "preemption_mode": mode,
                     "num_host_pages": 64}, specs, propose=propose)


@settings(max_examples=200, deadline=None)
@given(workloads())
def test_random_workloads_static_batching(workload):
    """Static batching (the benchmark baseline): the same invariants and outputs; running requests are
    always members of one batch holding max_model_len of pages (checked every step by check_pages)."""
    config, specs = workload
    _check_workload({**config, "static_batching": True}, specs)


def test_static_batching_admits_the_next_batch_only_when_the_last_has_finished():
    """Reservation limits the batch to what the pool holds at max_model_len each; a short request that
    finishes early does not let the next one in while its batch still runs."""
    config = dict(page_size=8, num_pages=2 * pages_for_tokens(32, 8) + 2, max_num_seqs=8,
                  max_num_batched_tokens=64, max_model_len=32, static_batching=True)
    specs = [_spec("short", 4, 1), _spec("long", 4, 20), _spec("next", 4, 1)]
    scheduler = make_scheduler(**config)
    for spec in specs:
        scheduler.add_request(spec.build(config["max_model_len"]))
    first = _step(scheduler)
    assert [row[0] for row in _rows(first)] == ["short", "long"]  # two reservations fit, not three
    while scheduler.requests.get("long") is not None:
        assert "next" not in [row[0] for row in _rows(_step(scheduler))]
    assert [row[0] for row in _rows(_step(scheduler))] == ["next"]
    assert scheduler.kv.pool.num_free == scheduler.kv.pool.num_usable


# ---- deterministic scenarios ---------------------------------------------------------------


def _spec(request_id, prompt_len, max_tokens, **kwargs) -> RequestSpec:
    return RequestSpec(request_id=request_id, prompt_len=prompt_len, max_tokens=max_tokens, **kwargs)


def _step(scheduler):
    """One checked engine step; returns the SchedulerOutput."""
    output = scheduler.schedule()
    check_schedule(scheduler, output)
    scheduler.update(output, fake_step(output))
    check_after_update(scheduler)
    return output


def _rows(output):
    return [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in output.scheduled]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("chunked", [True, False])
def test_tiny_pool_many_long_requests_preempts_and_still_matches(policy, chunked):
    """A pool that barely holds one max_model_len request and six long requests: preemption happens,
    every request finishes, outputs equal the oracle, all pages come back."""
    max_model_len = 48
    config = dict(
        page_size=8, num_pages=pages_for_tokens(max_model_len, 8) + 1, max_num_seqs=8,
        max_num_batched_tokens=64 if not chunked else 24, max_model_len=max_model_len,
        enable_chunked_prefill=chunked, policy=policy,
    )
    specs = [
        _spec(f"r{i}", prompt_len=20 + i, max_tokens=28 - i, priority=i % 3, arrival_time=float(i))
        for i in range(6)
    ]
    scheduler = make_scheduler(**config)
    result = run_workload(scheduler, specs, max_steps=2000)
    assert result.num_preemptions > 0
    assert scheduler.num_preemptions == result.num_preemptions
    assert sum(r.num_preemptions for r in result.requests.values()) == result.num_preemptions
    for spec in specs:
        expected, reason, _ = oracle_output(spec, max_model_len)
        assert result.requests[spec.request_id].output_token_ids == expected
        assert result.requests[spec.request_id].status.finish_reason == reason
    assert scheduler.kv.pool.num_free == scheduler.kv.pool.num_usable
    assert scheduler.kv.num_requests == 0


def test_fcfs_preempts_the_latest_admitted_and_recompute_keeps_outputs():
    """Two one-page requests in a two-page pool: when A grows, B (admitted last) is preempted once,
    re-queued at the front with nothing computed, and later recomputed to the same output."""
    scheduler = make_scheduler(page_size=8, num_pages=3, max_num_seqs=4, max_num_batched_tokens=32,
                               max_model_len=16)
    a, b = _spec("A", 8, 4).build(16), _spec("B", 8, 4, arrival_time=1.0).build(16)
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert _rows(_step(scheduler)) == [("A", 0, 8), ("B", 0, 8)]
    output = _step(scheduler)  # A needs a second page
    assert output.preempted_ids == ["B"]
    assert _rows(output) == [("A", 8, 1)]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_output_tokens == 1 and b.num_preemptions == 1
    assert scheduler.waiting == [b] and scheduler.num_preemptions == 1
    while scheduler.has_unfinished_requests():
        _step(scheduler)
    assert scheduler.num_preemptions == 1
    assert a.output_token_ids == oracle_output(_spec("A", 8, 4), 16)[0]
    assert b.output_token_ids == oracle_output(_spec("B", 8, 4), 16)[0]


def test_fcfs_request_that_cannot_grow_preempts_itself_last():
    """FCFS: the last admitted request is the victim, even when it is the one asking for a page."""
    scheduler = make_scheduler(page_size=8, num_pages=4, max_num_seqs=4, max_num_batched_tokens=32,
                               max_model_len=24)
    scheduler.add_request(_spec("A", 8, 8).build(24))
    scheduler.add_request(_spec("B", 8, 8, arrival_time=1.0).build(24))
    _step(scheduler)  # one page each, one free
    output = _step(scheduler)  # both need a second page: A takes the last one, B preempts itself
    assert output.preempted_ids == ["B"]
    assert _rows(output) == [("A", 8, 1)]


def test_waiting_requests_are_not_admitted_in_a_step_that_preempted():
    scheduler = make_scheduler(page_size=8, num_pages=4, max_num_seqs=4, max_num_batched_tokens=32,
                               max_model_len=24)
    scheduler.add_request(_spec("A", 8, 8).build(24))
    scheduler.add_request(_spec("B", 8, 8, arrival_time=1.0).build(24))
    _step(scheduler)
    scheduler.add_request(_spec("C", 1, 8, arrival_time=2.0).build(24))
    output = _step(scheduler)
    assert output.preempted_ids == ["B"]
    assert [s.request.request_id for s in output.scheduled] == ["A"]


# ---- priority ------------------------------------------------------------------------------


def test_priority_admits_lower_value_before_earlier_arrival():
    scheduler = make_scheduler(page_size=8, num_pages=20, max_num_seqs=1, max_num_batched_tokens=32,
                               max_model_len=32, policy="priority")
    scheduler.add_request(_spec("early", 4, 2, priority=1, arrival_time=0.0).build(32))
    scheduler.add_request(_spec("urgent", 4, 2, priority=0, arrival_time=1.0).build(32))
    scheduler.add_request(_spec("late-same", 4, 2, priority=1, arrival_time=2.0).build(32))
    order = []
    while scheduler.has_unfinished_requests():
        for item in _step(scheduler).scheduled:
            if item.request.request_id not in order:
                order.append(item.request.request_id)
    assert order == ["urgent", "early", "late-same"]  # ties go to the earlier arrival


def test_fcfs_ignores_priority():
    scheduler = make_scheduler(page_size=8, num_pages=20, max_num_seqs=1, max_num_batched_tokens=32,
                               max_model_len=32, policy="fcfs")
    scheduler.add_request(_spec("early", 4, 2, priority=1, arrival_time=0.0).build(32))
    scheduler.add_request(_spec("urgent", 4, 2, priority=0, arrival_time=1.0).build(32))
    assert [s.request.request_id for s in _step(scheduler).scheduled] == ["early"]


def test_priority_victim_is_the_highest_value_running_request():
    """Running [X (prio 0), V (prio 5), Y (prio 1)]: X needs a page and V, not the last-admitted Y,
    is preempted."""
    scheduler = make_scheduler(page_size=8, num_pages=4, max_num_seqs=4, max_num_batched_tokens=32,
                               max_model_len=32, policy="priority")
    x = _spec("X", 7, 10, priority=0, arrival_time=0.0).build(32)
    v = _spec("V", 2, 10, priority=5, arrival_time=1.0).build(32)
    y = _spec("Y", 2, 10, priority=1, arrival_time=2.0).build(32)
    scheduler.add_request(x)
    scheduler.add_request(v)
    _step(scheduler)
    scheduler.add_request(y)
    _step(scheduler)
    assert scheduler.running == [x, v, y]
    assert scheduler.kv.pool.num_free == 0
    output = _step(scheduler)  # X reaches 9 tokens: second page
    assert output.preempted_ids == ["V"]
    assert v.status == RequestStatus.PREEMPTED
    assert scheduler.running == [x, y]


def test_priority_victim_already_scheduled_in_this_step_is_not_left_in_the_batch():
    """BUG reproducer. Priority policy, running == [A (prio 5, admitted first), B (prio 0)], no free page.

    B needs a new page, so A (the highest value) is preempted, but A was already put in this step's
    batch. schedule() then returns A with its page ids *and* gives that same page to B: two batch
    rows share a page, A is both scheduled and in preempted_ids, and update() then advances A's
    num_computed_tokens and appends a token although A is waiting with no pages (its KV is lost).
    """
    scheduler = make_scheduler(page_size=8, num_pages=3, max_num_seqs=4, max_num_batched_tokens=32,
                               max_model_len=16, policy="priority")
    a = _spec("A", 1, 8, priority=5, arrival_time=0.0).build(16)
    b = _spec("B", 7, 8, priority=0, arrival_time=1.0).build(16)
    scheduler.add_request(a)
    _step(scheduler)  # A alone: page 1
    scheduler.add_request(b)
    _step(scheduler)  # A decodes, B admitted: page 2, pool empty
    _step(scheduler)  # A at 4 tokens, B at 9 tokens
    output = scheduler.schedule()  # B needs a second page; the victim is A
    assert output.preempted_ids == ["A"]
    ids = [s.request.request_id for s in output.scheduled]
    assert "A" not in ids, f"A is preempted but still scheduled with pages {output.scheduled[0].page_ids}"
    check_schedule(scheduler, output)


def test_priority_preempted_request_sampling_a_stop_token_does_not_crash_update():
    """BUG reproducer, same shape as above: when the preempted-but-scheduled A samples a stop token,
    update() calls self.running.remove(A) and raises ValueError (A is no longer running)."""
    scheduler = make_scheduler(page_size=8, num_pages=3, max_num_seqs=4, max_num_batched_tokens=32,
                               max_model_len=16, policy="priority")
    a = _spec("A", 1, 8, priority=5, arrival_time=0.0).build(16)
    b = _spec("B", 7, 8, priority=0, arrival_time=1.0).build(16)
    scheduler.add_request(a)
    _step(scheduler)
    scheduler.add_request(b)
    _step(scheduler)
    _step(scheduler)
    output = scheduler.schedule()
    sampled = [[SampledToken(0)] if s.samples else [] for s in output.scheduled]
    a.sampling_params.stop_token_ids.append(0)  # make A's next token (0) a stop token
    scheduler.update(output, sampled)  # must not raise
    assert a.is_finished or a.num_computed_tokens == 0


# ---- chunked prefill -----------------------------------------------------------------------


def test_long_prompt_is_split_across_steps_and_samples_only_at_the_end():
    scheduler = make_scheduler(page_size=8, num_pages=20, max_num_seqs=4, max_num_batched_tokens=16,
                               max_model_len=64)
    request = _spec("A", 40, 3).build(64)
    scheduler.add_request(request)
    outputs = [_step(scheduler) for _ in range(3)]
    assert [_rows(o) for o in outputs] == [[("A", 0, 16)], [("A", 16, 16)], [("A", 32, 8)]]
    assert [o.scheduled[0].page_ids for o in outputs] == [(1, 2), (1, 2, 3, 4), (1, 2, 3, 4, 5)]
    assert request.num_output_tokens == 1  # only the last chunk sampled
    assert _rows(_step(scheduler)) == [("A", 40, 1)]


def test_chunk_shares_the_budget_with_running_decodes():
    scheduler = make_scheduler(page_size=8, num_pages=20, max_num_seqs=4, max_num_batched_tokens=16,
                               max_model_len=64)
    scheduler.add_request(_spec("A", 4, 10).build(64))
    _step(scheduler)
    scheduler.add_request(_spec("B", 30, 3, arrival_time=1.0).build(64))
    assert _rows(_step(scheduler)) == [("A", 4, 1), ("B", 0, 15)]
    assert _rows(_step(scheduler)) == [("A", 5, 1), ("B", 15, 15)]


def test_a_decode_verifies_its_proposals_beside_a_prompt_chunk_with_the_budget_the_chunk_leaves():
    """Speculative decoding in a mixed step: the waiting prompt's chunk takes the budget before the running
    decode's proposals, which get what is left (none while the prompt fills the budget), and a row with nothing
    to propose (the prompt) shares the verifying step."""
    proposer = FakeProposer(lambda request: [fake_token(request.request_id, request.num_tokens + i) for i in range(3)])
    scheduler = make_scheduler(page_size=8, num_pages=20, max_num_seqs=4, max_num_batched_tokens=16,
                               max_model_len=64, num_speculative_tokens=3, proposer=proposer)
    scheduler.add_request(_spec("A", 4, 30).build(64))
    _step(scheduler)
    scheduler.add_request(_spec("B", 27, 3, arrival_time=1.0).build(64))
    output = _step(scheduler)
    assert _rows(output) == [("A", 4, 1), ("B", 0, 15)] and not output.scheduled[0].spec_token_ids  # squeezed out
    output = _step(scheduler)
    assert _rows(output) == [("A", 5, 4), ("B", 15, 12)]  # the chunk leaves 3 tokens: A's proposals
    assert output.scheduled[0].spec_token_ids and not output.scheduled[1].spec_token_ids
    assert scheduler.requests["A"].num_output_tokens == 2 + 4  # every proposal was right, and one more
    scheduler.add_request(_spec("C", 13, 3, arrival_time=2.0).build(64))
    output = _step(scheduler)
    assert _rows(output) == [("A", 9, 2), ("B", 27, 1), ("C", 0, 13)]  # 1 token left: for A, none for B
    assert len(output.scheduled[0].spec_token_ids) == 1 and not output.scheduled[1].spec_token_ids


def test_the_proposer_is_asked_only_for_the_decodes_the_budget_left_can_take():
    """Three decodes and a 10-token prompt leave 3 tokens of the 16: A alone is asked (its room is 3), so a draft
    model would not draft for B and C in a step that cannot verify their guesses."""
    asked = []

    def guess(request):
        asked.append(request.request_id)
        return [fake_token(request.request_id, request.num_tokens + i) for i in range(3)]

    scheduler = make_scheduler(page_size=8, num_pages=20, max_num_seqs=4, max_num_batched_tokens=16,
                               max_model_len=64, num_speculative_tokens=3, proposer=FakeProposer(guess))
    for request_id in "ABC":
        scheduler.add_request(_spec(request_id, 4, 20).build(64))
    _step(scheduler)
    asked.clear()
    scheduler.add_request(_spec("D", 10, 3, arrival_time=1.0).build(64))
    output = _step(scheduler)
    assert _rows(output) == [("A", 4, 4), ("B", 4, 1), ("C", 4, 1), ("D", 0, 10)]
    assert asked == ["A"]


def test_without_chunking_a_prompt_waits_until_it_fits_whole():
    scheduler = make_scheduler(page_size=8, num_pages=20, max_num_seqs=4, max_num_batched_tokens=16,
                               max_model_len=16, enable_chunked_prefill=False)
    scheduler.add_request(_spec("A", 4, 3).build(16))
    _step(scheduler)
    scheduler.add_request(_spec("B", 16, 1, arrival_time=1.0).build(16))
    scheduler.add_request(_spec("C", 1, 1, arrival_time=2.0).build(16))
    # A decodes 1 token; B needs 16 > 15 left, and FCFS keeps C behind it.
    assert _rows(_step(scheduler)) == [("A", 4, 1)]
    assert _rows(_step(scheduler)) == [("A", 5, 1)]  # A finishes (3 tokens)
    assert _rows(_step(scheduler)) == [("B", 0, 16)]
    assert _rows(_step(scheduler)) == [("C", 0, 1)]


def test_with_chunking_the_same_prompt_starts_at_once():
    scheduler = make_scheduler(page_size=8, num_pages=20, max_num_seqs=4, max_num_batched_tokens=16,
                               max_model_len=16, enable_chunked_prefill=True)
    scheduler.add_request(_spec("A", 4, 3).build(16))
    _step(scheduler)
    scheduler.add_request(_spec("B", 16, 1, arrival_time=1.0).build(16))
    assert _rows(_step(scheduler)) == [("A", 4, 1), ("B", 0, 15)]


@settings(max_examples=150, deadline=None)
@given(workloads(policy="fcfs", chunked=False))
def test_random_workloads_without_chunking(workload):
    """Without chunked prefill every scheduled chunk runs to the end of its request (checked each step).

    FCFS only: the priority test already draws both chunking modes."""
    _check_workload(*workload)


# ---- limits, stops, aborts -----------------------------------------------------------------


def test_max_num_seqs_caps_running_requests():
    scheduler = make_scheduler(page_size=8, num_pages=40, max_num_seqs=2, max_num_batched_tokens=64,
                               max_model_len=32)
    for i in range(5):
        scheduler.add_request(_spec(f"r{i}", 3, 4, arrival_time=float(i)).build(32))
    output = _step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["r0", "r1"]
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 3


def test_budget_limits_tokens_per_step():
    scheduler = make_scheduler(page_size=8, num_pages=40, max_num_seqs=8, max_num_batched_tokens=10,
                               max_model_len=32)
    for i in range(3):
        scheduler.add_request(_spec(f"r{i}", 6, 4, arrival_time=float(i)).build(32))
    assert _rows(_step(scheduler)) == [("r0", 0, 6), ("r1", 0, 4)]
    assert _rows(_step(scheduler)) == [("r0", 6, 1), ("r1", 4, 2), ("r2", 0, 6)]


def test_stop_token_ids_stop_with_stop_reason():
    spec = _spec("A", 5, 20, stop_token_ids=(fake_token("A", 5 + 2),))
    request = _run_one(spec, max_model_len=64)
    assert request.output_token_ids == [fake_token("A", 5 + i) for i in range(3)]
    assert request.status.finish_reason == "stop"
    assert request.stop_reason == fake_token("A", 7)


def test_eos_stops_without_stop_reason_unless_ignored():
    eos = fake_token("A", 5 + 1)
    request = _run_one(_spec("A", 5, 20, eos_token_ids=(eos,)), max_model_len=64)
    assert request.num_output_tokens == 2
    assert request.status.finish_reason == "stop" and request.stop_reason is None
    ignored = _run_one(_spec("A", 5, 20, eos_token_ids=(eos,), ignore_eos=True), max_model_len=64)
    assert ignored.num_output_tokens == 20 and ignored.status.finish_reason == "length"


def test_min_tokens_defers_stops():
    stop = fake_token("A", 5 + 1)
    spec = _spec("A", 5, 20, min_tokens=6, stop_token_ids=(stop,), eos_token_ids=(stop,))
    request = _run_one(spec, max_model_len=64)
    expected, reason, _ = oracle_output(spec, 64)
    assert request.output_token_ids == expected and request.status.finish_reason == reason
    assert request.num_output_tokens >= 6


def test_max_tokens_gives_length():
    request = _run_one(_spec("A", 5, 7), max_model_len=64)
    assert request.num_output_tokens == 7 and request.status.finish_reason == "length"


def test_max_model_len_caps_an_unresolved_max_tokens():
    request = _run_one(_spec("A", 10, 40, resolve_max_tokens=False), max_model_len=16)
    assert request.num_tokens == 16 and request.status.finish_reason == "length"


def _run_one(spec, max_model_len):
    scheduler = make_scheduler(page_size=8, num_pages=40, max_num_seqs=4, max_num_batched_tokens=32,
                               max_model_len=max_model_len)
    return run_workload(scheduler, [spec], max_steps=200).requests[spec.request_id]


def test_abort_between_schedule_and_update_returns_pages_and_drops_the_sample():
    scheduler = make_scheduler(page_size=8, num_pages=10, max_num_seqs=4, max_num_batched_tokens=32,
                               max_model_len=32)
    a, b = _spec("A", 9, 5).build(32), _spec("B", 3, 5, arrival_time=1.0).build(32)
    scheduler.add_request(a)
    scheduler.add_request(b)
    output = scheduler.schedule()
    sampled = fake_step(output)
    scheduler.finish_request("A", RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv.page_ids("A") == []
    changed = scheduler.update(output, sampled)
    assert changed == [b]
    assert a.status == RequestStatus.FINISHED_ABORTED and a.num_output_tokens == 0
    assert a.status.finish_reason == "abort"
    check_after_update(scheduler)
    assert scheduler.kv.pool.num_free == scheduler.kv.pool.num_usable - 1


def test_abort_of_waiting_and_preempted_requests():
    scheduler = make_scheduler(page_size=8, num_pages=3, max_num_seqs=4, max_num_batched_tokens=32,
                               max_model_len=16)
    scheduler.add_request(_spec("A", 8, 4).build(16))
    scheduler.add_request(_spec("B", 8, 4, arrival_time=1.0).build(16))
    scheduler.add_request(_spec("C", 8, 4, arrival_time=2.0).build(16))
    _step(scheduler)
    assert _step(scheduler).preempted_ids == ["B"]
    scheduler.finish_request("B", RequestStatus.FINISHED_ABORTED)  # preempted, waiting
    scheduler.finish_request("C", RequestStatus.FINISHED_ABORTED)  # never admitted
    scheduler.finish_request("C", RequestStatus.FINISHED_ABORTED)  # again: a no-op
    scheduler.finish_request("nope", RequestStatus.FINISHED_ABORTED)  # unknown: a no-op
    assert [r.request_id for r in scheduler.waiting] == []
    check_after_update(scheduler)
    while scheduler.has_unfinished_requests():
        _step(scheduler)
    assert scheduler.kv.pool.num_free == scheduler.kv.pool.num_usable


def test_duplicate_request_id_is_rejected_until_the_first_finishes():
    scheduler = make_scheduler(page_size=8, num_pages=10, max_num_seqs=4, max_num_batched_tokens=32,
                               max_model_len=32)
    scheduler.add_request(_spec("A", 3, 1).build(32))
    with pytest.raises(ValueError):
        scheduler.add_request(_spec("A", 3, 1).build(32))
    _step(scheduler)
    assert not scheduler.has_unfinished_requests()
    scheduler.add_request(_spec("A", 3, 1).build(32))  # the id is free again


def test_empty_schedule():
    scheduler = make_scheduler(page_size=8, num_pages=4, max_num_seqs=4, max_num_batched_tokens=32,
                               max_model_len=24)
    output = scheduler.schedule()
    assert output.is_empty and output.total_num_tokens == 0 and output.preempted_ids == []
    assert scheduler.update(output, []) == []


def test_scheduler_modules_do_not_import_jax():
    """The scheduler and its KV bookkeeping load without jax (the package __init__ is bypassed,
    since it imports the whole engine)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = textwrap.dedent(f"""
        import sys, types
        package = types.ModuleType("jaxserve")
        package.__path__ = [{os.path.join(root, "jaxserve")!r}]
        sys.modules["jaxserve"] = package
        import jaxserve.engine.scheduler, jaxserve.kv.page_pool, jaxserve.kv.cache_manager, jaxserve.request
        bad = sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib")))
        assert not bad, bad
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
