"""`jaxserve bench throughput` at tiny sizes (the bundled model, 6 requests, one round), the arithmetic of its
result, and the generated model folders."""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import pytest

from helpers import NO_TORCH, TEST_CACHE_DIR
from jaxserve.bench import models, offline
from jaxserve.bench.workloads import BenchRequest, Workload, workload_from_args
from jaxserve.engine.llm_engine import default_model_path
from jaxserve.model.registry import load_model_spec
from jaxserve.tokenizer import load_tokenizer

# The CTranslate2 copy of the bundled model is cached here across test sessions.
PEER_CACHE_DIR = os.path.join(tempfile.gettempdir(), "jaxserve-test-bench-cache")
MAX_MODEL_LEN = 64  # tokens: static batching reserves 4 pages of 16 per sequence
ARGV = [
    "--num-requests", "6", "--input-len-range", "4", "24", "--output-len-dist", "uniform",
    "--output-len-range", "2", "10", "--repeats", "1", "--warmup-requests", "2", "--warmup-tokens", "2",
    "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", str(MAX_MODEL_LEN),
    "--hf-batch-sizes", "4", "--peer-threads", "1", "--check-tokens", "4",
    "--compilation-cache-dir", TEST_CACHE_DIR, "--cache-dir", PEER_CACHE_DIR,
]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    offline.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-throughput")


@pytest.fixture(scope="module")
def result(out_dir):
    """Every system (peers that cannot run here are skipped by the command itself). CTranslate2 runs in a child
    process whose converter loads the model with transformers and torch: the child sees torch, which the suite hides
    from the processes it starts (conftest.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(path for path in os.environ["PYTHONPATH"].split(os.pathsep)
                                                    if path != NO_TORCH))
        return offline.run(parse([*ARGV, "--json", str(out_dir / "result.json"),
                                  "--plot-dir", str(out_dir / "plots")]))


@pytest.fixture(scope="module")
def workload() -> Workload:
    """The command's workload, rebuilt independently."""
    return workload_from_args(parse(ARGV), load_tokenizer(default_model_path()), MAX_MODEL_LEN)


def rows_by_system(result: dict) -> dict[str, dict]:
    return {row["system"]: row for row in result["rows"]}


def test_every_system_runs_or_says_why(result):
    ran = set(rows_by_system(result))
    assert {"jaxserve", "jaxserve-sync", "jaxserve-static"} <= ran
    assert ran | set(result["skipped"]) == set(offline.SYSTEMS)
    assert all(result["skipped"].values())


def test_torch_systems_run(result):
    pytest.importorskip("torch")
    assert {"hf-generate", "hf-continuous"} <= set(rows_by_system(result)), result["skipped"]
    assert result["check"]["hf_reference"]["matching"] == result["check"]["hf_reference"]["of"] > 0


def test_ctranslate2_runs(result):
    pytest.importorskip("ctranslate2")
    pytest.importorskip("torch")  # its converter loads the model with transformers
    assert "ctranslate2" in rows_by_system(result), result["skipped"]
    details = result["systems"]["ctranslate2"]["details"]
    assert details["threads"] == [1] and details["batch_size"] == 4


def test_useful_tokens_are_the_workloads_output_tokens(result, workload):
    wanted = sum(request.output_len for request in workload.requests)
    assert result["workload"]["output_tokens"] == wanted
    assert result["workload"]["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in workload.requests)
    for name, system in result["systems"].items():
        assert system["output_tokens"] == wanted, name  # counted from what the system returned
    for row in result["rows"]:
        assert row["output_tokens_per_s"] * row["mean_s"] == pytest.approx(wanted)
        assert row["best_output_tokens_per_s"] * row["best_s"] == pytest.approx(wanted)
        assert row["requests_per_s"] * row["mean_s"] == pytest.approx(len(workload.requests))


def test_ratios_are_each_system_over_jaxserve(result):
    rows = rows_by_system(result)
    reference = rows["jaxserve"]
    for row in rows.values():
        assert row["ratio_mean"] == pytest.approx(row["output_tokens_per_s"] / reference["output_tokens_per_s"])
        assert row["ratio_best"] == pytest.approx(row["best_output_tokens_per_s"]
                                                  / reference["best_output_tokens_per_s"])
    assert reference["ratio_mean"] == reference["ratio_best"] == 1.0
    assert result["paged_over_static"]["mean"] == pytest.approx(1.0 / rows["jaxserve-static"]["ratio_mean"])


def test_kv_at_peak(result):
    page_size, num_pages = result["engine"]["page_size"], result["engine"]["num_pages"]
    for name in ("jaxserve", "jaxserve-static"):
        kv = result["kv"][name]
        assert 0.0 <= kv["fragmentation"] < 1.0, name
        assert 0 < kv["pages_in_use"] < num_pages
        assert kv["token_slots_used"] == pytest.approx((1 - kv["fragmentation"]) * kv["pages_in_use"] * page_size)
    static = result["kv"]["jaxserve-static"]
    assert static["reserved_pages_per_sequence"] == MAX_MODEL_LEN // page_size
    assert static["capacity_sequences"] == (num_pages - 1) // static["reserved_pages_per_sequence"]
    assert static["max_running"] <= static["capacity_sequences"]
    assert static["pages_in_use"] % static["reserved_pages_per_sequence"] == 0  # whole reservations only
    assert static["reservation_waste"] == static["fragmentation_mean"]
    for kv in result["kv"].values():
        assert 0.0 <= kv["fragmentation_at_most_tokens"] < 1.0 and 0.0 <= kv["fragmentation_mean"] < 1.0


def test_sync_and_static_outputs_equal_jaxserve_and_overhead_replays_the_same_steps(result):
    for name in ("jaxserve-sync", "jaxserve-static"):
        same = result["check"]["equal_to_jaxserve"][name]
        assert same["matching"] == same["of"] == 6, name
    assert set(result["engine_overhead"]) == {"jaxserve", "jaxserve-sync"}
    for overhead in result["engine_overhead"].values():
        assert overhead["recorded_steps"] == overhead["timed_steps"] > 0
        assert overhead["overhead_best"] < 1.0


def test_host_time_per_phase_is_reported_per_run(result):
    for name in ("jaxserve", "jaxserve-sync"):
        timing = result["systems"][name]["details"]["timing"]
        assert timing["steps"] == result["systems"][name]["details"]["steps"] > 0
        assert all(timing[phase + "_ms"] >= 0 for phase in offline.PHASES)
        assert 0.0 <= timing["device_idle_fraction"] <= 1.0 and timing["wall_s"] > 0


def test_json_and_plots_are_written(result, out_dir):
    with open(out_dir / "result.json") as f:
        written = json.load(f)
    assert written["rows"] == result["rows"]
    assert sorted(os.path.basename(path) for path in result["plots"]) == [
        "throughput.png", "timeline_jaxserve-static.png", "timeline_jaxserve-sync.png", "timeline_jaxserve.png"]
    assert all(os.path.getsize(path) > 0 for path in result["plots"])


def test_throughput_rows_on_fixed_numbers():
    workload = Workload("fixed", (BenchRequest((5, 6, 7), 4), BenchRequest((5, 6, 7, 8, 9), 6)), "two requests")
    row = offline.throughput_row("a", [2.0, 4.0], workload)  # mean 3 s, best 2 s; 8 prompt + 10 output tokens
    assert (row["mean_s"], row["best_s"]) == (3.0, 2.0)
    assert row["requests_per_s"] == pytest.approx(2 / 3)
    assert row["output_tokens_per_s"] == pytest.approx(10 / 3)
    assert row["total_tokens_per_s"] == pytest.approx(18 / 3)
    assert row["best_output_tokens_per_s"] == pytest.approx(5.0)
    rows = [offline.throughput_row("jaxserve", [1.0], workload), row]
    offline.add_ratios(rows)
    assert rows[1]["ratio_mean"] == pytest.approx(1 / 3) and rows[1]["ratio_best"] == pytest.approx(1 / 2)
    offline.add_ratios(rows[1:])  # no jaxserve row: no ratios
    assert rows[1]["ratio_mean"] is None


def test_default_num_pages_fits_max_num_seqs_mean_sequences():
    workload = Workload("fixed", (BenchRequest((5,) * 10, 6), BenchRequest((5,) * 20, 12)), "two requests")
    # mean length 24 tokens -> 2 pages of 16; 8 sequences -> 16 pages, plus the null page
    assert offline.default_num_pages(workload, 8, 16, 64) == 17
    # at least one max_model_len sequence (1024 tokens = 64 pages), plus the null page
    assert offline.default_num_pages(workload, 8, 16, 1024) == 65


def test_help_lists_the_options():
    parser = argparse.ArgumentParser()
    offline.add_arguments(parser)
    text = parser.format_help()
    for flag in ("--systems", "--model-shape", "--num-pages", "--repeats", "--workload", "--plot-dir"):
        assert flag in text


def test_generated_folders(tmp_path):
    small = models.ensure_model("llama-small", str(tmp_path), seed=0)
    assert not models.needs_dummy_weights(small)
    assert models.ensure_model("llama-small", str(tmp_path), seed=0) == small  # cached
    spec = load_model_spec(small)
    shape = (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.vocab_size)
    assert shape == (4, 256, 8, 2, 4096)
    big = models.ensure_model("llama-3.1-8b", str(tmp_path), seed=0)
    assert models.needs_dummy_weights(big)  # config and tokenizer only: load_format dummy
    spec = load_model_spec(big)
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.intermediate_size,
            spec.vocab_size, spec.torch_dtype) == (32, 4096, 32, 8, 14336, 128256, "bfloat16")
    assert (spec.rope.rope_type, spec.rope.theta, spec.rope.factor) == ("llama3", 500000.0, 8.0)
    assert 8.0e9 < models.SHAPES["llama-3.1-8b"].num_params < 8.1e9
    assert len(load_tokenizer(big)) == 128256
    args = parse(["--model-shape", "llama-3.1-8b", "--cache-dir", str(tmp_path)])
    assert models.model_from_args(args) == big and args.load_format == "dummy"
