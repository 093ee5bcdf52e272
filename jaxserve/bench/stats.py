"""The benchmark harness's arithmetic: percentiles, per-request latencies, goodput, throughput, KV fragmentation.

Pure functions of recorded numbers, shared by the offline and online commands. Times are seconds
(time.perf_counter); the summaries report milliseconds, as vLLM's benchmarks do. Every result is JSON-able:
an empty sample gives None, never NaN.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np


def summarize(values: Sequence[float], percentiles: Sequence[float] = (50, 90, 99)) -> dict:
    """{"mean", "p50", "p90", "p99"} of `values` (numpy's linear interpolation); all None when empty."""
    keys = ["mean"] + [f"p{p:g}" for p in percentiles]
    if len(values) == 0:
        return dict.fromkeys(keys)
    array = np.asarray(values, dtype=np.float64)  # (len(values),)
    numbers = [array.mean(), *np.percentile(array, percentiles)]
    return {key: float(number) for key, number in zip(keys, numbers)}


@dataclasses.dataclass
class RequestTrace:
    """One request as the client (or the driver) saw it; times in seconds."""

    start: float  # when it was sent (s)
    chunk_times: list[float]  # when each streamed chunk carrying >= 1 token arrived (s)
    chunk_tokens: list[int]  # tokens in each such chunk
    end: float  # when the response finished (s)
    prompt_tokens: int
    output_tokens: int  # from the server's usage, or counted
    error: str | None = None  # why it failed; None when it succeeded

    @property
    def succeeded(self) -> bool:
        """Whether the request finished without an error."""
        return self.error is None

    @property
    def ttft(self) -> float | None:
        """Time to first token (s); None when no token arrived."""
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        """End-to-end latency (s)."""
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (s); None with fewer than two output tokens."""
        if self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Inter-token latencies (s): the gaps between successive chunks (a chunk of k tokens is one gap)."""
        return [later - earlier for earlier, later in zip(self.chunk_times, self.chunk_times[1:])]


def _ms(seconds: Iterable[float | None]) -> list[float]:
    """The given times in milliseconds, Nones dropped."""
    return [1000.0 * value for value in seconds if value is not None]


def latency_summary(traces: Sequence[RequestTrace]) -> dict:
    """Summaries (mean, p50, p90, p99, in ms) of TTFT, TPOT, ITL and end-to-end latency over the successful
    traces, with the counts of completed and failed requests."""
    done = [trace for trace in traces if trace.succeeded]
    return {
        "completed": len(done),
        "failed": len(traces) - len(done),
        "ttft_ms": summarize(_ms(trace.ttft for trace in done)),
        "tpot_ms": summarize(_ms(trace.tpot for trace in done)),
        "itl_ms": summarize(_ms(itl for trace in done for itl in trace.itls)),
        "e2e_ms": summarize(_ms(trace.e2e for trace in done)),
    }


def token_totals(traces: Sequence[RequestTrace]) -> dict:
    """{"prompt_tokens", "output_tokens"}: the tokens of the successful traces, summed."""
    done = [trace for trace in traces if trace.succeeded]
    return {
        "prompt_tokens": sum(trace.prompt_tokens for trace in done),
        "output_tokens": sum(trace.output_tokens for trace in done),
    }


def goodput(traces: Sequence[RequestTrace], duration_s: float, slo_ttft_ms: float | None = None,
            slo_tpot_ms: float | None = None) -> dict:
    """{"requests_per_s", "fraction", "count"} of the successful requests that meet every SLO given: TTFT at
    most `slo_ttft_ms` and TPOT at most `slo_tpot_ms` (a request with a single token meets the TPOT SLO).
    `fraction` is over all traces, failed ones included; 0.0 when there are none."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")

    def good(trace: RequestTrace) -> bool:
        if not trace.succeeded:
            return False
        if slo_ttft_ms is not None and (trace.ttft is None or 1000.0 * trace.ttft > slo_ttft_ms):
            return False
        return slo_tpot_ms is None or trace.tpot is None or 1000.0 * trace.tpot <= slo_tpot_ms

    count = sum(good(trace) for trace in traces)
    return {
        "requests_per_s": count / duration_s,
        "fraction": count / len(traces) if traces else 0.0,
        "count": count,
    }


def throughput(num_requests: int, prompt_tokens: int, output_tokens: int, seconds: float) -> dict:
    """{"requests_per_s", "output_tokens_per_s", "total_tokens_per_s"} of a run of `seconds`."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return {
        "requests_per_s": num_requests / seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / seconds,
    }


def throughput_of_runs(num_requests: int, prompt_tokens: int, output_tokens: int, runs_s: Sequence[float]) -> dict:
    """One system's timed runs of the same work: throughput() at the mean run, and at the best run under
    "best_" keys, with "mean_s", "best_s" and "runs_s"."""
    mean_s, best_s = float(np.mean(runs_s)), float(min(runs_s))
    best = throughput(num_requests, prompt_tokens, output_tokens, best_s)
    return {**throughput(num_requests, prompt_tokens, output_tokens, mean_s),
            **{f"best_{key}": value for key, value in best.items()},
            "mean_s": mean_s, "best_s": best_s, "runs_s": list(runs_s)}


def fragmentation(pages_in_use: int, page_size: int, token_slots_used: int) -> float:
    """The share of held KV slots that hold no token: 1 - used / (pages * page_size); 0.0 with no pages."""
    if page_size < 1 or pages_in_use < 0 or token_slots_used < 0:
        raise ValueError(f"bad KV occupancy: {pages_in_use} pages of {page_size}, {token_slots_used} tokens")
    if pages_in_use == 0:
        return 0.0
    capacity = pages_in_use * page_size
    if token_slots_used > capacity:
        raise ValueError(f"{token_slots_used} tokens cannot fit in {pages_in_use} pages of {page_size}")
    return 1.0 - token_slots_used / capacity


def peak_kv(steps: Sequence, page_size: int) -> dict:
    """KV memory at the step holding the most pages (the first such step), from records with `pages_in_use`,
    `token_slots_used` and `num_running`: {"pages_in_use", "token_slots_used", "fragmentation", "running",
    "max_running"}, the last being the most requests running at any step. All zero with no steps."""
    if not steps:
        return {"pages_in_use": 0, "token_slots_used": 0, "fragmentation": 0.0, "running": 0, "max_running": 0}
    peak = max(steps, key=lambda step: step.pages_in_use)
    return {
        "pages_in_use": peak.pages_in_use,
        "token_slots_used": peak.token_slots_used,
        "fragmentation": fragmentation(peak.pages_in_use, page_size, peak.token_slots_used),
        "running": peak.num_running,
        "max_running": max(step.num_running for step in steps),
    }
