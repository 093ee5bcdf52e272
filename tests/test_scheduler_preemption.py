"""Preemption by swap and priority that preempts, in the scheduler driven by the fake runner (no jax).

Scenarios with exact page counts: a swapped-out request resumes where it stopped (its KV checked slot
by slot by `fake_runner.FakeKV`), a full host pool falls back to recompute, `auto` swaps only contexts
longer than the step budget, shared pages stay on the device and never block the queue, an urgent
request gets the engine within a few steps, and `max_preemptions` bounds how often one is preempted.
"""

from __future__ import annotations

import pytest

from fake_runner import (
    FakeKV,
    RequestSpec,
    check_after_update,
    check_schedule,
    fake_step,
    make_scheduler,
    oracle_output,
    run_workload,
)
from jaxserve.request import RequestStatus


def _spec(request_id, prompt_len, max_tokens, **kwargs) -> RequestSpec:
    return RequestSpec(request_id=request_id, prompt_len=prompt_len, max_tokens=max_tokens, **kwargs)


class _Driver:
    """Steps a scheduler the way the engine does, checking every step, the KV contents included."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.kv = FakeKV(scheduler.kv.page_size)

    def step(self):
        output = self.scheduler.schedule()
        check_schedule(self.scheduler, output)
        self.kv.run(output)
        self.scheduler.update(output, fake_step(output))
        check_after_update(self.scheduler)
        return output

    def finish(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("the requests did not finish")


def _two_requests(mode: str, num_host_pages: int, budget: int = 32, a_prompt: int = 8):
    """A and B (8 prompt tokens), one page each in a two-page pool: the first of them to need a second page
    preempts B."""
    scheduler = make_scheduler(page_size=8, num_pages=3, max_num_seqs=4, max_num_batched_tokens=budget,
                               max_model_len=16, preemption_mode=mode, num_host_pages=num_host_pages)
    a, b = _spec("A", a_prompt, 4).build(16), _spec("B", 8, 4, arrival_time=1.0).build(16)
    scheduler.add_request(a)
    scheduler.add_request(b)
    driver = _Driver(scheduler)
    driver.step()
    return scheduler, driver, a, b


def test_a_swapped_out_request_resumes_where_it_stopped():
    scheduler, driver, a, b = _two_requests("swap", num_host_pages=4)
    output = driver.step()  # A needs a second page: B is swapped out, keeping its 9 computed tokens
    assert output.preempted_ids == ["B"]
    assert output.swap_out and len(output.swap_out) == 1
    assert b.status == RequestStatus.PREEMPTED and scheduler.kv.is_swapped("B")
    host_page = output.swap_out[0][1]
    assert b.num_computed_tokens == 8 and scheduler.kv.host_pages("B") == [host_page]
    assert scheduler.num_swapped_out_requests == 1
    resumed = None
    while resumed is None:
        output = driver.step()
        resumed = next((item for item in output.scheduled if item.request is b), None)
    # B comes back from the host pool and goes on decoding: nothing is recomputed.
    assert [host for host, _ in output.swap_in] == [host_page]
    assert resumed.num_computed_tokens == 8 and resumed.num_new_tokens == 1
    driver.finish()
    assert a.output_token_ids == oracle_output(_spec("A", 8, 4), 16)[0]
    assert b.output_token_ids == oracle_output(_spec("B", 8, 4), 16)[0]
    assert scheduler.num_swapped_out_pages == scheduler.num_swapped_in_pages == 1
    assert scheduler.kv.host_pool.num_free == scheduler.kv.host_pool.num_usable
    assert scheduler.kv.pool.num_free == scheduler.kv.pool.num_usable


def test_a_full_host_pool_falls_back_to_recompute():
    scheduler, driver, _, b = _two_requests("swap", num_host_pages=2)
    taken = scheduler.kv.host_pool.allocate(1)  # the host pool's one usable page is in use (by nobody we check)
    output = scheduler.schedule()
    assert output.preempted_ids == ["B"] and not output.swap_out
    assert not scheduler.kv.is_swapped("B") and b.num_computed_tokens == 0
    driver.kv.run(output)
    scheduler.update(output, fake_step(output))
    scheduler.kv.host_pool.release(taken)
    driver.finish()
    assert b.output_token_ids == oracle_output(_spec("B", 8, 4), 16)[0]
    assert scheduler.kv.host_pool.num_free == scheduler.kv.host_pool.num_usable


@pytest.mark.parametrize("budget, a_prompt, swapped", [(32, 8, False), (7, 4, True)])
def test_auto_swaps_only_contexts_longer_than_the_step_budget(budget, a_prompt, swapped):
    """B is preempted with its 8 prompt tokens computed: recomputed when they fit one step's budget (32),
    swapped when they do not (7)."""
    scheduler, driver, a, b = _two_requests("auto", num_host_pages=4, budget=budget, a_prompt=a_prompt)
    while not b.num_preemptions:
        computed = b.num_computed_tokens
        driver.step()
    assert computed == 8
    assert scheduler.kv.is_swapped("B") == swapped
    driver.finish()
    assert a.output_token_ids == oracle_output(_spec("A", a_prompt, 4), 16)[0]
    assert b.output_token_ids == oracle_output(_spec("B", 8, 4), 16)[0]


def test_swapped_requests_drop_their_shared_device_pages_when_they_block_everything():
    """S and T share page 1 (a fork) and are both swapped out, keeping it on the device; H, at the head of
    the queue, needs every page. With nothing running, S and T drop their pages (to be recomputed) and H
    runs; everyone finishes with the oracle's tokens and every page back."""
    scheduler = make_scheduler(page_size=8, num_pages=4, max_num_seqs=4, max_num_batched_tokens=32,
                               max_model_len=24, preemption_mode="swap", num_host_pages=8)
    kv = scheduler.kv
    specs = {"S": _spec("S", 8, 4), "T": _spec("T", 8, 4, arrival_time=1.0), "H": _spec("H", 20, 4)}
    requests = {name: spec.build(24) for name, spec in specs.items()}
    for name in ("H", "S", "T"):
        scheduler.add_request(requests[name])
    assert kv.allocate_slots("S", 0, 8)
    kv.fork("T", "S", 8)
    for name in ("S", "T"):  # as if both had computed the shared prompt page and were then swapped out
        requests[name].num_computed_tokens = 8
        requests[name].status = RequestStatus.PREEMPTED
        assert kv.swap_out(name, 8) == []  # the page is shared: it stays on the device, nothing is copied
    assert kv.device_pages_kept("S") == kv.device_pages_kept("T") == [1]
    driver = _Driver(scheduler)
    output = driver.step()
    assert [item.request.request_id for item in output.scheduled] == ["H"]
    assert not kv.is_swapped("S") and requests["S"].num_computed_tokens == 0
    driver.finish()
    for name, spec in specs.items():
        assert requests[name].output_token_ids == oracle_output(spec, 24)[0]
    assert kv.pool.num_free == kv.pool.num_usable and kv.host_pool.num_free == kv.host_pool.num_usable


# ---- priority that preempts ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("lag", [0, 1])
def test_an_urgent_request_gets_the_engine_within_a_few_steps(mode, lag):
    """Four low-priority requests fill the pool (and preempt one another as they grow); an urgent one arrives
    and preempts the least urgent of them at once: its first token comes within two steps (one without lag),
    every low-priority request still completes with the oracle's tokens, nobody is preempted more than
    max_preemptions in a row (checked every step by check_after_update)."""
    max_model_len = 64
    config = dict(page_size=8, num_pages=4 * 4 + 1, max_num_seqs=8, max_num_batched_tokens=128,
                  max_model_len=max_model_len, policy="priority", preemption_mode=mode, num_host_pages=64,
                  max_preemptions=2)
    low = [_spec(f"low{i}", 24, 24, priority=5, arrival_time=float(i)) for i in range(4)]  # 4 pages each at step 6
    urgent = _spec("urgent", 8, 6, priority=0, arrival_step=6, arrival_time=100.0)
    scheduler = make_scheduler(**config)
    result = run_workload(scheduler, low + [urgent], max_steps=400, lag=lag)
    assert result.num_preemptions >= 1
    waited = result.first_token_step["urgent"] - result.arrival_step["urgent"]
    assert waited <= lag, f"the urgent request waited {waited} steps for its first token"
    victim = max(low, key=lambda spec: spec.arrival_time)  # the least urgent: same priority, latest arrival
    assert result.requests[victim.request_id].num_preemptions >= 1
    for spec in low + [urgent]:
        request = result.requests[spec.request_id]
        assert request.output_token_ids == oracle_output(spec, max_model_len)[0]
    assert (scheduler.num_swapped_out_requests > 0) == (mode == "swap")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_max_preemptions_stops_an_urgent_stream_from_starving_a_request(mode):
    """A pool that holds one request at a time: a low-priority request is preempted by the first two urgent
    arrivals, then (max_preemptions=2) no more: the third urgent request waits for it to finish."""
    max_model_len = 32
    config = dict(page_size=8, num_pages=4 + 1, max_num_seqs=8, max_num_batched_tokens=64,
                  max_model_len=max_model_len, policy="priority", preemption_mode=mode, num_host_pages=64,
                  max_preemptions=2)
    low = _spec("low", 16, 16, priority=5)
    urgent = [_spec(f"urgent{i}", 24, 4, priority=0, arrival_step=3 + 12 * i, arrival_time=10.0 + i)
              for i in range(3)]
    scheduler = make_scheduler(**config)
    result = run_workload(scheduler, [low] + urgent, max_steps=400)
    request = result.requests["low"]
    assert request.num_preemptions == 2
    assert result.finish_step["low"] < result.first_token_step["urgent2"]
    for spec in [low] + urgent:
        assert result.requests[spec.request_id].output_token_ids == oracle_output(spec, max_model_len)[0]


def test_fcfs_never_preempts_for_a_waiting_request():
    """Under FCFS a waiting request does not preempt a running one, whatever their priorities."""
    config = dict(page_size=8, num_pages=4 + 1, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32)
    specs = [_spec("first", 16, 16, priority=5), _spec("second", 24, 4, priority=0, arrival_step=3, arrival_time=1.0)]
    result = run_workload(make_scheduler(**config), specs, max_steps=400)
    assert result.num_preemptions == 0
    assert result.finish_step["first"] < result.first_token_step["second"]


def test_a_request_does_not_preempt_one_of_equal_priority():
    config = dict(page_size=8, num_pages=4 + 1, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32,
                  policy="priority")
    specs = [_spec("first", 16, 16, priority=1), _spec("second", 24, 4, priority=1, arrival_step=3,
                                                         arrival_time=1.0)]
    result = run_workload(make_scheduler(**config), specs, max_steps=400)
    assert result.num_preemptions == 0
