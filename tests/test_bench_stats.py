"""The benchmark harness's arithmetic on fixed inputs: percentiles, latencies, goodput, throughput, KV memory."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from jaxserve.bench.stats import (
    RequestTrace,
    fragmentation,
    goodput,
    latency_summary,
    peak_kv,
    summarize,
    throughput,
    token_totals,
)


def trace(ttft: float, tpot: float, output_tokens: int, start: float = 0.0, error: str | None = None):
    """A trace of one token per chunk with the given TTFT and TPOT (s)."""
    chunk_times = [start + ttft + i * tpot for i in range(output_tokens)]
    return RequestTrace(start=start, chunk_times=chunk_times, chunk_tokens=[1] * output_tokens,
                        end=chunk_times[-1], prompt_tokens=10, output_tokens=output_tokens, error=error)


def test_summarize_uses_linear_interpolation():
    # Sorted [1, 2, 3, 4]: p90 sits at index 0.9 * 3 = 2.7, between 3 and 4; p99 at index 2.97.
    result = summarize([4.0, 1.0, 3.0, 2.0])
    assert result == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97})
    assert summarize([5.0]) == {"mean": 5.0, "p50": 5.0, "p90": 5.0, "p99": 5.0}
    assert summarize([0.0, 10.0], percentiles=(25, 99.9)) == pytest.approx({"mean": 5.0, "p25": 2.5, "p99.9": 9.99})


def test_summarize_of_nothing_is_none_not_nan():
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert all(type(value) is float for value in summarize([1, 2, 3]).values())


def test_request_trace_metrics():
    # Chunks of 1, 2 and 1 tokens at 0.5, 0.75 and 1.25 s after the send at 0: 4 tokens in 1.25 s.
    request = RequestTrace(start=0.0, chunk_times=[0.5, 0.75, 1.25], chunk_tokens=[1, 2, 1], end=1.25,
                           prompt_tokens=7, output_tokens=4)
    assert request.succeeded
    assert request.ttft == 0.5
    assert request.e2e == 1.25
    assert request.tpot == 0.25  # (1.25 - 0.5) / (4 - 1)
    assert request.itls == [0.25, 0.5]  # one gap per chunk, however many tokens it carries


def test_request_trace_edge_cases():
    one_token = RequestTrace(start=1.0, chunk_times=[1.5], chunk_tokens=[1], end=1.5, prompt_tokens=3,
                             output_tokens=1)
    assert one_token.ttft == 0.5 and one_token.tpot is None and one_token.itls == []
    failed = RequestTrace(start=1.0, chunk_times=[], chunk_tokens=[], end=2.0, prompt_tokens=3, output_tokens=0,
                          error="HTTP 500")
    assert not failed.succeeded and failed.ttft is None and failed.tpot is None and failed.e2e == 1.0


def test_latency_summary_in_milliseconds_over_successful_requests():
    traces = [
        RequestTrace(start=0.0, chunk_times=[0.5, 0.75, 1.25], chunk_tokens=[1, 2, 1], end=1.25,
                     prompt_tokens=7, output_tokens=4),
        RequestTrace(start=2.0, chunk_times=[2.25, 2.5], chunk_tokens=[1, 1], end=2.5, prompt_tokens=5,
                     output_tokens=2),
        RequestTrace(start=0.0, chunk_times=[9.0], chunk_tokens=[1], end=9.0, prompt_tokens=5, output_tokens=1,
                     error="disconnected"),
    ]
    summary = latency_summary(traces)
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["ttft_ms"] == pytest.approx(summarize([500.0, 250.0]))
    assert summary["tpot_ms"] == pytest.approx(summarize([250.0, 250.0]))
    assert summary["itl_ms"] == pytest.approx(summarize([250.0, 500.0, 250.0]))
    assert summary["e2e_ms"] == pytest.approx(summarize([1250.0, 500.0]))
    assert latency_summary([])["ttft_ms"]["p99"] is None


def test_token_totals_count_successful_requests():
    traces = [trace(0.1, 0.01, 4), trace(0.1, 0.01, 6), trace(0.1, 0.01, 3, error="timeout")]
    assert token_totals(traces) == {"prompt_tokens": 20, "output_tokens": 10}


def test_goodput_with_both_slos():
    traces = [
        trace(ttft=0.25, tpot=0.0625, output_tokens=5),  # meets both
        trace(ttft=0.75, tpot=0.0625, output_tokens=5),  # TTFT too slow
        trace(ttft=0.25, tpot=0.25, output_tokens=5),  # TPOT too slow
        trace(ttft=0.25, tpot=0.0, output_tokens=1),  # one token: TPOT is not defined, so it is met
        trace(ttft=0.25, tpot=0.0625, output_tokens=5, error="HTTP 503"),  # failed
    ]
    assert goodput(traces, 2.0, slo_ttft_ms=500, slo_tpot_ms=100) == {"requests_per_s": 1.0, "fraction": 0.4,
                                                                     "count": 2}
    assert goodput(traces, 2.0, slo_ttft_ms=500)["count"] == 3
    assert goodput(traces, 2.0, slo_tpot_ms=100)["count"] == 3
    assert goodput(traces, 4.0) == {"requests_per_s": 1.0, "fraction": 0.8, "count": 4}
    assert goodput(traces, 2.0, slo_ttft_ms=250, slo_tpot_ms=62.5)["count"] == 2  # the SLO bound is inclusive
    assert goodput([], 1.0) == {"requests_per_s": 0.0, "fraction": 0.0, "count": 0}
    with pytest.raises(ValueError, match="duration_s"):
        goodput(traces, 0.0)


def test_throughput_row():
    assert throughput(10, 1000, 500, 2.0) == {"requests_per_s": 5.0, "output_tokens_per_s": 250.0,
                                              "total_tokens_per_s": 750.0}
    with pytest.raises(ValueError, match="seconds"):
        throughput(1, 1, 1, 0.0)


def test_fragmentation():
    assert math.isclose(fragmentation(10, 16, 150), 1 - 150 / 160)  # 10 slots of the 10th page are empty
    assert fragmentation(4, 16, 64) == 0.0
    assert fragmentation(0, 16, 0) == 0.0
    # Reservation: a 100-token sequence holding a max_model_len of 1024 tokens in 64 pages of 16.
    assert math.isclose(fragmentation(64, 16, 100), 1 - 100 / 1024)
    with pytest.raises(ValueError, match="cannot fit"):
        fragmentation(2, 16, 33)
    with pytest.raises(ValueError):
        fragmentation(2, 0, 0)


def test_peak_kv_reads_the_step_with_most_pages():
    steps = [
        SimpleNamespace(pages_in_use=4, token_slots_used=60, num_running=9),
        SimpleNamespace(pages_in_use=10, token_slots_used=150, num_running=5),
        SimpleNamespace(pages_in_use=10, token_slots_used=160, num_running=6),  # ties: the first peak counts
        SimpleNamespace(pages_in_use=2, token_slots_used=20, num_running=1),
    ]
    result = peak_kv(steps, page_size=16)
    assert result == {"pages_in_use": 10, "token_slots_used": 150, "fragmentation": pytest.approx(1 - 150 / 160),
                      "running": 5, "max_running": 9}
    assert peak_kv([], page_size=16) == {"pages_in_use": 0, "token_slots_used": 0, "fragmentation": 0.0,
                                         "running": 0, "max_running": 0}
