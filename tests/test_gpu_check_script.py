"""benchmarks/gpu_check.sh (the one prepared H200 run) runs end to end on the CPU in its tiny plan (Pallas
interpret mode), so a lent H200 is not the first place it can break; its decision rule; the profile step's trace
parser on a hand-made trace; and benchmarks/kernels.py, the correctness checks on their own."""

import json
import os
import re
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
from helpers import FAST_COMPILE_XLA_FLAG, TEST_CACHE_DIR

from benchmarks.gpu import cudnn_paged, flags, profile, summary
from benchmarks.gpu.checks import check_names
from benchmarks.gpu.config import FULL, STEP_NAMES, TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECISIONS = (summary.KEEP_TEXT, summary.TUNE_TEXT, summary.MOSAIC_TEXT, summary.MOSAIC_KEEP_TEXT)


def script_env(tmp_path) -> dict:
    """The environment of a tiny run writing under tmp_path, without the suite's four simulated devices, and
    compiling into the suite's persistent XLA cache (every step and the end-to-end engine), as fast as the suite."""
    return {**os.environ, "GPU_CHECK_TINY": "1", "OUT": str(tmp_path / "out"), "TMPDIR": str(tmp_path),
            "PYTHON": sys.executable, "PYTHONPATH": ROOT, "JAX_COMPILATION_CACHE_DIR": TEST_CACHE_DIR,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
            "XLA_FLAGS": FAST_COMPILE_XLA_FLAG}


def test_gpu_check_runs_end_to_end_in_tiny_mode(tmp_path):
    result = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=script_env(tmp_path),
                            capture_output=True, text=True, timeout=420)
    out = result.stdout
    assert result.returncode == 0, out[-6000:] + result.stderr[-2000:]
    total = len(STEP_NAMES) + 1  # the summary is the last
    assert total == 14
    for number, name in enumerate(STEP_NAMES, 1):  # every step's header, its own result line and the shell's verdict
        assert f"== [{number}/{total}] {name} (limit" in out
        assert f"RESULT {name}: OK" in out
        assert f"-- [{number}/{total}] {name}: ok in" in out
    assert f"== [{total}/{total}] summary" in out
    # a line from each step's measurements
    assert "no deprecation warning" in out or "WARNING TEXT: " in out
    assert "compile paged_decode_attention   pages of 16  OK" in out
    assert "PASS  decode float32 num_splits=3, 2 pages a step" in out
    assert re.search(r"bandwidth add uint32 4 MiB x4 +\d+ GB/s", out)
    assert re.search(r"bandwidth copy uint32 4 MiB x1 +\d+ GB/s", out)
    assert re.search(r"decode B=2 +ctx=64 +splits auto\(1\) warps 8 stages 3 pages/step 1 .* us", out)
    assert re.search(r"decode B=2 +ctx=64 +splits auto\(1\) warps 4 stages 2 pages/step 2 .* us", out)
    assert re.search(r"decode B=2 +ctx=64 +cudnn paged attention +skipped: no GPU", out)  # measured where cuDNN runs
    assert "cuDNN measured on 0/1 shapes, skipped: no GPU" in out
    assert re.search(r"attention backend xla +B=2 .* us", out)
    assert re.search(r"prefill 2 x 16 tokens after 32 +ragged kernel .* TFLOP/s +err vs dense", out)
    assert re.search(r"kv write T=8 .* GB/s", out)
    assert re.search(r"fp8 step fp8 weights \+ fp8 KV +[\d.]+ ms .* bf16's time", out)
    assert re.search(r"flags default \(step 9's bf16\) +[\d.]+ ms", out)
    assert re.search(r"flags dynamic-slice fusion on +[\d.]+ ms .* the default's time", out)
    left_out = [name for name, _ in flags.VARIANTS[1:] if name not in TINY.flag_variants]  # the tiny plan runs one
    assert left_out and all(re.search(rf"flags {re.escape(name)} +not run \(left out of the plan", out)
                            for name in left_out)
    assert re.search(r"profile: trace .* device events from the host events of XLA ops", out)
    for kind in ("decode", "mixed"):  # a table per kind of step, with the sampler's own row and the host gap
        assert re.search(rf"profile {kind}: 2 steps, wall \d+ us a step\n(.*\n)*?  sampler +[\d.]+ +[\d.]+%", out)
        assert re.search(rf"profile {kind}:(.*\n)*?  host gap \(wall - busy\) +-?[\d.]+", out)
    assert re.search(r"hf_peer continuous 4 +\d+ output tok/s", out) or "hf_peer: skipped" in out
    assert re.search(r"hf_peer generate 4 +\d+ output tok/s", out) or "hf_peer: skipped" in out
    assert re.search(r"RESULT e2e: OK \d+ output tok/s .* steps of [\d.]+ ms", out)
    # the decision comes last, and is one of the three (every step measured something)
    decisions = re.findall(r"^DECISION: (.*)$", out, re.M)
    assert decisions and out.rstrip().splitlines()[-2] == f"DECISION: {decisions[-1]}"
    assert decisions[-1].startswith(DECISIONS), decisions[-1]
    written = sorted(os.listdir(tmp_path / "out"))
    dated = [name for name in written if re.fullmatch(r"gpu_check-\d{4}-\d\d-\d\d-cpu\.(json|md)", name)]
    assert sorted(set(written) - set(dated)) == ["e2e_bench.json", "gpu_check.json", "gpu_check.log", "gpu_check.md",
                                                 "profile.trace.json.gz"], written
    assert [name.rsplit(".", 1)[1] for name in dated] == ["json", "md"], written  # the copies named for committing
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report == json.loads((tmp_path / "out" / dated[0]).read_text())
    assert (tmp_path / "out" / "gpu_check.md").read_text() == (tmp_path / "out" / dated[1]).read_text()
    assert report["tiny"] and report["device"] == "cpu" and report["decision"] == f"DECISION: {decisions[-1]}"
    assert all(report["results"][name]["ok"] for name in STEP_NAMES)
    flag_rows = {row["variant"]: row for row in report["results"]["flags"]["rows"]}  # each variant: measured or why not
    assert all("ms" in flag_rows[name] for name in TINY.flag_variants)
    assert all(flag_rows[name]["not_run"] and "ms" not in flag_rows[name] for name in left_out)
    assert [step["name"] for step in report["steps"]] == list(STEP_NAMES)
    headline = report["headline"]  # the end-to-end figures, the profile's breakdown and the ratio to Hugging Face
    assert headline["e2e"]["output_tokens_per_s"] > 0 and headline["e2e"]["steps"] > 0
    assert headline["e2e"]["step_ms"] > 0 and headline["e2e"]["kv_pages"] > 0 and headline["e2e"]["engine_ready_s"] > 0
    assert headline["e2e"]["workload"] == TINY.e2e
    assert headline["e2e"]["host_ms_per_step"]["schedule"] > 0 and headline["e2e"]["rows_per_step"] > 0
    assert set(headline["profile"]) == {"decode", "mixed"}
    assert headline["profile"]["decode"]["categories_us"]["sampler"] > 0
    assert len(report["results"]["profile"]["kinds"]["mixed"]["top_kernels"]) == profile.TOP_KERNELS
    if not report["results"]["hf_peer"].get("skipped"):
        assert headline["jaxserve_over_hf"] > 0
    markdown = (tmp_path / "out" / "gpu_check.md").read_text()
    for text in ("| cuDNN paged µs | cuDNN % copy | cuDNN / kernel |", "| no GPU (backend cpu)",
                 "the bf16 step under XLA flags (step 10): default",
                 f"; not run (left out of the plan): {', '.join(left_out)}", "engine step profile (step 11), decode",
                 "| host gap |", "Hugging Face peer (step 12)",
                 "| output tok/s | requests |", "jaxserve end to end / Hugging Face's best"):
        assert text in markdown
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


def decode_rows() -> list[dict]:
    """Saved decode rows of two shapes: the kernel's settings, and cuDNN's paged attention measured (right on one
    shape, 0.8x the kernel's best time) or skipped."""
    def row(batch, us, **fields):
        return {"batch": batch, "context": 8192, "label": fields.pop("label", "x"), "bytes": 1, "us": us,
                "gb_per_s": 1 / us, "copy_share": 50 / us, "spot_error": 1e-3, **fields}

    return [row(8, 100.0), row(8, 90.0, label="fast"), row(8, 50.0, label="wrong", spot_error=0.5),
            row(8, 72.0, route="cudnn", label=cudnn_paged.LABEL), row(64, 400.0),
            {"batch": 64, "context": 8192, "route": "cudnn", "label": cudnn_paged.LABEL, "bytes": 1,
             "skipped": "no GPU"}]


def test_cudnn_rows_are_compared_with_the_kernels_best_and_never_taken_for_it():
    from benchmarks.gpu import decode

    found = decode.result(decode_rows(), copy=1.0)
    assert [(row["batch"], row["label"]) for row in found["best"]] == [(8, "fast"), (64, "x")]
    (cudnn,) = found["cudnn"]
    assert (cudnn["batch"], cudnn["kernel_us"], cudnn["right"]) == (8, 90.0, True)
    assert cudnn["over_kernel"] == pytest.approx(0.8)
    assert not found["ok"]  # the kernel's wrong row; cuDNN's rows do not count
    assert found["summary"].endswith("1 WRONG; cuDNN measured on 1/2 shapes, skipped: no GPU")
    table = "\n".join(summary.decode_table(FULL, found))
    assert "| 8 | 8192 | fast | 90.0 |" in table and "| 72.0 | 69 | 0.80 |" in table
    assert "| 64 | 8192 | x | 400.0 |" in table and "| no GPU | - | - |" in table


def test_cudnn_page_tables_fill_the_pool_as_jaxs_wrapper_asks():
    table = np.arange(1, 9).reshape(2, 4)  # (B, W): two rows of four pages
    padded = cudnn_paged.padded_page_table(table, 12)
    assert padded.shape == (2, 1, 6, 1) and padded.dtype == np.int32  # B x blocks per row = the pool's pages
    assert padded[:, 0, :4, 0].tolist() == table.tolist() and not padded[:, 0, 4:, 0].any()  # then the null page
    for pool_pages in (13, 6):  # not a multiple of B; fewer pages per row than a row holds
        with pytest.raises(ValueError, match="cannot be split into 2 rows"):
            cudnn_paged.padded_page_table(table, pool_pages)


def test_cudnn_paged_decode_lowers_for_cuda_one_fused_attention_per_call():
    """The dispatch as step 5 runs it on a GPU, lowered for cuda here (cuDNN's version check, which needs the GPU,
    stood in for): shapes jax's wrapper accepts, one cuDNN fused-attention custom call per decode call."""
    import jax
    import jax.numpy as jnp
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    batch, heads, kv_heads, head_dim, page, pool_pages, calls, sets = 2, 4, 2, 64, 16, 16, 3, 2
    qs = jax.ShapeDtypeStruct((calls, batch, heads, head_dim), jnp.bfloat16)
    pool = tuple(jax.ShapeDtypeStruct((pool_pages, page, kv_heads, head_dim), jnp.bfloat16) for _ in range(sets))
    table = jax.ShapeDtypeStruct((batch, 1, pool_pages // batch, 1), jnp.int32)
    seq_lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    with mock.patch.object(cudnn, "check_cudnn_version", return_value=91000):
        traced = cudnn_paged.program(calls, sets).trace(qs, pool, pool, table, seq_lens)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert [out.shape for out in traced.out_info] == [(batch, heads, head_dim)] * calls
    assert text.count("@__cudnn$fmhaSoftmax") == calls


def test_the_plans_name_real_checks_and_cover_the_issue():
    from pallas_kernels.paged_decode_attention import tuning

    assert set(TINY.check_names) <= set(check_names())
    for plan in (TINY, FULL):  # the first launch and pages per step of a plan are the kernel's defaults
        assert plan.decode_launch[0] == (tuning.TRITON_NUM_WARPS, tuning.TRITON_NUM_STAGES)
        assert plan.decode_pages_per_step[0] == tuning.PAGES_PER_STEP
    assert FULL.check_names is None and FULL.page_sizes == (16, 8)
    assert (FULL.model.heads, FULL.model.kv_heads, FULL.model.head_dim) == (32, 8, 128)
    assert set(FULL.decode_batches) == {8, 64} and set(FULL.decode_contexts) == {2048, 8192, 32768}
    # the decode sweep decided already: the kernel's defaults only (auto splits, 4 warps, 2 stages, a page a step)
    assert FULL.decode_splits == (None,) and len(FULL.decode_launch) == len(FULL.decode_pages_per_step) == 1
    assert FULL.goal_context == 8192 and {8192} == set(FULL.fallback_contexts)
    assert (FULL.e2e["input_len"], FULL.e2e["output_len"], FULL.e2e["model_shape"]) == (1000, 1000, "llama-3.1-8b")
    # throughput as a user chasing it runs the engine, the whole workload in one wave
    assert FULL.e2e["max_num_seqs"] >= 256 and FULL.e2e["max_num_batched_tokens"] >= 4096
    assert FULL.e2e["num_requests"] >= FULL.e2e["max_num_seqs"] and FULL.e2e["min_token_bucket"] <= 64
    assert FULL.e2e["input_len"] + FULL.e2e["output_len"] <= FULL.e2e["max_model_len"]
    assert (FULL.profile["model_shape"], FULL.profile["batch"], FULL.profile["chunk"]) == ("llama-3.1-8b", 128, 512)
    hf = FULL.hf_peer  # the Hugging Face peer runs the end-to-end run's model and request shape
    assert (hf["model_shape"], hf["input_len"], hf["output_len"], hf["device"]) == (
        FULL.e2e["model_shape"], FULL.e2e["input_len"], FULL.e2e["output_len"], "cuda")
    assert TINY.hf_peer["device"] == "cpu" and STEP_NAMES[-4:] == ("flags", "profile", "hf_peer", "e2e")
    # every flag variant on a GPU; the tiny plan names real ones (not the default, the baseline it always has)
    assert FULL.flag_variants is None and set(TINY.flag_variants) <= {name for name, _ in flags.VARIANTS[1:]}


def hand_made_trace() -> dict:
    """A Chrome trace shaped like jax's on a GPU: a host process with the step annotations, a device process with a
    stream and the derived lines (which repeat the streams' time and must not count)."""
    def meta(kind, pid, name, tid=None):
        return {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}, **({} if tid is None else {"tid": tid})}

    def event(name, ts, dur, pid=2, tid=10, **args):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}

    forward = {"hlo_module": "jit_profile_forward"}
    events = [meta("process_name", 1, "/host:CPU"), meta("process_name", 2, "/device:GPU:0"),
              meta("thread_name", 1, "python", 5), meta("thread_name", 2, "Stream #7(Kernel,MemcpyD2D)", 10),
              meta("thread_name", 2, "XLA Ops", 11), meta("thread_name", 2, "XLA Modules", 12),
              event("gpu_check profile decode 0", 0, 1000, pid=1, tid=5),
              event("gpu_check profile decode 1", 2000, 1000, pid=1, tid=5),
              event("gpu_check profile mixed 0", 4000, 1500, pid=1, tid=5)]
    for start in (0, 2000):  # two decode steps: the same kernels, at 100 .. 850 us into the step
        events += [event("paged_decode_attention", start + 100, 300, hlo_op="custom-call.3", **forward),
                   event("paged_kv_write", start + 400, 50, **forward),
                   event("nvjet_tst_128x64_64x8_2x1_v_bz_TNN", start + 450, 200),  # no module: the forward's
                   event("loop_multiply_fusion", start + 700, 100),  # no hlo_module: the sampler's, by its span
                   event("mystery_kernel", start + 800, 50, **forward),
                   event("fusion.1", start + 100, 700, tid=11, hlo_op="fusion.1"),  # derived line: not counted
                   event("jit_profile_forward(1)", start + 90, 600, tid=12),
                   event("jit_profile_sampler(2)", start + 690, 120, tid=12)]
    events += [event("ragged_paged_attention", 4100, 400), event("paged_decode_attention", 4450, 200),  # overlaps
               event("cutlass_80_tensorop_bf16_s16816gemm_relu", 4700, 300), event("MemcpyD2D", 5100, 100),
               event("input_reduce_fusion", 6000, 10)]  # after every step: no step's
    return {"traceEvents": events}


def test_profile_breakdown_of_a_hand_made_trace():
    found = profile.breakdown(hand_made_trace())
    assert found["source"] == "device streams of /device:GPU:0"
    assert (found["unassigned_events"], found["unassigned_us"]) == (1, 10.0)
    decode, mixed = found["kinds"]["decode"], found["kinds"]["mixed"]
    assert decode["steps"] == 2 and decode["wall_us"] == 1000 and decode["events_per_step"] == 5
    assert {row["category"]: row["us"] for row in decode["categories"]} == {
        "attention: decode kernel": 300, "KV write": 50, "GEMM": 200, "sampler": 100, "other": 50}
    assert decode["busy_us"] == 700 and decode["host_gap_us"] == 300  # 100-650 and 700-850
    assert decode["categories"][0]["share"] == pytest.approx(0.3)
    assert [k["name"] for k in decode["top_kernels"]][:2] == ["paged_decode_attention",
                                                              "nvjet_tst_128x64_64x8_2x1_v_bz_TNN"]
    assert decode["top_kernels"][0]["calls"] == 1 and decode["top_kernels"][0]["module"] == "jit_profile_forward"
    assert [o["name"] for o in decode["other_names"]] == ["mystery_kernel"]  # unknown names are listed
    assert {row["category"]: row["us"] for row in mixed["categories"]} == {
        "attention: decode kernel": 200, "attention: ragged kernel": 400, "GEMM": 300,
        "copies / transposes / gathers": 100}
    assert mixed["busy_us"] == 950 and mixed["host_gap_us"] == 550  # 4100-4650 overlapping, 4700-5000, 5100-5200
    lines = profile.table("decode", decode)
    assert lines[0] == "profile decode: 2 steps, wall 1000 us a step" and "mystery_kernel (50.0 us)" in lines[-1]


@pytest.mark.parametrize("name, hlo_op, module, long_name, category", [
    ("paged_decode_attention", "", "", "", "attention: decode kernel"),
    ("triton_kernel", "custom-call.7", "", 'custom_call_target="__gpu$xla.gpu.triton", name="ragged_paged_attention"',
     "attention: ragged kernel"),  # known only from the HLO text
    ("paged_kv_write", "", "", "", "KV write"),
    ("gemm_fusion_dot_12_0", "gemm_fusion_dot.12", "", "", "GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "", "", "", "GEMM"),
    ("dot.3", "dot.3", "jit_profile_forward", "", "GEMM"),
    ("loop_add_fusion", "", "", "", "norm / RoPE / elementwise"),
    ("input_reduce_fusion", "", "", "", "norm / RoPE / elementwise"),
    ("wrapped_dynamic_slice", "", "", "", "copies / transposes / gathers"),
    ("pad.2", "", "", "", "copies / transposes / gathers"),
    ("MemcpyD2D", "", "", "", "copies / transposes / gathers"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "", "", "", "collectives"),
    ("sort.1", "sort.1", "", "", "sampler"),  # by name when the module is unknown
    ("loop_add_fusion", "", "jit_profile_sampler", "", "sampler"),  # by module first
    ("mystery_kernel", "custom-call.1", "", "", "other"),
])
def test_profile_categories(name, hlo_op, module, long_name, category):
    assert profile.category_of(name, hlo_op, module, long_name) == category


def test_profile_counts_nested_host_events_once_and_finds_host_ops_without_a_device():
    """On the CPU the ops are host events carrying hlo_op, and a control-flow op holds the ops it runs."""
    def event(name, ts, dur, tid=1):
        return {"ph": "X", "pid": 7, "tid": tid, "name": name, "ts": ts, "dur": dur,
                "args": {"hlo_op": name, "hlo_module": "jit_profile_forward"}}

    events = [event("while.1", 0, 100), event("dot.2", 10, 50), event("add_fusion", 70, 20),
              event("exponential_fusion", 0, 40, tid=2)]
    assert profile.self_times(events) == [30, 50, 20, 40]
    annotation = {"ph": "X", "pid": 7, "tid": 3, "name": "gpu_check profile decode 0", "ts": -5, "dur": 200}
    trace = {"traceEvents": [{"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/host:CPU"}}, annotation,
                             {"ph": "X", "pid": 7, "tid": 1, "name": "end: dot.2", "ts": 60, "dur": 0.1}, *events]}
    found = profile.breakdown(trace)
    assert found["source"].startswith("host events of XLA ops")
    decode = found["kinds"]["decode"]
    assert decode["events_per_step"] == 4 and decode["device_sum_us"] == 140 and decode["busy_us"] == 100
    assert {row["category"]: row["us"] for row in decode["categories"]} == {
        "GEMM": 50, "norm / RoPE / elementwise": 60, "other": 30}


@pytest.mark.parametrize("env, slug", [
    ({"versions": {"device_kind": "NVIDIA H200"}}, "h200"),
    ({"versions": {"device_kind": ""}, "nvidia_smi": "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-12)\nname, ..."}, "h100"),
    ({"versions": {"device_kind": "NVIDIA GeForce RTX 4090"}}, "geforce-rtx-4090"),
    ({}, "unknown-device"),
])
def test_device_slug_names_the_gpu(env, slug):
    assert summary.device_slug(FULL, {"env": env}) == slug
    assert summary.device_slug(TINY, {"env": env}) == "cpu"


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
    assert argv[1:5] == ["-m", "jaxserve", "bench", "throughput"]
    args = build_parser().parse_args(argv[3:])
    assert (args.model_shape, args.input_len, args.output_len) == (
        plan.e2e["model_shape"], plan.e2e["input_len"], plan.e2e["output_len"])
    assert args.input_len + args.output_len <= args.max_model_len and args.systems == ["jaxserve"]
