"""Smoke test of `jaxserve bench effects` at tiny sizes on the bundled model, and its small helpers."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pytest

from jaxserve.bench import effects
from tests.helpers import TEST_CACHE_DIR, checkpoint

TINY = [
    "--model-shape", "bundled", "--repeats", "1", "--compilation-cache-dir", TEST_CACHE_DIR,
    "--max-model-len", "384", "--max-num-seqs", "16", "--max-num-batched-tokens", "64", "--min-token-bucket", "16",
    "--min-page-bucket", "24",  # one page-table width (384 / 16 pages): fewer programs to compile
    "--num-pages", "96",
    "--decode-requests", "4", "--decode-prompt-len", "16", "--decode-output-len", "24",
    "--long-requests", "2", "--long-prompt-len", "160", "--long-output-len", "4",
    "--prefix-requests", "6", "--prefix-len", "64", "--question-len", "8", "--prefix-output-len", "8",
    "--unshared-requests", "6", "--scheduler-steps", "1", "4",
    "--n", "4", "--parallel-prompts", "2", "--parallel-prompt-len", "48", "--parallel-output-len", "8",
]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    effects.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    path = tmp_path_factory.mktemp("effects") / "effects.json"
    args = parse(TINY + ["--json", str(path)])
    args.handler = lambda args: 0  # as the `jaxserve bench` CLI sets it; the JSON must leave it out
    returned = effects.run(args)
    with open(path) as f:
        assert json.load(f) == json.loads(json.dumps(returned))  # the file holds the returned result
    return returned


def check_timing(side: dict, output_tokens: int) -> None:
    """A system's timing block: one run, every token counted, tokens/s = tokens / seconds."""
    assert side["output_tokens"] == output_tokens
    assert len(side["runs_s"]) == 1 and side["mean_s"] == side["best_s"] == side["runs_s"][0] > 0
    assert side["output_tokens_per_s"] == pytest.approx(output_tokens / side["mean_s"])
    assert side["best_output_tokens_per_s"] == pytest.approx(output_tokens / side["best_s"])


def test_chunked_prefill(result):
    chunked = result["effects"]["chunked-prefill"]
    on, off = chunked["systems"]
    for side in (on, off):
        check_timing(side, 4 * 24 + 2 * 4)
        assert side["decode_itl_ms"]["p50"] <= side["decode_itl_ms"]["p99"] <= side["decode_itl_ms"]["max"]
        assert side["long_ttft_ms"]["max"] > 0
    assert on["max_num_batched_tokens"] == 64 and on["max_step_tokens"] <= 64
    assert off["max_num_batched_tokens"] == 384 and off["max_step_tokens"] > 160  # a whole long prompt in a step
    assert chunked["same_tokens"] == [6, 6]  # greedy tokens do not depend on chunking
    assert len(chunked["arrivals_s"]) == 2 and 0 < chunked["arrivals_s"][0] < chunked["arrivals_s"][1]


def test_prefix_cache(result):
    shared = result["effects"]["prefix-cache"]["shared_prefix"]
    on, off = shared["systems"]
    assert shared["ideal_hits"] == 5 * 64  # 5 requests after the first, 4 full pages of 16 each
    assert 0 < on["hit_rate_runs"][0] <= 1 and on["hit_rate_runs"][0] == on["hits_runs"][0] / shared["ideal_hits"]
    assert off["hit_rate_runs"] == [0.0] and off["queries_runs"] == [0]
    for side in (on, off):
        check_timing(side, 6 * 8)
    assert shared["same_tokens"] == [6, 6]
    unshared = result["effects"]["prefix-cache"]["no_sharing"]
    assert unshared["systems"][0]["hits_runs"] == [0] and unshared["systems"][0]["queries_runs"][0] > 0
    host = unshared["cache_host"]
    assert 0 < host["cache_s"] < host["run_s"] and host["methods"]["find_cached_prefix"]["calls"] == 6
    assert unshared["systems"][0]["output_tokens"] == unshared["systems"][1]["output_tokens"] > 6
    assert unshared["same_tokens"] == [6, 6]


def test_overlap(result):
    overlap = result["effects"]["overlap"]
    sync, async_one, async_four = overlap["systems"]
    assert [side["system"] for side in overlap["systems"]] == ["sync, 1 step", "async, 1 step", "async, 4 steps"]
    for side in overlap["systems"]:
        check_timing(side, sync["output_tokens"])
        timing = side["timing_best_run"]
        assert timing["steps"] == side["steps_runs"][0] > 0 and 0.0 <= timing["device_idle_fraction"] <= 1.0
        assert side["itl_ms"]["p50"] <= side["itl_ms"]["p99"]
    assert overlap["same_tokens_as_sync"] == [[6, 6], [6, 6]]
    assert async_four["steps_runs"][0] < async_one["steps_runs"][0]  # decodes took 4 tokens per step
    assert len(overlap["throughput_over_sync"]) == 2


def test_parallel_sampling(result):
    parallel = result["effects"]["parallel-sampling"]
    shared, independent = parallel["systems"]
    for side in (shared, independent):
        check_timing(side, 2 * 4 * 8)
    assert shared["peak_kv"]["pages_in_use"] < independent["peak_kv"]["pages_in_use"]
    assert parallel["peak_pages_shared_over_independent"] < 1
    assert parallel["same_tokens"] == [2, 2]  # sample i of a seeded request == the request seeded with seed + i


def test_sizes_must_fit_max_model_len():
    with pytest.raises(ValueError, match="--long-prompt-len"):
        effects.resolve_sizes(parse(["--max-model-len", "256", "--quick"]))


def test_long_arrivals_spread_over_the_decodes():
    assert effects.long_arrivals(3.0, 2, 2) == [0.0, 0.0, 1.0, 2.0]


def test_timed_methods_restores_the_methods():
    class Counter:
        def add(self, x):
            return x + 1

    counter = Counter()
    with effects.timed_methods(counter, ["add"]) as totals:
        assert counter.add(1) == 2
    assert totals["add"]["calls"] == 1 and totals["add"]["seconds"] >= 0
    assert "add" not in vars(counter)


def _side(name: str, **extra) -> dict:
    """A system's timing block as `harness.timing` makes it (two runs)."""
    return {"system": name, "output_tokens_per_s": 100.0, "best_output_tokens_per_s": 110.0, "runs_s": [1.1, 1.0],
            **extra}


def test_preemption_report_lines():
    """The report of the preemption experiment (its engines are too large for a smoke run: docs/benchmarks.md)."""
    from jaxserve.bench.preemption import preemption_lines

    spread = {"mean": 5.0, "p50": 4.0, "p90": 6.0, "p99": 7.0, "max": 8.0}
    sides = [_side(mode, preemptions_runs=[3, 2], preempted_requests_runs=[2, 1], swapped_out_requests_runs=[1, 0],
                   swapped_pages_runs=[9, 0], preempted_e2e_ms=spread, all_e2e_ms=spread, mean_ttft_ms=2.0,
                   swap_ms_per_step=0.25) for mode in ("recompute", "swap", "auto")]
    ratio = {"mean": 1.5, "best": 1.6, "rounds": [1.4, 1.6]}
    result = {"workload": "w", "num_pages": 33, "systems": sides, "throughput_over_recompute": [ratio, ratio],
              "same_tokens_as_recompute": [[4, 4], [4, 4]],
              "bandwidth": {"pages": 8, "page_bytes": 2**20, "out_gbps": (1.0, 2.0), "in_gbps": (0.5, 0.75)}}
    text = "\n".join(preemption_lines(result))
    assert ("| swap | 100 | 110 | 1.10, 1.00 | 3 (2), 2 (1) | 1 / 9, 0 / 0 | 4.0 / 7.0 / 8.0 | 5.0 / 8.0 | 2.0 "
            "| 0.25 |") in text
    assert "swap / recompute: throughput 1.50x mean, 1.60x best; greedy tokens equal for 4/4 requests" in text
    assert "(8 pages, 8.0 MiB each way): device to host 1.00 GB/s mean, 2.00 best; host to device 0.50" in text


def test_speculation_workload_and_report_lines():
    from jaxserve.bench.speculation import MARKER, code_editing_workload, speculation_lines
    from jaxserve.engine.llm_engine import default_model_path
    from jaxserve.tokenizer import load_tokenizer

    model = default_model_path()
    workload = code_editing_workload(model, 3, 300, 16)
    assert len(workload.requests) == 3 and len({r.prompt_token_ids for r in workload.requests}) == 3
    for request in workload.requests:
        piece, copy = request.prompt_text.split(MARKER)
        assert len(piece) == 300 and piece.startswith(copy) and len(copy) == 100 and request.output_len == 16
        assert list(request.prompt_token_ids) == load_tokenizer(model).encode(
            request.prompt_text, add_special_tokens=False)
    spread = {"mean": 2.0, "p50": 1.5, "p90": 2.5, "p99": 3.5, "max": 4.0}
    common = dict(itl_ms=spread, tpot_ms=spread, steps=130.0)
    entry = {"batch": 8, "systems": [
        _side("off", propose_ms=0.0, **common),
        _side("ngram, 4 tokens", propose_ms=0.25, on_over_off={"mean": 0.9, "best": 0.95},
              mean_acceptance_length=2.5, same_tokens=[8, 8], **common)]}
    lines = speculation_lines({"draft_model": "/models/draft", "batches": [entry]})
    assert "Draft model: `/models/draft`." in lines
    assert "| 8 | off | 100 | 110 | 1.10, 1.00 | 130 | 0.00 | 1.5 / 3.5 | 2.0 | | | |" in lines
    assert ("| 8 | ngram, 4 tokens | 100 | 110 | 1.10, 1.00 | 130 | 0.25 | 1.5 / 3.5 | 2.0 | 0.90x, 0.95x | 2.50 "
            "| 8/8 |") in lines

def test_early_exit_copy_keeps_the_first_layers(tmp_path):
    """The speculation experiment's default draft: the target's first layers, embeddings, final norm and head."""
    from safetensors.numpy import load_file

    from jaxserve.bench.models import early_exit_copy

    source = load_file(os.path.join(checkpoint("llama"), "model-00001-of-00002.safetensors"))
    source.update(load_file(os.path.join(checkpoint("llama"), "model-00002-of-00002.safetensors")))
    folder = early_exit_copy(checkpoint("llama"), 1, str(tmp_path))
    assert early_exit_copy(checkpoint("llama"), 1, str(tmp_path)) == folder  # cached
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == 1
    weights = load_file(os.path.join(folder, "model.safetensors"))
    assert set(weights) == {key for key in source if not key.startswith("model.layers.1.")}
    assert all(np.array_equal(weights[key], source[key]) for key in weights)
    assert os.path.isfile(os.path.join(folder, "tokenizer.json"))
    with pytest.raises(ValueError, match="spec-draft-layers"):
        early_exit_copy(checkpoint("llama"), 2, str(tmp_path))


def test_quantization_report_lines():
    from jaxserve.bench.quantization import quantization_lines

    sides = [_side("none", kv_tokens=4096),
             _side("fp8 KV", kv_tokens=16384, over_float={"mean": 0.8, "best": 0.85}, same_tokens=[30, 32])]
    lines = quantization_lines({"workload": "w", "systems": sides})
    assert "| none | 4,096 | 100 | 110 | 1.10, 1.00 | | |" in lines
    assert "| fp8 KV | 16,384 | 100 | 110 | 1.10, 1.00 | 0.80x, 0.85x | 30/32 |" in lines
