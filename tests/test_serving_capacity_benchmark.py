"""benchmarks/serving_capacity.py at a tiny size: every stream gets all its tokens through the real server over a
fake runner, and the result carries the client's figures and the engine's host time per step."""

import json

from benchmarks.serving_capacity import OUTPUT_LEN, main, report


def test_the_capacity_benchmark_streams_every_token_and_reports_the_engines_step(tmp_path):
    path = tmp_path / "capacity.json"
    (result,) = main(["--streams", "4", "--json", str(path)])
    assert json.loads(path.read_text()) == [result]
    assert result["streams"] == 4 and result["failed"] == 0
    assert result["output_tokens"] == 4 * OUTPUT_LEN  # ignore_eos: every stream runs to its length
    assert result["output_tokens_per_s"] > 0 and result["duration_s"] > 0
    assert result["engine_steps"] >= OUTPUT_LEN  # a decode step per token at least (the server's own count)
    for phase in ("schedule", "build", "update", "output"):
        assert result["engine_ms_per_step"][phase] > 0, phase
    assert result["front_end_cpu_us_per_token"] > 0
    assert result["client"]["chunks"] > 0
    assert "| 4 |" in report([result])
