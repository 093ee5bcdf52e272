"""vLLM's metrics beyond the gauges: tokens per engine step, cache_config_info, and the per-request
size and phase histograms, with vLLM's names, labels and bucket boundaries."""

import time

import pytest
from conftest import API_KEY
from helpers import engine_stats, http_client
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.engine.step_timing import PHASES
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.server.metrics import ServerMetrics

AUTH = {"Authorization": f"Bearer {API_KEY}"}
# vLLM's boundaries, written out here so a change on our side shows up.
VLLM_ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
VLLM_N_BUCKETS = [1, 2, 5, 10, 20]
VLLM_PHASE_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                      240.0, 480.0, 960.0, 1920.0, 7680.0]
VLLM_INTER_TOKEN_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                            10.0, 20.0, 40.0, 80.0]
CACHE_CONFIG = {"block_size": "16", "num_gpu_blocks": "64", "cache_dtype": "float32"}


class Scrape:
    """One parsed /metrics text: plain samples by name, bucket counts by name and bound, label sets."""

    def __init__(self, text: str):
        self.values: dict[str, float] = {}
        self.buckets: dict[str, dict[float, float]] = {}  # histogram name -> {upper bound: cumulative count}
        self.labels: dict[str, list[dict[str, str]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.labels.setdefault(sample.name, []).append(sample.labels)
                if "le" in sample.labels:
                    bound = float(sample.labels["le"])
                    self.buckets.setdefault(sample.name.removesuffix("_bucket"), {})[bound] = sample.value
                elif "finished_reason" not in sample.labels:
                    self.values[sample.name] = sample.value

    def bounds(self, histogram: str) -> list[float]:
        """The finite bucket bounds of a histogram."""
        return sorted(b for b in self.buckets[histogram] if b != float("inf"))


def _scrape(url: str) -> Scrape:
    return Scrape(http_client.get(f"{url}/metrics").text)


def _wait_until_idle(url: str, timeout_s: float = 60) -> Scrape:
    """Poll /metrics until nothing runs or waits; fail on a timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        scrape = _scrape(url)
        if scrape.values["jaxserve:num_requests_running"] == 0 == scrape.values["jaxserve:num_requests_waiting"]:
            return scrape
        assert time.monotonic() < deadline, "the server did not go idle"
        time.sleep(0.05)


def _request(request_id: str, times: RequestMetrics, prompt_len: int, samples: list[list[int]],
              reason: str | None) -> RequestOutput:
    completions = [CompletionOutput(i, "x" * len(ids), ids, None, None, reason) for i, ids in enumerate(samples)]
    return RequestOutput(request_id, "p", list(range(prompt_len)), completions, reason is not None, times)


def _unit_metrics() -> ServerMetrics:
    stats = engine_stats(kv_pages_free=63, kv_pages_total=63)
    return ServerMetrics("vllm", "m", lambda: [stats], max_model_len=128, cache_config=CACHE_CONFIG)


def test_request_histograms_from_known_timestamps():
    metrics = _unit_metrics()
    times = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, finished_time=13.0,
                           max_tokens=8)
    metrics.observe_outputs([_request("r", times, 3, [[1], [4]], None)], now=11.0)
    metrics.observe_outputs([_request("r", times, 3, [[1, 2, 3], [4, 5]], "length")], now=13.0)
    scrape = Scrape(metrics.render().decode())
    v = scrape.values
    assert (v["vllm:request_prompt_tokens_count"], v["vllm:request_prompt_tokens_sum"]) == (1, 3)
    assert (v["vllm:request_generation_tokens_count"], v["vllm:request_generation_tokens_sum"]) == (1, 5)
    assert (v["vllm:request_params_n_count"], v["vllm:request_params_n_sum"]) == (1, 2)
    assert (v["vllm:request_params_max_tokens_count"], v["vllm:request_params_max_tokens_sum"]) == (1, 8)
    assert v["vllm:request_inference_time_seconds_sum"] == 2.5
    assert v["vllm:request_prefill_time_seconds_sum"] == 0.5
    assert v["vllm:request_decode_time_seconds_sum"] == 2.0
    # the longest sample went from 1 to 3 tokens in 2 s: two gaps of 1 s, in both per-token histograms
    assert (v["vllm:inter_token_latency_seconds_count"], v["vllm:inter_token_latency_seconds_sum"]) == (2, 2.0)
    assert v["vllm:time_per_output_token_seconds_sum"] == 2.0
    prompt_buckets = scrape.buckets["vllm:request_prompt_tokens"]
    assert (prompt_buckets[2.0], prompt_buckets[5.0]) == (0, 1)
    assert scrape.buckets["vllm:request_decode_time_seconds"][1.5] == 0
    assert scrape.buckets["vllm:request_decode_time_seconds"][2.0] == 1
    for name in ("request_prompt_tokens", "request_inference_time_seconds", "iteration_tokens_total"):
        assert scrape.labels[f"vllm:{name}_count"] == [{"model_name": "m"}]


def test_moves_without_outputs_observe_what_outputs_would():
    """A front end that builds a running request's output only when read (the engine-core process's) reports each
    step's move as (request id, tokens of its longest sample): the same gaps as outputs at the same times."""
    times = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, finished_time=13.0)
    by_outputs, by_moves = _unit_metrics(), _unit_metrics()
    final = _request("r", times, 3, [[1, 2, 3, 6], [4, 5]], "length")
    by_outputs.observe_outputs([_request("r", times, 3, [[1], [4]], None)], now=11.0)
    by_outputs.observe_outputs([_request("r", times, 3, [[1, 2], [4]], None)], now=11.5)
    by_outputs.observe_outputs([final], now=13.0)
    by_moves.observe_moves([("r", 1)], now=11.0)
    by_moves.observe_moves([("r", 2)], now=11.5)
    by_moves.observe_outputs([final], now=13.0)
    def measured(metrics: ServerMetrics) -> dict:  # (not the times the metrics were made)
        return {name: value for name, value in Scrape(metrics.render().decode()).values.items()
                if not name.endswith("_created")}

    values = measured(by_moves)
    assert values == measured(by_outputs)
    # one gap of 0.5 s, then two of 0.75 s: the longest sample went from 2 to 4 tokens in 1.5 s
    assert values["vllm:inter_token_latency_seconds_count"] == 3
    assert values["vllm:inter_token_latency_seconds_sum"] == 2.0


def test_bucket_boundaries_are_vllms():
    scrape = Scrape(_unit_metrics().render().decode())
    assert scrape.bounds("vllm:iteration_tokens_total") == VLLM_ITERATION_BUCKETS
    assert scrape.bounds("vllm:request_params_n") == VLLM_N_BUCKETS
    assert scrape.bounds("vllm:inter_token_latency_seconds") == VLLM_INTER_TOKEN_BUCKETS
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens"):
        assert scrape.bounds(f"vllm:{name}") == [1, 2, 5, 10, 20, 50, 100]  # 1-2-5 up to max_model_len=128
    for name in ("inference", "prefill", "decode"):
        assert scrape.bounds(f"vllm:request_{name}_time_seconds") == VLLM_PHASE_BUCKETS


def test_unreached_phases_and_unknown_max_tokens_are_not_observed():
    metrics = _unit_metrics()
    aborted_waiting = RequestMetrics(arrival_time=5.0, finished_time=6.0)  # aborted before it was scheduled
    aborted_prefill = RequestMetrics(arrival_time=5.0, first_scheduled_time=5.5, finished_time=6.5)
    metrics.observe_outputs([_request("a", aborted_waiting, 4, [[]], "abort"),
                             _request("b", aborted_prefill, 4, [[]], "abort")], now=7.0)
    v = Scrape(metrics.render().decode()).values
    assert v["vllm:e2e_request_latency_seconds_count"] == 2
    assert (v["vllm:request_inference_time_seconds_count"], v["vllm:request_inference_time_seconds_sum"]) == (1, 1.0)
    assert v["vllm:request_prefill_time_seconds_count"] == 0 == v["vllm:request_decode_time_seconds_count"]
    assert v["vllm:request_params_max_tokens_count"] == 0  # max_tokens None: nothing to observe
    assert (v["vllm:request_generation_tokens_count"], v["vllm:request_generation_tokens_sum"]) == (2, 0)
    assert v["vllm:request_prompt_tokens_sum"] == 8


def test_iteration_tokens_and_cache_config_info():
    metrics = _unit_metrics()
    counters = [{"prompt_tokens": 0, "generation_tokens": 0}, {"prompt_tokens": 6, "generation_tokens": 2},
                {"prompt_tokens": 6, "generation_tokens": 22}]
    metrics.observe_step(counters[0], counters[1])  # two prompts of 3 finished prefill, one token each
    metrics.observe_step(counters[1], counters[2])  # twenty decodes
    scrape = Scrape(metrics.render().decode())
    assert scrape.values["vllm:iteration_tokens_total_count"] == 2
    assert scrape.values["vllm:iteration_tokens_total_sum"] == 28
    buckets = scrape.buckets["vllm:iteration_tokens_total"]
    assert (buckets[1.0], buckets[8.0], buckets[16.0], buckets[32.0]) == (0, 1, 1, 2)
    assert scrape.values["vllm:cache_config_info"] == 1
    assert scrape.labels["vllm:cache_config_info"] == [{"model_name": "m", **CACHE_CONFIG}]


def test_server_metrics_move_by_what_one_request_implies(openai_server):
    url, engine = openai_server
    before = _wait_until_idle(url)
    steps_before = engine.stats()["steps"]  # the engine thread is blocked on its queue: nothing changes this
    max_tokens, n = 12, 2
    body = {"prompt": "def add(a, b):", "max_tokens": max_tokens, "n": n, "ignore_eos": True, "temperature": 0.8,
            "seed": 3}
    response = http_client.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == n * max_tokens
    after = _wait_until_idle(url)
    steps = engine.stats()["steps"] - steps_before

    def moved(name: str) -> float:
        return after.values[f"jaxserve:{name}"] - before.values.get(f"jaxserve:{name}", 0.0)

    prompt_len = usage["prompt_tokens"]
    assert (moved("request_prompt_tokens_count"), moved("request_prompt_tokens_sum")) == (1, prompt_len)
    assert (moved("request_generation_tokens_count"), moved("request_generation_tokens_sum")) == (1, n * max_tokens)
    assert (moved("request_params_n_count"), moved("request_params_n_sum")) == (1, n)
    assert (moved("request_params_max_tokens_count"), moved("request_params_max_tokens_sum")) == (1, max_tokens)
    # one observation per engine step (and, under asynchronous scheduling, one for the step that only brings the
    # last tokens); each sample's prompt once plus every generated token
    assert moved("iteration_tokens_total_count") == steps + engine.config.scheduler_config.async_scheduling
    assert steps >= max_tokens
    assert moved("iteration_tokens_total_sum") == moved("prompt_tokens_total") + moved("generation_tokens_total")
    assert moved("iteration_tokens_total_sum") == n * prompt_len + n * max_tokens
    assert moved("inter_token_latency_seconds_count") == moved("time_per_output_token_seconds_count") == max_tokens - 1
    assert moved("inter_token_latency_seconds_sum") == pytest.approx(moved("time_per_output_token_seconds_sum"))
    assert moved("inter_token_latency_seconds_sum") > 0
    phases = {name: moved(f"{name}_sum") for name in (
        "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds", "time_to_first_token_seconds", "e2e_request_latency_seconds")}
    for name in phases:
        assert moved(f"{name}_count") == 1
    assert phases["request_queue_time_seconds"] >= 0
    assert phases["request_prefill_time_seconds"] > 0 and phases["request_decode_time_seconds"] > 0
    assert phases["request_prefill_time_seconds"] + phases["request_decode_time_seconds"] == pytest.approx(
        phases["request_inference_time_seconds"], abs=1e-6)
    assert phases["request_queue_time_seconds"] + phases["request_inference_time_seconds"] == pytest.approx(
        phases["e2e_request_latency_seconds"], abs=1e-6)
    assert phases["request_queue_time_seconds"] + phases["request_prefill_time_seconds"] == pytest.approx(
        phases["time_to_first_token_seconds"], abs=1e-6)


def test_server_cache_config_info_and_buckets(openai_server):
    url, engine = openai_server
    scrape = _scrape(url)
    assert scrape.values["jaxserve:cache_config_info"] == 1
    assert scrape.labels["jaxserve:cache_config_info"] == [{
        "model_name": "tiny-stdlib-llama",
        "block_size": str(engine.config.cache_config.page_size),
        "cache_dtype": engine.core.runner.cache_dtype.name,
        "enable_prefix_caching": str(engine.config.cache_config.enable_prefix_caching),
        "gpu_memory_utilization": str(engine.config.cache_config.gpu_memory_utilization),
        "num_gpu_blocks": str(engine.core.num_pages),
        "num_gpu_blocks_override": str(engine.config.cache_config.num_pages),
        "swap_space": "0",  # preemption by recompute: no host pool
        "num_cpu_blocks": "0",
    }]
    assert engine.config.cache_config.page_size == 16 and engine.core.num_pages == 64  # the fixture's engine
    assert scrape.bounds("jaxserve:iteration_tokens_total") == VLLM_ITERATION_BUCKETS
    assert scrape.bounds("jaxserve:request_generation_tokens") == [1, 2, 5, 10, 20, 50, 100]  # max_model_len 128


def test_the_engines_host_time_by_phase_and_the_front_ends_cpu(openai_server):
    """/metrics carries the engine's host seconds by step phase and its steps (the step timing of stats(), as
    counters) and the CPU seconds of the front end's thread, which serving a request moves."""
    url, engine = openai_server
    before = _wait_until_idle(url)
    body = {"prompt": "def add(a, b):", "max_tokens": 8, "ignore_eos": True, "stream": True}
    response = http_client.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    after = _wait_until_idle(url)
    host = {sample.labels["phase"]: sample.value for family in text_string_to_metric_families(
        http_client.get(f"{url}/metrics").text) for sample in family.samples
        if sample.name == "jaxserve:engine_host_seconds_total"}
    timing = engine.stats()["timing"]
    assert set(host) == {*PHASES, "propose"}
    for phase, seconds in host.items():
        assert seconds == pytest.approx(timing[f"{phase}_ms"] * timing["steps"] / 1e3), phase
    assert host["schedule"] > 0 and host["build"] > 0 and host["output"] > 0
    assert after.values["jaxserve:engine_steps_total"] - before.values["jaxserve:engine_steps_total"] >= 8
    cpu_before, cpu_after = (scrape.values["jaxserve:front_end_cpu_seconds_total"] for scrape in (before, after))
    assert 0 < cpu_before < cpu_after
