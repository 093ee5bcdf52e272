"""Prometheus metrics with vLLM's names, so existing dashboards and the inference gateway work.

Gauges and token counters are read from the engine's counters at scrape time; `cache_config_info`
is set once. On the engine thread, each engine step observes its tokens (`iteration_tokens_total`),
each published batch of outputs the time between tokens, and each finished request its latencies
(end-to-end, first token, queue, inference, prefill, decode), its sizes (prompt and generated
tokens, `n`, `max_tokens`) and `request_success_total`. The new histograms use vLLM's buckets.
Every name starts with `<prefix>:` (`jaxserve:` by default, `vllm:` for drop-in dashboards) and
carries a `model_name` label.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.engine.served_model import KVCacheFacts
from jaxserve.engine.step_timing import PHASES
from jaxserve.outputs import PoolingRequestOutput, RequestOutput

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
FIRST_TOKEN_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
PER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
# vLLM's boundaries (vllm/v1/metrics/loggers.py) for the histograms it defines and we added later.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
INTER_TOKEN_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
REQUEST_PHASE_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_count_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_model_len`: vLLM's buckets for per-request token counts."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


def cache_config_info(kv_cache: KVCacheFacts) -> dict[str, str]:
    """The engine's KV-cache configuration as `cache_config_info` labels, under vLLM's CacheConfig names
    (a block is a page; `num_gpu_blocks` counts the null page, as vLLM's counts its null block)."""
    return {
        "block_size": str(kv_cache.page_size),
        "cache_dtype": kv_cache.cache_dtype,
        "enable_prefix_caching": str(kv_cache.enable_prefix_caching),
        "gpu_memory_utilization": str(kv_cache.gpu_memory_utilization),
        "num_gpu_blocks": str(kv_cache.num_pages),
        "num_gpu_blocks_override": str(kv_cache.num_pages_override),
        # GiB of host swap space and its pages (page 0 included), allocated only when preemption swaps
        "swap_space": str(kv_cache.swap_space),
        "num_cpu_blocks": str(kv_cache.num_host_pages),
    }


class RecentSamples:
    """The values observed in the last `window_s` seconds (the newest `max_samples` at most): a live view's
    percentiles, where a Prometheus histogram gives the whole run's, in buckets."""

    def __init__(self, window_s: float = 60.0, max_samples: int = 20000):
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_samples)  # (time, value)

    def add(self, value: float, now: float) -> None:
        """Note `value`, observed at monotonic time `now` (any thread)."""
        self._samples.append((now, value))

    def percentiles(self, quantiles: tuple[int, ...] = (50, 90, 99), now: float | None = None) -> dict:
        """{"count": samples in the window, "p50": ..., ...} (nearest rank; None without samples)."""
        since = (time.monotonic() if now is None else now) - self.window_s
        values = sorted(value for at, value in self._samples.copy() if at >= since)
        ranks = {f"p{q}": values[min(len(values) - 1, len(values) * q // 100)] if values else None for q in quantiles}
        return {"count": len(values), **ranks}


class _EngineCollector:
    """Gauges and counters computed from each replica's engine counters when Prometheus scrapes, labelled with
    the replica (`data_parallel_size`; "0" for the one engine of a server without replicas)."""

    def __init__(self, prefix: str, model_name: str, replica_stats: Callable[[], list[dict]]):
        self.prefix = prefix
        self.model_name = model_name
        self.replica_stats = replica_stats

    def collect(self):
        families: dict[str, object] = {}
        for replica, stats in enumerate(self.replica_stats()):
            for kind, name, doc, labels, value in self._samples(stats):
                if replica and name == "front_end_cpu_seconds":  # one front end for every replica
                    continue
                if name not in families:
                    families[name] = kind(f"{self.prefix}:{name}", doc, labels=["model_name", "replica", *labels])
                families[name].add_metric([self.model_name, str(replica), *labels.values()], value)
        yield from families.values()

    def _samples(self, stats: dict):
        """(family kind, name, doc, extra labels, value) of one replica's counters."""
        usage = 1.0 - stats["kv_pages_free"] / stats["kv_pages_total"]
        gauges = {
            "num_requests_running": ("Requests in the running batch.", stats["num_requests_running"]),
            "num_requests_waiting": ("Requests waiting to be scheduled.", stats["num_requests_waiting"]),
            "num_requests_swapped": ("Preempted requests whose KV pages wait in host memory.",
                                     stats["num_requests_swapped"]),
            "kv_cache_usage_perc": ("Fraction of KV-cache pages in use (0 to 1).", usage),
            "gpu_cache_usage_perc": ("Fraction of KV-cache pages in use (0 to 1); vLLM's older name.", usage),
            "cpu_cache_usage_perc": ("Fraction of the host swap space's pages in use (0 to 1).",
                                     stats["cpu_cache_usage_perc"]),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily, name, doc, {}, value
        counters = {
            "num_preemptions": ("Preemptions (by recompute or by swap).", stats["preemptions"]),
            "num_swapped_out_requests": ("Preemptions by swap to host memory.", stats["swapped_out_requests"]),
            "swapped_out_pages": ("KV pages copied to host memory.", stats["swapped_out_pages"]),
            "swapped_in_pages": ("KV pages copied back from host memory.", stats["swapped_in_pages"]),
            "prompt_tokens": ("Prompt tokens of requests that produced their first token.", stats["prompt_tokens"]),
            "generation_tokens": ("Generated tokens.", stats["generation_tokens"]),
            "prefix_cache_queries": ("Tokens of admitted requests looked up in the prefix cache.",
                                     stats["prefix_cache_queries"]),
            "prefix_cache_hits": ("Tokens of admitted requests found in the prefix cache.", stats["prefix_cache_hits"]),
        }
        spec = stats["spec_decode"]
        counters.update({
            "spec_decode_num_drafts": ("Speculative verifications (a request's proposals checked in one step).",
                                       spec["num_drafts"]),
            "spec_decode_num_draft_tokens": ("Proposed tokens verified.", spec["num_draft_tokens"]),
            "spec_decode_num_accepted_tokens": ("Proposed tokens accepted.", spec["num_accepted_tokens"]),
        })
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily, name, doc, {}, value
        yield from _host_time_samples(stats)
        for position, count in enumerate(spec["accepted_per_position"]):
            yield (CounterMetricFamily, "spec_decode_num_accepted_tokens_per_pos",
                   "Proposed tokens accepted, by their position among a step's proposals.", {"position": str(position)},
                   count)
        lora = stats.get("lora")
        if lora is not None:  # vLLM's info gauge: the adapters in use in its labels, the time as its value
            labels = {"max_lora": str(lora["max_loras"]), "waiting_lora_adapters": ",".join(lora["waiting"]),
                      "running_lora_adapters": ",".join(lora["running"])}
            yield (GaugeMetricFamily, "lora_requests_info", "LoRA adapters of the running and waiting requests.",
                   labels, time.time())


def _host_time_samples(stats: dict):
    """The engine's host time by step phase (EngineCore's step timing: schedule, build, update, ...) and its steps,
    as counters; a dashboard divides their rates for the host milliseconds per step. The front end's CPU seconds
    (the event loop's thread), whose rate over generation_tokens' is its CPU per streamed token, come with the
    first replica only: the replicas share one front end."""
    timing = stats["timing"]
    yield CounterMetricFamily, "engine_steps", "Engine steps that dispatched device work.", {}, timing["steps"]
    for phase in (*PHASES, "propose"):
        yield (CounterMetricFamily, "engine_host_seconds", "Host seconds of the engine's steps, by phase.",
               {"phase": phase}, timing[f"{phase}_ms"] * timing["steps"] / 1e3)
    if "front_end_cpu_s" in stats:
        yield (CounterMetricFamily, "front_end_cpu_seconds",
               "CPU seconds of the front end's thread (HTTP, chat templates, tokenizing, SSE).", {},
               stats["front_end_cpu_s"])


class ServerMetrics:
    """The server's Prometheus registry.

    `replica_stats()` gives each replica's engine counters (EngineCore.stats), the gauges' and counters' source;
    the histograms describe the requests of every replica together. `max_model_len` sets the buckets of the token-count
    histograms; `cache_config` (see `cache_config_info`) labels the constant `cache_config_info` gauge.
    """

    def __init__(self, prefix: str, model_name: str, replica_stats: Callable[[], list[dict]], max_model_len: int,
                 cache_config: dict[str, str]):
        self.registry = CollectorRegistry()
        self._engine = _EngineCollector(prefix, model_name, replica_stats)
        self.registry.register(self._engine)
        self.model_name = model_name

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{prefix}:{name}", doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.request_success = Counter(
            f"{prefix}:request_success", "Finished samples, by finish reason.", ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS_S)
        self.first_token = histogram(
            "time_to_first_token_seconds", "Arrival to the first token.", FIRST_TOKEN_BUCKETS_S,
        )
        self.per_output_token = histogram(
            "time_per_output_token_seconds", "Time between consecutive output tokens of a request.",
            PER_TOKEN_BUCKETS_S,
        )
        self.inter_token = histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens of a request (vLLM V1's name).",
            INTER_TOKEN_BUCKETS_S,
        )
        self._last_output: dict[str, tuple[int, float]] = {}  # request id -> (tokens, time) at its last move
        self.recent_first_token, self.recent_inter_token = RecentSamples(), RecentSamples()  # the live page's
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS_S)
        self.inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to finished.", REQUEST_PHASE_BUCKETS_S
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to the first token.", REQUEST_PHASE_BUCKETS_S
        )
        self.decode_time = histogram("request_decode_time_seconds", "First token to finished.", REQUEST_PHASE_BUCKETS_S)
        token_buckets = token_count_buckets(max_model_len)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of a finished request.", token_buckets)
        self.generation_tokens = histogram(
            "request_generation_tokens", "Tokens a finished request generated, over all its samples.", token_buckets
        )
        self.params_n = histogram("request_params_n", "The n (samples) of a finished request.", PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "The output budget of each sample of a finished request (max_tokens, "
            "or what fits in max_model_len when unset).", token_buckets,
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens per engine step: the prompts of the requests that produced their "
            "first token in it plus the tokens it generated.", ITERATION_TOKEN_BUCKETS,
        )
        info = GaugeMetricFamily(f"{prefix}:cache_config_info", "The engine's KV-cache configuration (value 1, in the "
                                 "labels).", labels=["model_name", *cache_config])
        info.add_metric([model_name, *cache_config.values()], 1)
        self._constant = _Constant([info])
        self.registry.register(self._constant)

    def observe_step(self, before: dict, after: dict) -> None:
        """Record one engine step from the engine counters (EngineCore.stats) before and after it."""
        prompt_tokens = after["prompt_tokens"] - before["prompt_tokens"]
        self.iteration_tokens.observe(prompt_tokens + after["generation_tokens"] - before["generation_tokens"])

    def observe_outputs(self, outputs: list[RequestOutput], now: float | None = None) -> None:
        """Record one published batch of (cumulative) outputs: the time between tokens of every request that moved
        (each new token observes the gap since the request's previous move, shared among the tokens that arrived
        together), and the finished requests."""
        now = time.monotonic() if now is None else now
        for output in outputs:
            if isinstance(output, PoolingRequestOutput):  # an embedding: one output, when it has finished
                self._observe_pooled(output)
                continue
            self._observe_move(output.request_id, max(len(c.token_ids) for c in output.outputs), output.finished, now)
            if output.finished:
                self._observe_finished(output)

    def observe_moves(self, moves: list[tuple[str, int]], now: float | None = None) -> None:
        """Record the running requests that moved in one step without an output: (request id, tokens of its
        longest sample so far), as `observe_outputs` records an output's move."""
        now = time.monotonic() if now is None else now
        for request_id, num_tokens in moves:
            self._observe_move(request_id, num_tokens, False, now)

    def _observe_move(self, request_id: str, num_tokens: int, finished: bool, now: float) -> None:
        """The gaps between the tokens a request's longest sample gained since its previous move (none at its first)."""
        seen = self._last_output.pop(request_id, None)  # (tokens, time) at its previous move
        if seen is not None and num_tokens > seen[0]:
            gap = (now - seen[1]) / (num_tokens - seen[0])
            for _ in range(num_tokens - seen[0]):
                self.per_output_token.observe(gap)
                self.inter_token.observe(gap)
                self.recent_inter_token.add(gap, now)
        if not finished and num_tokens:
            self._last_output[request_id] = (num_tokens, now)

    def _observe_finished(self, output: RequestOutput) -> None:
        """Record a finished request (any finish reason): its samples' finish reasons, sizes and latencies."""
        for completion in output.outputs:
            self.request_success.labels(self.model_name, completion.finish_reason).inc()
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        self.generation_tokens.observe(sum(len(c.token_ids) for c in output.outputs))
        self.params_n.observe(len(output.outputs))
        if output.metrics.max_tokens is not None:
            self.params_max_tokens.observe(output.metrics.max_tokens)
        self._observe_latencies(output)

    def _observe_pooled(self, output: PoolingRequestOutput) -> None:
        """Record a finished embedding request: its end (stop, or abort or error without an embedding), its prompt
        and its latencies."""
        reason = "stop" if output.outputs is not None else ("error" if output.error else "abort")
        self.request_success.labels(self.model_name, reason).inc()
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        self._observe_latencies(output)

    def _observe_latencies(self, output: RequestOutput | PoolingRequestOutput) -> None:
        """Observe each phase of a finished request whose two ends it reached (an abort may miss some)."""
        t = output.metrics
        phases = (
            (self.e2e_latency, t.arrival_time, t.finished_time),
            (self.queue_time, t.arrival_time, t.first_scheduled_time),
            (self.first_token, t.arrival_time, t.first_token_time),
            (self.inference_time, t.first_scheduled_time, t.finished_time),
            (self.prefill_time, t.first_scheduled_time, t.first_token_time),
            (self.decode_time, t.first_token_time, t.finished_time),
        )
        for histogram, start, end in phases:
            if start is not None and end is not None:
                histogram.observe(end - start)
        if t.arrival_time is not None and t.first_token_time is not None:
            self.recent_first_token.add(t.first_token_time - t.arrival_time, time.monotonic())

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric: with several front-end processes (prometheus-client's
        multiprocess mode, PROMETHEUS_MULTIPROC_DIR set before it was imported) the request metrics of all of them,
        summed, beside the engine's."""
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(self._engine)
        registry.register(self._constant)
        return generate_latest(registry)


class _Constant:
    """Metric families that never change."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        yield from self.families
