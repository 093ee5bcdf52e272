"""Preemption by swap and priority that preempts, on the real engine (issue 14).

Random workloads that overflow a small KV pool (so requests are preempted) run on engines that preempt by
recompute, by swap (to a host pool small enough to fill up, so some preemptions fall back to recompute)
and auto (swap contexts longer than the step budget); greedy and seeded outputs must be identical,
with prefix-cache hits and n > 1 samples sharing their prompt's pages, and every device and host page
must come back. Under the priority policy, an urgent request arriving while low-priority ones fill the
engine gets its first token within a few steps, and the low-priority ones still finish with the outputs
they have alone.

Engines have the shapes of test_async_and_multistep's (8 rows, token buckets 16 and 32, 31 usable pages of
16 tokens), so their executables come from the shared compilation cache.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from helpers import checkpoint, small_engine_args
from jaxserve import LLM, SamplingParams

ENGINE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=32, num_pages=32, skip_precompile=False)
PAGE_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # the llama fixture: 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 x fp32
HOST_PAGES = {"swap": 13, "auto": 200}  # swap: 12 usable pages, fewer than a preempting run wants
MODES = ("recompute", "swap", "auto")

_ids = itertools.count()


class Engines:
    """(preemption mode, policy, tensor-parallel size) -> LLM, built on first use."""

    def __init__(self):
        self._llms: dict[tuple[str, str, int], LLM] = {}

    def __call__(self, mode: str, policy: str = "fcfs", tp: int = 1) -> LLM:
        key = (mode, policy, tp)
        if key not in self._llms:
            swap_space = HOST_PAGES.get(mode, 1) * PAGE_BYTES / 2**30
            self._llms[key] = LLM(checkpoint("llama"), **small_engine_args(
                **ENGINE_ARGS, preemption_mode=mode, swap_space=swap_space, scheduling_policy=policy,
                tensor_parallel_size=tp))
            assert self._llms[key].engine.core.runner.page_bytes() == PAGE_BYTES
        return self._llms[key]


@pytest.fixture(scope="module")
def engines():
    return Engines()


def _run(llm: LLM, jobs: list[tuple[list[int], SamplingParams, int, int]]) -> tuple[dict, dict, int]:
    """Submit each (prompt, params, arrival step, priority) job at its step and step until all finish; returns
    ({job: [(token ids, finish reason) per sample]}, {job: steps from arrival to its first token}, the
    preemptions during the run). Checks that every page is back afterwards and that nothing compiled."""
    engine = llm.engine
    before = llm.stats()["preemptions"]
    compiles_before = llm.stats()["compilations_after_warmup"]  # the whole process's: checked over the run
    tag = next(_ids)
    outputs, first_token, arrived = {}, {}, {}
    step = 0
    while len(outputs) < len(jobs):
        for index, (prompt, params, arrive, priority) in enumerate(jobs):
            if arrive == step:
                engine.add_request(f"swap{tag}-{index}", prompt, params, priority=priority)
                arrived[index] = step
        for output in engine.step():
            index = int(output.request_id.rsplit("-", 1)[1])
            if any(c.token_ids for c in output.outputs):
                first_token.setdefault(index, step - arrived[index])
            if output.finished:
                outputs[index] = [(tuple(c.token_ids), c.finish_reason) for c in output.outputs]
        step += 1
        assert step < 3000, "the run does not end"
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"], "device pages still held after the run"
    assert stats["host_pages_free"] == stats["host_pages_total"], "host pages still held after the run"
    assert stats["num_requests_swapped"] == stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert stats["lazy_bucket_compilations"] == 0
    assert stats["compilations_after_warmup"] == compiles_before, "swap copies compiled after warm-up"
    return outputs, first_token, stats["preemptions"] - before


@st.composite
def preempting_workloads(draw):
    """5-9 requests of 50-180 tokens for a 31-page pool, some sharing a prompt prefix (prefix-cache hits),
    some with n > 1 seeded samples (forks share the prompt's pages), arriving over the first steps."""
    prefix = draw(st.lists(st.integers(4, 500), min_size=16, max_size=40))
    jobs = []
    for index in range(draw(st.integers(5, 9))):
        own = draw(st.lists(st.integers(4, 500), min_size=20, max_size=60))
        prompt = (prefix if draw(st.booleans()) else []) + own
        n = draw(st.sampled_from([1, 1, 2, 3]))
        params = SamplingParams(n=n, temperature=0.0 if n == 1 else 1.0, seed=index, ignore_eos=True,
                                max_tokens=draw(st.integers(30, 80)))
        jobs.append((prompt, params, draw(st.sampled_from([0, 0, 0, 1, 3, 6])), 0))
    return jobs


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(jobs=preempting_workloads())
def test_swap_auto_and_recompute_give_identical_outputs(engines, jobs):
    want, _, preemptions = _run(engines("recompute"), jobs)
    event(f"preempted: {preemptions > 0}")
    for mode in ("swap", "auto"):
        got, _, _ = _run(engines(mode), jobs)
        assert got == want, f"{mode} changed the outputs"


def _heavy_jobs() -> list[tuple[list[int], SamplingParams, int, int]]:
    """Ten requests of ~100 tokens (6-8 pages each), eight at a time, for 31 pages: preempted for sure."""
    jobs = []
    for index in range(10):
        prompt = [4 + (37 * index + 11 * i) % 500 for i in range(40 + 3 * index)]
        n = 2 if index == 4 else 1
        jobs.append((prompt, SamplingParams(n=n, temperature=0.0 if n == 1 else 0.9, seed=index, max_tokens=60,
                                            ignore_eos=True), 0, 0))
    return jobs


def test_a_preempting_workload_swaps_and_falls_back_when_the_host_pool_is_full(engines):
    want, _, preemptions = _run(engines("recompute"), _heavy_jobs())
    assert preemptions > 0
    for mode in ("swap", "auto"):
        llm = engines(mode)
        before = llm.stats()
        got, _, mode_preemptions = _run(llm, _heavy_jobs())
        after = llm.stats()
        assert got == want, f"{mode} changed the outputs"
        swapped = after["swapped_out_requests"] - before["swapped_out_requests"]
        assert swapped > 0, f"{mode} swapped nothing"
        assert after["swapped_in_pages"] - before["swapped_in_pages"] == \
            after["swapped_out_pages"] - before["swapped_out_pages"] > 0
        if mode == "swap":  # 12 host pages: some victims do not fit and are recomputed
            assert swapped < mode_preemptions


def test_each_device_swaps_its_own_kv_head_shard_under_tensor_parallelism(engines):
    """TP 2 (the fixture's 2 KV heads split over 2 simulated devices): the swap copies keep the head sharding
    and the outputs are those of the one-device engine that recomputes."""
    want, _, _ = _run(engines("recompute"), _heavy_jobs())
    llm = engines("swap", tp=2)
    runner = llm.engine.core.runner
    assert runner.kv_caches[0].addressable_shards[0].data.shape[3] == 1  # one KV head per device
    got, _, _ = _run(llm, _heavy_jobs())
    assert got == want
    assert llm.stats()["swapped_out_requests"] > 0


def test_an_urgent_request_preempts_low_priority_ones_and_everyone_finishes(engines):
    """Eight low-priority requests fill the engine; an urgent one arrives at step 8: its first token comes
    within a few steps, and every low-priority request finishes with the tokens the unhurried run gives."""
    low = [(prompt, params, 0, 5) for prompt, params, _, _ in _heavy_jobs()[:8]]
    urgent = ([7, 8, 9, 10] * 5, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), 8, 0)
    want, _, _ = _run(engines("swap"), low)
    llm = engines("swap", "priority")
    before = llm.stats()["swapped_out_requests"]
    got, first_token, preemptions = _run(llm, low + [urgent])
    assert preemptions > 0
    assert first_token[len(low)] <= 3, f"the urgent request waited {first_token[len(low)]} steps"
    assert [got[i] for i in range(len(low))] == [want[i] for i in range(len(low))]
    assert llm.stats()["swapped_out_requests"] > before
    by_priority = llm.stats()["num_requests_by_priority"]
    assert by_priority == {}, "nothing is queued after the run"


def test_swap_space_must_hold_a_page():
    with pytest.raises(ValueError, match="swap_space"):
        LLM(checkpoint("llama"), **small_engine_args(**ENGINE_ARGS, preemption_mode="swap",
                                                     swap_space=PAGE_BYTES / 2**30))
    with pytest.raises(ValueError, match="swap_space"):
        LLM(checkpoint("llama"), **small_engine_args(**ENGINE_ARGS, preemption_mode="swap", swap_space=-1))
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(checkpoint("llama"), **small_engine_args(**ENGINE_ARGS, preemption_mode="disk"))


def test_metrics_show_swapped_requests_and_host_pool_usage(engines):
    """Mid-run, with requests swapped out, /metrics' gauges follow stats(); the counters count the copies."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from jaxserve.engine.served_model import ServedModel
    from jaxserve.server.metrics import ServerMetrics, cache_config_info

    llm = engines("swap")
    engine = llm.engine
    kv_cache = ServedModel.of(engine).kv_cache
    metrics = ServerMetrics("jaxserve", "llama", lambda: [llm.stats()], 128, cache_config_info(kv_cache))
    for index, (prompt, params, _, _) in enumerate(_heavy_jobs()):
        engine.add_request(f"metrics-{index}", prompt, params)
    for _ in range(500):
        engine.step()
        stats = llm.stats()
        if stats["num_requests_swapped"]:
            break
    assert stats["num_requests_swapped"] > 0 and stats["cpu_cache_usage_perc"] > 0
    values = {sample.name: sample.value for family in text_string_to_metric_families(
        generate_latest(metrics.registry).decode()) for sample in family.samples}
    assert values["jaxserve:num_requests_swapped"] == stats["num_requests_swapped"]
    assert values["jaxserve:cpu_cache_usage_perc"] == pytest.approx(stats["cpu_cache_usage_perc"])
    assert values["jaxserve:swapped_out_pages_total"] == stats["swapped_out_pages"] > 0
    assert values["jaxserve:num_swapped_out_requests_total"] == stats["swapped_out_requests"]
    labels = next(family.samples[0].labels for family in text_string_to_metric_families(
        generate_latest(metrics.registry).decode()) if family.name == "jaxserve:cache_config_info")
    assert labels["num_cpu_blocks"] == str(HOST_PAGES["swap"])
    while engine.has_unfinished_requests():
        engine.step()
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["host_pages_free"] == stats["host_pages_total"]
