"""Cancellation and /metrics: dropped streams give their pages back; the metrics parse and move."""

import asyncio
import json
import time

import httpx
from conftest import API_KEY
from helpers import engine_stats, http_client
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.server.metrics import ServerMetrics

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed by name (plus `{finished_reason}` where it has one)."""
    samples = {}
    for family in text_string_to_metric_families(http_client.get(f"{url}/metrics").text):
        for sample in family.samples:
            reason = sample.labels.get("finished_reason")
            samples[sample.name + (f"{{{reason}}}" if reason else "")] = sample.value
    return samples


def _wait_until_idle(url: str, timeout_s: float = 60) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and every KV page is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = _metrics(url)
        idle = (metrics["jaxserve:num_requests_running"] == 0 and metrics["jaxserve:num_requests_waiting"] == 0
                and metrics["jaxserve:kv_cache_usage_perc"] == 0.0)
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


async def _stream(client: httpx.AsyncClient, body: dict, drop_after: int | None) -> dict | None:
    """Stream a completion; leave after `drop_after` chunks (None: read to the end and return the usage)."""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        chunks, usage = 0, None
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return usage
            data = json.loads(line[len("data: "):])
            usage = data.get("usage") or usage
            chunks += 1
            if drop_after is not None and chunks == drop_after:
                return None  # leaving the block closes the connection mid-stream
    raise AssertionError("the stream ended without [DONE]")


def test_dropped_streams_return_their_pages_and_the_rest_complete(openai_server):
    url, _ = openai_server
    before = _wait_until_idle(url)
    max_tokens = 100

    async def run():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120,
                                     limits=httpx.Limits(max_connections=40)) as client:
            bodies = [{"prompt": f"def handler_{i}(request):", "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0.8, "seed": i} for i in range(32)]
            return await asyncio.gather(*(_stream(client, body, 4 if i % 2 else None) for i, body in enumerate(bodies)))

    usages = asyncio.run(run())
    kept = [u for i, u in enumerate(usages) if i % 2 == 0]
    assert all(u is not None and u["completion_tokens"] == max_tokens for u in kept)
    after = _wait_until_idle(url)
    assert after["jaxserve:kv_cache_usage_perc"] == 0.0 and after["jaxserve:num_requests_running"] == 0
    aborted = (after.get("jaxserve:request_success_total{abort}", 0)
               - before.get("jaxserve:request_success_total{abort}", 0))
    assert aborted == 16
    finished = after["jaxserve:request_success_total{length}"] - before.get("jaxserve:request_success_total{length}", 0)
    assert finished == 16
    generated = after["jaxserve:generation_tokens_total"] - before["jaxserve:generation_tokens_total"]
    assert 16 * max_tokens <= generated < 16 * max_tokens + 16 * max_tokens // 2  # the dropped ones stopped early


def test_metrics_parse_and_move_while_a_request_runs(openai_server):
    url, engine = openai_server
    before = _wait_until_idle(url)
    assert before["jaxserve:kv_cache_usage_perc"] == 0.0 == before["jaxserve:cpu_cache_usage_perc"]
    prompt = "class Parser:"
    body = {"prompt": prompt, "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    with http_client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=AUTH) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
        during = _metrics(url)
        for _ in lines:
            pass
    assert during["jaxserve:num_requests_running"] == 1
    assert 0.0 < during["jaxserve:kv_cache_usage_perc"] == during["jaxserve:gpu_cache_usage_perc"]
    after = _wait_until_idle(url)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved("jaxserve:generation_tokens_total") == 60
    assert moved("jaxserve:prompt_tokens_total") == len(engine.tokenizer.encode(prompt))
    assert moved("jaxserve:request_success_total{length}") == 1
    for histogram in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds"):
        assert moved(f"jaxserve:{histogram}_count") == 1
        assert moved(f"jaxserve:{histogram}_sum") >= 0
    assert moved("jaxserve:time_per_output_token_seconds_count") == 59  # every token after the first
    assert moved("jaxserve:time_per_output_token_seconds_sum") > 0
    for name in ("num_requests_swapped", "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total"):
        assert f"jaxserve:{name}" in after


def test_metric_names_follow_vllm_with_the_vllm_prefix():
    stats = engine_stats(num_requests_running=2, num_requests_waiting=1, kv_pages_free=30, kv_pages_total=40,
                         preemptions=3, prompt_tokens=50, generation_tokens=70, prefix_cache_queries=40,
                         prefix_cache_hits=16)
    metrics = ServerMetrics("vllm", "m", lambda: [stats], max_model_len=128, cache_config={"block_size": "16"})
    times = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, finished_time=13.0)

    def output(token_ids, reason=None):
        completion = CompletionOutput(0, "abc"[:len(token_ids)], token_ids, None, None, reason, None)
        return RequestOutput("r", "p", [5], [completion], reason is not None, times)

    metrics.observe_outputs([output([1])], now=11.0)  # first token: no gap yet
    metrics.observe_outputs([output([1, 2, 3], "stop")], now=13.0)  # two tokens 2 s later: 1 s each
    samples = {s.name: s for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert all(name.startswith("vllm:") for name in samples)
    assert samples["vllm:kv_cache_usage_perc"].value == 0.25 == samples["vllm:gpu_cache_usage_perc"].value
    assert samples["vllm:num_requests_running"].labels == {"model_name": "m", "replica": "0"}
    assert samples["vllm:num_preemptions_total"].value == 3
    assert (samples["vllm:prefix_cache_queries_total"].value == 40
            and samples["vllm:prefix_cache_hits_total"].value == 16)
    assert samples["vllm:request_success_total"].labels["finished_reason"] == "stop"
    assert samples["vllm:e2e_request_latency_seconds_sum"].value == 3.0
    assert samples["vllm:time_to_first_token_seconds_sum"].value == 1.0
    assert samples["vllm:request_queue_time_seconds_sum"].value == 0.5
    assert samples["vllm:time_per_output_token_seconds_sum"].value == 2.0
    assert samples["vllm:time_per_output_token_seconds_count"].value == 2
