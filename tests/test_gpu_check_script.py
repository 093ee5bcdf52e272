"""benchmarks/gpu_check.sh (the one prepared H200 run) runs end to end on the CPU in its tiny plan (Pallas
interpret mode), so a lent H200 is not the first place it can break; its decision rule; and
benchmarks/kernels.py, the correctness checks on their own."""

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import TEST_CACHE_DIR

from benchmarks.gpu import summary
from benchmarks.gpu.checks import check_names
from benchmarks.gpu.config import FULL, STEP_NAMES, TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECISIONS = (summary.KEEP_TEXT, summary.TUNE_TEXT, summary.MOSAIC_TEXT, summary.MOSAIC_KEEP_TEXT)


def script_env(tmp_path) -> dict:
    """The environment of a tiny run writing under tmp_path, without the suite's four simulated devices, and
    compiling into the suite's persistent XLA cache (every step and the end-to-end engine)."""
    env = {**os.environ, "GPU_CHECK_TINY": "1", "OUT": str(tmp_path / "out"), "TMPDIR": str(tmp_path),
           "PYTHON": sys.executable, "PYTHONPATH": ROOT, "JAX_COMPILATION_CACHE_DIR": TEST_CACHE_DIR,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    env.pop("XLA_FLAGS", None)
    return env


def test_gpu_check_runs_end_to_end_in_tiny_mode(tmp_path):
    result = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=script_env(tmp_path),
                            capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out[-6000:] + result.stderr[-2000:]
    for number, name in enumerate(STEP_NAMES, 1):  # every step's header, its own result line and the shell's verdict
        assert f"== [{number}/11] {name} (limit" in out
        assert f"RESULT {name}: OK" in out
        assert f"-- [{number}/11] {name}: ok in" in out
    assert "== [11/11] summary" in out
    # a line from each step's measurements
    assert "no deprecation warning" in out or "WARNING TEXT: " in out
    assert "compile paged_decode_attention   pages of 16  OK" in out
    assert "PASS  decode float32 num_splits=3, 2 pages a step" in out
    assert re.search(r"bandwidth add uint32 4 MiB x4 +\d+ GB/s", out)
    assert re.search(r"bandwidth copy uint32 4 MiB x1 +\d+ GB/s", out)
    assert re.search(r"decode B=2 +ctx=64 +splits auto\(1\) warps 8 stages 3 pages/step 1 .* us", out)
    assert re.search(r"decode B=2 +ctx=64 +splits auto\(1\) warps 4 stages 2 pages/step 2 .* us", out)
    assert re.search(r"attention backend xla +B=2 .* us", out)
    assert re.search(r"prefill 2 x 16 tokens after 32 +ragged kernel .* TFLOP/s +err vs dense", out)
    assert re.search(r"kv write T=8 .* GB/s", out)
    assert re.search(r"fp8 step fp8 weights \+ fp8 KV +[\d.]+ ms .* bf16's time", out)
    assert re.search(r"RESULT e2e: OK \d+ output tok/s", out)
    # the decision comes last, and is one of the three (every step measured something)
    decisions = re.findall(r"^DECISION: (.*)$", out, re.M)
    assert decisions and out.rstrip().splitlines()[-2] == f"DECISION: {decisions[-1]}"
    assert decisions[-1].startswith(DECISIONS), decisions[-1]
    written = sorted(os.listdir(tmp_path / "out"))
    assert written == ["e2e_bench.json", "gpu_check.json", "gpu_check.log", "gpu_check.md"], written
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["tiny"] and report["decision"] == f"DECISION: {decisions[-1]}"
    assert all(report["results"][name]["ok"] for name in STEP_NAMES)
    assert [step["name"] for step in report["steps"]] == list(STEP_NAMES)
    assert not [name for name in os.listdir(tmp_path) if name.startswith("gpu_check.")]  # the work folder is gone


def decode_result(shares: dict) -> dict:
    """A decode step's saved result whose best rows have these copy shares per (batch, context)."""
    return {"best": [{"batch": b, "context": c, "copy_share": share, "label": "x", "us": 1.0, "gb_per_s": 1.0}
                     for (b, c), share in shares.items()]}


COMPILED = {"rows": [{"kernel": k, "page_size": 16, "ok": True} for k in summary.ATTENTION_KERNELS]}


@pytest.mark.parametrize("shares, decided", [
    ({(8, 8192): 0.85, (64, 32768): 1.01, (8, 2048): 0.2}, summary.KEEP_TEXT),  # 2k is below the goal context
    ({(8, 8192): 0.79, (64, 32768): 0.95}, summary.TUNE_TEXT),
    ({(8, 8192): 0.49, (64, 32768): 0.95}, summary.MOSAIC_TEXT),
])
def test_decision_from_the_lowest_share_at_long_contexts(shares, decided):
    line = summary.decision(FULL, {"compiles": COMPILED, "decode": decode_result(shares)})
    assert line.startswith(f"DECISION: {decided} (")


def fallback_result(ratios: list) -> dict:
    """A fallback step's saved result comparing xla with the Pallas backend at these time ratios."""
    return {"comparison": [{"batch": 8, "context": 2048 * (i + 1), "xla_over_pallas": r} for i, r in enumerate(ratios)]}


@pytest.mark.parametrize("ratios, decided", [
    ([2.81, 3.77], summary.MOSAIC_KEEP_TEXT),  # the fallback is slower everywhere: keep the kernels meanwhile
    ([2.81, 0.9], summary.MOSAIC_TEXT),  # faster on one shape
    ([2.81, None], summary.MOSAIC_TEXT),  # one shape not compared
    ([], summary.MOSAIC_TEXT),  # step 6 measured nothing
])
def test_below_half_of_copy_the_fallback_becomes_the_default_only_where_it_is_not_slower(ratios, decided):
    results = {"compiles": COMPILED, "decode": decode_result({(8, 8192): 0.45}), "fallback": fallback_result(ratios)}
    line = summary.decision(FULL, results)
    assert line.startswith(f"DECISION: {decided} ("), line
    if decided == summary.MOSAIC_KEEP_TEXT:
        assert "took 2.81-3.77x the Pallas backend's time on all 2 of step 6's shapes" in line


def test_decision_when_the_kernels_do_not_compile_or_are_wrong_or_were_not_measured():
    failed = {"rows": COMPILED["rows"] + [{"kernel": "paged_decode_attention", "page_size": 8, "ok": False}]}
    good = decode_result({(8, 8192): 0.9})
    assert summary.decision(FULL, {"compiles": failed, "decode": good}).startswith(f"DECISION: {summary.MOSAIC_TEXT}")
    wrong = {"rows": [{"name": "decode bfloat16 num_splits=4", "ok": False}]}
    line = summary.decision(FULL, {"compiles": COMPILED, "checks": wrong, "decode": good})
    assert line.startswith(f"DECISION: {summary.MOSAIC_TEXT} (wrong results")
    assert summary.decision(FULL, {"compiles": COMPILED, "decode": decode_result({(8, 2048): 0.9})}).startswith(
        "DECISION: none")
    assert summary.decision(FULL, {"compiles": COMPILED, "decode": decode_result({(8, 8192): None})}).startswith(
        "DECISION: none")


def test_the_plans_name_real_checks_and_cover_the_issue():
    from pallas_kernels.paged_decode_attention import tuning

    assert set(TINY.check_names) <= set(check_names())
    for plan in (TINY, FULL):  # the first launch and pages per step of a plan are the kernel's defaults
        assert plan.decode_launch[0] == (tuning.TRITON_NUM_WARPS, tuning.TRITON_NUM_STAGES)
        assert plan.decode_pages_per_step[0] == tuning.PAGES_PER_STEP
    assert FULL.check_names is None and FULL.page_sizes == (16, 8)
    assert (FULL.model.heads, FULL.model.kv_heads, FULL.model.head_dim) == (32, 8, 128)
    assert set(FULL.decode_batches) == {8, 64} and set(FULL.decode_contexts) == {2048, 8192, 32768}
    assert {None, 1, 4, 16} <= set(FULL.decode_splits) and FULL.goal_context == 8192
    assert (FULL.e2e["input_len"], FULL.e2e["output_len"], FULL.e2e["model_shape"]) == (1000, 1000, "llama-3.1-8b")


def test_kernels_script_runs_one_check_and_rejects_unknown_names():
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "benchmarks/kernels.py", "--check", "--interpret", "--only"]
    done = subprocess.run(command + ["kv write bfloat16"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "PASS  kv write bfloat16" in done.stdout, done.stdout + done.stderr
    done = subprocess.run(command + ["no such check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no check named" in done.stderr


@pytest.mark.parametrize("plan", [TINY, FULL], ids=["tiny", "full"])
def test_end_to_end_command_parses_for_both_plans(plan, tmp_path):
    from benchmarks.gpu.e2e import command
    from benchmarks.gpu.step import Step
    from jaxserve.cli import build_parser

    argv = command(Step(plan=plan, work_dir=str(tmp_path), deadline=0.0))
    assert argv[1:5] == ["-m", "jaxserve.cli", "bench", "throughput"]
    args = build_parser().parse_args(argv[3:])
    assert (args.model_shape, args.input_len, args.output_len) == (
        plan.e2e["model_shape"], plan.e2e["input_len"], plan.e2e["output_len"])
    assert args.input_len + args.output_len <= args.max_model_len and args.systems == ["jaxserve"]
