"""Prometheus metrics with vLLM's names, so existing dashboards and the inference gateway work.

Gauges and token counters are read from the engine's counters at scrape time. On the engine
thread, each published batch of outputs observes the time between tokens, and each finished
request its end-to-end, first-token and queue latencies and `request_success_total`.
Every name starts with `<prefix>:` (`jaxserve:` by default, `vllm:` for drop-in dashboards) and
carries a `model_name` label.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.outputs import RequestOutput

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
FIRST_TOKEN_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
PER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)


class _EngineCollector:
    """Gauges and counters computed from the engine's counters when Prometheus scrapes."""

    def __init__(self, prefix: str, model_name: str, stats: Callable[[], dict]):
        self.prefix = prefix
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        stats = self.stats()
        usage = 1.0 - stats["kv_pages_free"] / stats["kv_pages_total"]
        gauges = {
            "num_requests_running": ("Requests in the running batch.", stats["num_requests_running"]),
            "num_requests_waiting": ("Requests waiting to be scheduled.", stats["num_requests_waiting"]),
            "num_requests_swapped": ("Requests swapped to host memory (swapping is not implemented).", 0),
            "kv_cache_usage_perc": ("Fraction of KV-cache pages in use (0 to 1).", usage),
            "gpu_cache_usage_perc": ("Fraction of KV-cache pages in use (0 to 1); vLLM's older name.", usage),
            "cpu_cache_usage_perc": ("Fraction of the host swap space in use (swapping is not implemented).", 0),
        }
        for name, (doc, value) in gauges.items():
            yield self._family(GaugeMetricFamily, name, doc, value)
        counters = {
            "num_preemptions": ("Preemptions by recompute.", stats["preemptions"]),
            "prompt_tokens": ("Prompt tokens of requests that produced their first token.", stats["prompt_tokens"]),
            "generation_tokens": ("Generated tokens.", stats["generation_tokens"]),
            "prefix_cache_queries": ("Tokens looked up in the prefix cache (prefix caching is not implemented).", 0),
            "prefix_cache_hits": ("Tokens found in the prefix cache (prefix caching is not implemented).", 0),
        }
        for name, (doc, value) in counters.items():
            yield self._family(CounterMetricFamily, name, doc, value)

    def _family(self, kind, name: str, doc: str, value: float):
        family = kind(f"{self.prefix}:{name}", doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family


class ServerMetrics:
    """The server's Prometheus registry."""

    def __init__(self, prefix: str, model_name: str, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(prefix, model_name, stats))
        self.model_name = model_name

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{prefix}:{name}", doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.request_success = Counter(
            f"{prefix}:request_success", "Finished samples, by finish reason.", ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS_S)
        self.first_token = histogram("time_to_first_token_seconds", "Arrival to the first token.", FIRST_TOKEN_BUCKETS_S)
        self.per_output_token = histogram(
            "time_per_output_token_seconds", "Time between consecutive output tokens of a request.",
            PER_TOKEN_BUCKETS_S,
        )
        self._last_output: dict[str, tuple[int, float]] = {}  # request id -> (tokens, time) of its last output
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS_S)

    def observe_outputs(self, outputs: list[RequestOutput], now: float | None = None) -> None:
        """Record one published batch of outputs: the time between tokens of every request that moved
        (each new token observes the gap since the request's previous output, shared among the tokens
        that arrived together), and the finished requests."""
        now = time.monotonic() if now is None else now
        for output in outputs:
            num_tokens = max(len(c.token_ids) for c in output.outputs)
            seen = self._last_output.pop(output.request_id, None)  # (tokens, time) at its previous output
            if seen is not None and num_tokens > seen[0]:
                gap = (now - seen[1]) / (num_tokens - seen[0])
                for _ in range(num_tokens - seen[0]):
                    self.per_output_token.observe(gap)
            if output.finished:
                self._observe_finished(output)
            elif num_tokens:
                self._last_output[output.request_id] = (num_tokens, now)

    def _observe_finished(self, output: RequestOutput) -> None:
        """Record a finished request (any finish reason)."""
        times = output.metrics
        for completion in output.outputs:
            self.request_success.labels(self.model_name, completion.finish_reason).inc()
        if times.finished_time is not None:
            self.e2e_latency.observe(times.finished_time - times.arrival_time)
        if times.first_scheduled_time is not None:
            self.queue_time.observe(times.first_scheduled_time - times.arrival_time)
        if times.first_token_time is not None:
            self.first_token.observe(times.first_token_time - times.arrival_time)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
