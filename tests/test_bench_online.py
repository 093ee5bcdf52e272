"""`jaxserve bench serve`: the arrival schedule, the client's HTTP/SSE parsing on fixed bytes, and a smoke
run against an in-process server on the bundled model (small buckets)."""

from __future__ import annotations

import asyncio
import json
import math
import os

import numpy as np
import pytest

from jaxserve.bench.http_client import RawResponse, Target, parse_http, post_streaming, request_bytes, trace_of


def _sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
TOKEN = {"choices": [{"index": 0, "text": "a"}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}


def _response(reads: list[bytes], times: list[float] | None = None) -> RawResponse:
    times = times or [1.0 + i for i in range(len(reads))]
    return RawResponse(start=0.5, end=times[-1], reads=reads, read_times=times, busy_s=0.0)


# ---- arrival schedule ---------------------------------------------------------------------------------

def test_arrival_schedule_is_seeded_and_has_the_asked_rate():
    from jaxserve.bench.online import arrival_schedule

    a = arrival_schedule(20000, 4.0, seed=3)
    assert a.shape == (20000,) and a[0] == 0.0 and np.all(np.diff(a) >= 0)
    np.testing.assert_array_equal(a, arrival_schedule(20000, 4.0, seed=3))
    assert not np.array_equal(a, arrival_schedule(20000, 4.0, seed=4))
    assert (len(a) - 1) / a[-1] == pytest.approx(4.0, rel=0.03)  # requests/s
    np.testing.assert_array_equal(arrival_schedule(5, math.inf), np.zeros(5))


def test_burstiness_changes_the_spread_of_gaps_not_their_mean():
    from jaxserve.bench.online import arrival_schedule

    gaps = {b: np.diff(arrival_schedule(20000, 2.0, burstiness=b, seed=0)) for b in (0.25, 1.0, 4.0)}
    for b, g in gaps.items():
        assert g.mean() == pytest.approx(0.5, rel=0.05)  # s
        assert g.var() == pytest.approx(0.25 / b, rel=0.15)  # gamma: shape * scale^2 = 1 / (rate^2 * b)
    with pytest.raises(ValueError):
        arrival_schedule(4, 0.0)


# ---- parsing ----------------------------------------------------------------------------------------

def test_chunked_sse_with_usage_gives_chunk_times_and_usage_counts():
    body = _chunked(_sse(TOKEN), _sse(TOKEN) + _sse(TOKEN), _sse(USAGE), _sse(b"[DONE]"))
    cut = len(HEAD) + 20  # the first event ends in the second read
    raw = HEAD + body
    trace = trace_of(_response([raw[:cut], raw[cut:cut + 40], raw[cut + 40:]]), prompt_tokens=99)
    assert trace.error is None
    status, _, events = parse_http([raw], [1.0])
    assert status == 200 and [d for _, d in events][-1] == "[DONE]" and len(events) == 5
    assert trace.chunk_times[0] == 2.0  # the read that completed the first event
    assert len(trace.chunk_times) == 3 and trace.chunk_tokens == [1, 1, 1]
    assert (trace.prompt_tokens, trace.output_tokens) == (7, 3)  # from the usage chunk
    assert trace.start == 0.5 and trace.end == 3.0


def test_without_usage_tokens_are_counted_and_continuous_usage_is_used():
    plain = HEAD + _chunked(_sse(TOKEN), _sse({"choices": [{"index": 0, "text": ""}]}), _sse(TOKEN), _sse(b"[DONE]"))
    trace = trace_of(_response([plain]), prompt_tokens=5)
    assert trace.error is None and trace.chunk_tokens == [1, 1] and trace.output_tokens == 2
    assert trace.prompt_tokens == 5

    def with_usage(text: str, done: int) -> dict:
        return {"choices": [{"index": 0, "delta": {"content": text}}],
                "usage": {"prompt_tokens": 4, "completion_tokens": done}}

    chat = b"HTTP/1.1 200 OK\r\n\r\n" + _sse(with_usage("", 0)) + _sse(with_usage("ab", 2)) + _sse(
        with_usage("c", 3)) + _sse(b"[DONE]")  # not chunked: the body runs to EOF
    trace = trace_of(_response([chat]), prompt_tokens=1)
    assert trace.error is None and trace.chunk_tokens == [2, 1] and trace.output_tokens == 3


@pytest.mark.parametrize("raw, error", [
    (HEAD + _chunked(_sse(TOKEN), _sse({"error": {"message": "engine died", "code": 503}})),
     "error event: engine died"),
    (HEAD + _chunked(_sse(TOKEN))[:-5], "ended before data: [DONE]"),
    (b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 33\r\n\r\n"
     + json.dumps({"error": {"message": "bad key"}}).encode(), "HTTP 401: bad key"),
    (b"HTTP/1.1 200", "incomplete HTTP response"),
])
def test_failures_become_trace_errors(raw, error):
    assert error in trace_of(_response([raw]), prompt_tokens=1).error


def test_unreachable_server_fails_the_request_quickly():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = Target.from_url(f"http://127.0.0.1:{port}")
    response = asyncio.run(post_streaming(target, request_bytes(target, "/v1/completions", b"{}", None), 5.0))
    trace = trace_of(response, prompt_tokens=1)
    assert trace.error and "127.0.0.1" in trace.error and trace.end - trace.start < 5.0


# ---- the command against a live server ----------------------------------------------------------------

@pytest.fixture(scope="module")
def server_url():
    from helpers import running_server, small_engine_args

    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.server.app import build_app
    from jaxserve.server.config import ServerConfig

    options = small_engine_args()
    options.pop("show_progress")
    engine = LLMEngine(EngineConfig.for_model(None, **options), show_progress=False)
    with running_server(build_app(engine, ServerConfig(api_key="bench-key"))) as url:
        yield url


def _args(*argv: str):
    import argparse

    from jaxserve.bench import online

    parser = argparse.ArgumentParser()
    online.add_arguments(parser)
    return parser.parse_args(["--no-progress", "--num-requests", "4", "--input-len-dist", "fixed", "--input-len", "8",
                              "--output-len-dist", "fixed", "--output-len", "4", *argv])


def test_bench_serve_smoke(server_url, tmp_path):
    from jaxserve.bench import online

    args = _args("--base-url", server_url, "--api-key", "bench-key", "--request-rate", "50", "inf",
                 "--max-concurrency", "3", "--slo-ttft", "60000", "--json", str(tmp_path / "r.json"),
                 "--plot-dir", str(tmp_path / "plots"))
    result = online.run(args)
    assert result["model"] == "tiny-stdlib-llama" and result["max_model_len"] == 128
    assert [r["request_rate"] for r in result["rates"]] == [50.0, "inf"]
    for rate in result["rates"]:
        assert (rate["completed"], rate["failed"], rate["errors"]) == (4, 0, [])
        assert rate["output_tokens"] == rate["expected_output_tokens"] == 16
        assert rate["prompt_tokens"] == 32
        assert 1 <= rate["max_concurrency_reached"] <= 3
        assert rate["goodput"]["count"] == 4 and rate["prefix_cache_reset"]
        assert rate["latency_ms"]["ttft_ms"]["p50"] > 0 and rate["latency_ms"]["tpot_ms"]["p99"] > 0
        # At most one chunk per token: a token whose text the detokenizer holds back (part of a UTF-8
        # character) streams no text, so the random model's output can take fewer chunks.
        assert 4 <= rate["client"]["chunks"] <= 16 and rate["client"]["parse_us_per_chunk"] > 0
    assert json.loads((tmp_path / "r.json").read_text())["rates"][1]["completed"] == 4
    assert os.path.getsize(result["plots"][0]) > 0


def test_bench_serve_errors_are_clear(server_url):
    from jaxserve.bench import online

    with pytest.raises(ValueError, match="cannot reach"):
        online.run(_args("--base-url", "http://127.0.0.1:9"))
    with pytest.raises(ValueError, match="api-key"):
        online.run(_args("--base-url", server_url, "--api-key", "wrong"))
    with pytest.raises(ValueError, match="warm-up request .* failed: HTTP 404"):
        online.run(_args("--base-url", server_url, "--api-key", "bench-key", "--model", "no-such-model"))
    with pytest.raises(ValueError, match="needs text prompts"):
        online.run(_args("--base-url", server_url, "--api-key", "bench-key", "--endpoint", "/v1/chat/completions"))


def test_throughput_bars_and_step_timeline_write_pngs(tmp_path):
    from jaxserve.bench.driver import StepRecord
    from jaxserve.bench.plots import step_timeline, throughput_bars

    rows = [{"system": "jaxserve", "output_tokens_per_s": 100.0, "best_output_tokens_per_s": 110.0},
            {"system": "static", "output_tokens_per_s": 20.0}]
    steps = [StepRecord(start=0.1 * i, end=0.1 * i + 0.05, num_tokens=16 + i, num_running=i, num_waiting=0,
                        pages_in_use=i + 1, token_slots_used=12 * (i + 1)) for i in range(5)]
    for path in (throughput_bars(rows, str(tmp_path / "bars.png")), step_timeline(steps, 16, str(tmp_path / "t.png"))):
        assert os.path.getsize(path) > 0


def test_the_serve_command_tunes_its_garbage_collector_then_runs(monkeypatch):
    """`jaxserve bench serve`'s process collects as the engine's does (engine/host_gc.py), before any request."""
    from jaxserve.bench import online
    from jaxserve.cli import build_parser

    calls = []
    monkeypatch.setattr(online, "tune_garbage_collector", lambda: calls.append("tune"))
    monkeypatch.setattr(online, "freeze_start_up_objects", lambda: calls.append("freeze"))
    monkeypatch.setattr(online, "run", lambda args: calls.append(("run", args.base_url)) or {})
    args = build_parser().parse_args(["bench", "serve", "--base-url", "http://127.0.0.1:9"])
    assert args.handler(args) == 0
    assert calls == ["tune", "freeze", ("run", "http://127.0.0.1:9")]
