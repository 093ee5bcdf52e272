"""benchmarks/serving_capacity.py at a tiny size: every stream (and every reply sent whole) gets all its tokens
through the real server over a fake runner, the engine in an engine-core process, and the result carries the client's
figures and the engine's host time per step."""

import json

from benchmarks.serving_capacity import OUTPUT_LEN, main, report


def test_the_capacity_benchmark_streams_every_token_and_reports_the_engines_step(tmp_path):
    path = tmp_path / "capacity.json"
    results = main(["--streams", "4", "--engine", "process", "--replies", "streamed", "whole", "--json", str(path)])
    assert json.loads(path.read_text()) == results  # (thread: the same but an if)
    assert [(r["engine"], r["replies"]) for r in results] == [("process", "streamed"), ("process", "whole")]
    _check(results[0])
    assert results[0]["client"]["chunks"] > 0
    _check(results[1])  # the same requests, each reply whole
    assert "| process | 4 | streamed |" in report(results) and "| process | 4 | whole |" in report(results)


def _check(result: dict) -> None:
    assert result["streams"] == 4 and result["failed"] == 0
    assert result["output_tokens"] == 4 * OUTPUT_LEN  # ignore_eos: every stream runs to its length
    assert result["output_tokens_per_s"] > 0 and result["duration_s"] > 0
    assert result["engine_steps"] >= OUTPUT_LEN  # a decode step per token at least (the server's own count)
    phases = ("schedule", "build", "update", "output") + (("send",) if result["engine"] == "process" else ())
    for phase in phases:  # an engine-core process's messages out are timed too
        assert result["engine_ms_per_step"][phase] > 0, phase
    assert result["front_end_cpu_us_per_token"] > 0
