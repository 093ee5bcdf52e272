"""Step 14: the summary of every step's saved result, compact (the device tool returns only the last
12,000 characters of output), written as gpu_check.json and gpu_check.md, and the decision line; with
the headline figures (the end-to-end throughput, its step time and set-up, the profile's breakdown of an
engine step, the Hugging Face peer and jaxserve's ratio to it) also under "headline" in the JSON. The same
two files are also written as gpu_check-<UTC date>-<device>.json and .md (device: h200, h100, ... from the
GPU's name; cpu in the tiny plan), named for committing into docs/bench/gpu/ as they are.

The decision, from the decode kernel's best setting at every shape with context >= the plan's goal
context (step 5), against the copy bandwidth (step 4):
- "keep the Triton kernels" when every such shape reaches >= 80% of copy bandwidth;
- "tune them" when the lowest is 50-80%;
- "make the fallback the default and write the Mosaic GPU decode kernel" below 50%, or when the kernels
  do not compile (step 2) or give wrong results at their default settings (step 3);
- but below 50% with the kernels compiling and right, when step 6 compared the `xla` fallback with the
  Pallas backend on every one of its shapes and the fallback was slower on each, making it the default
  would make serving slower, so the line says to write the Mosaic GPU kernel and keep the Pallas kernels
  as `auto`'s choice until it lands (a shape step 6 did not finish leaves the line above).
Without a measurement to decide on, the line says what is missing.
"""

from __future__ import annotations

import datetime
import json
import os
import re

from benchmarks.gpu.config import STEP_NAMES, Plan
from benchmarks.gpu.step import load_result, load_statuses

KEEP, TUNE = 0.80, 0.50
KEEP_TEXT = "keep the Triton kernels"
TUNE_TEXT = "tune them"
MOSAIC_TEXT = "make the fallback the default and write the Mosaic GPU decode kernel"
MOSAIC_KEEP_TEXT = "write the Mosaic GPU decode kernel and keep the Pallas kernels as auto's choice until it lands"
ATTENTION_KERNELS = ("ragged_paged_attention", "paged_decode_attention")


def decision(plan: Plan, results: dict) -> str:
    """The DECISION line (see the module docstring)."""
    compiles = results.get("compiles") or {}
    not_compiling = [f"{row['kernel']} (pages of {row['page_size']})" for row in compiles.get("rows", [])
                     if row["kernel"] in ATTENTION_KERNELS and not row["ok"]]
    if not_compiling:
        return f"DECISION: {MOSAIC_TEXT} (they do not compile: {', '.join(not_compiling)})"
    wrong = [row["name"] for row in (results.get("checks") or {}).get("rows", [])
             if not row["ok"] and "pages a step" not in row["name"] and not row["name"].startswith("kv write")]
    if wrong:
        return f"DECISION: {MOSAIC_TEXT} (wrong results at their default settings: {', '.join(wrong)})"
    best = [row for row in (results.get("decode") or {}).get("best", []) if row["context"] >= plan.goal_context]
    if not compiles.get("rows"):
        return "DECISION: none (step 2 did not say whether the kernels compile)"
    if not best or any(row.get("copy_share") is None for row in best):
        return (f"DECISION: none (decode at context >= {plan.goal_context} not measured against a copy bandwidth; "
                f"steps 4-5 did not finish)")
    lowest = min(best, key=lambda row: row["copy_share"])
    spread = (f"decode at context >= {plan.goal_context}, best settings: lowest {100 * lowest['copy_share']:.0f}% "
              f"of copy bandwidth at B={lowest['batch']} ctx={lowest['context']}, highest "
              f"{100 * max(row['copy_share'] for row in best):.0f}%, {len(best)} shapes")
    if lowest["copy_share"] >= KEEP:
        return f"DECISION: {KEEP_TEXT} ({spread})"
    if lowest["copy_share"] >= TUNE:
        return f"DECISION: {TUNE_TEXT} ({spread})"
    ratios = [line.get("xla_over_pallas") for line in (results.get("fallback") or {}).get("comparison", [])]
    if ratios and all(ratio is not None and ratio > 1 for ratio in ratios):
        return (f"DECISION: {MOSAIC_KEEP_TEXT} ({spread}; the xla fallback took {min(ratios):.2f}-{max(ratios):.2f}x "
                f"the Pallas backend's time on all {len(ratios)} of step 6's shapes)")
    return f"DECISION: {MOSAIC_TEXT} ({spread})"


def fmt(value, spec: str = ".1f", missing: str = "-") -> str:
    """A number in `spec`, or `missing` for None."""
    return missing if value is None else format(value, spec)


def steps_table(statuses: list[dict], results: dict) -> list[str]:
    """Markdown: every step's exit status, seconds and one-line result."""
    lines = ["| step | status | s | result |", "| --- | --- | ---: | --- |"]
    for status in statuses:
        result = results.get(status["name"]) or {}
        state = {0: "ok", 124: "TIMED OUT", 137: "KILLED"}.get(status["rc"], f"FAIL (exit {status['rc']})")
        if status.get("skipped"):
            state = "SKIPPED"
        summary = result.get("summary") or status.get("skipped") or "no result saved"
        lines.append(f"| {status['number']} {status['name']} | {state} | {status['seconds']} | {summary} |")
    return lines


def decode_table(plan: Plan, decode: dict) -> list[str]:
    """Markdown: per decode shape, the kernel's best setting, its default setting (auto splits) and cuDNN's paged
    attention (its time, share of copy and time over the kernel's best, or why it has none)."""
    lines = ["| B | ctx | best setting | µs | GB/s | % copy | default µs | default % copy | cuDNN paged µs "
             "| cuDNN % copy | cuDNN / kernel |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    defaults = {(row["batch"], row["context"]): row for row in decode.get("rows", [])
                if plan.is_default(row) and "us" in row}
    tried = {(row["batch"], row["context"]): row for row in decode.get("rows", []) if row.get("route") == "cudnn"}
    measured = {(row["batch"], row["context"]): row for row in decode.get("cudnn", [])}
    share = lambda row: None if row.get("copy_share") is None else 100 * row["copy_share"]  # noqa: E731
    for row in decode.get("best", []):
        key = (row["batch"], row["context"])
        default, cudnn, why = defaults.get(key, {}), measured.get(key), tried.get(key, {})
        if cudnn is not None:
            cells = (f"{cudnn['us']:.1f}{'' if cudnn['right'] else ' WRONG'} | {fmt(share(cudnn), '.0f')} | "
                     f"{fmt(cudnn['over_kernel'], '.2f')}")
        else:
            cells = f"{why.get('skipped') or ('FAIL' if 'error' in why else '-')} | - | -"
        lines.append(f"| {row['batch']} | {row['context']} | {row['label']} | {row['us']:.1f} | {row['gb_per_s']:.0f} "
                     f"| {fmt(share(row), '.0f')} | {fmt(default.get('us'))} | {fmt(share(default), '.0f')} "
                     f"| {cells} |")
    return lines


def fallback_table(fallback: dict) -> list[str]:
    """Markdown: xla backend against the Pallas backend and the bare decode kernel."""
    lines = ["| B | ctx | xla µs | pallas backend µs | decode kernel µs | xla / pallas |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for line in fallback.get("comparison", []):
        lines.append(f"| {line['batch']} | {line['context']} | {fmt(line['xla_us'])} | {fmt(line['pallas_us'])} | "
                     f"{fmt(line['kernel_us'])} | {fmt(line.get('xla_over_pallas'), '.2f')} |")
    return lines


def prefill_table(prefill: dict) -> list[str]:
    """Markdown: TFLOP/s of each prefill implementation."""
    lines = ["| rows x new tokens | cached | implementation | µs | TFLOP/s | err vs dense |",
             "| --- | ---: | --- | ---: | ---: | ---: |"]
    for row in prefill.get("rows", []):
        if "us" in row:
            lines.append(f"| {row['chunks']} x {row['chunk_len']} | {row['prefix']} | {row['name']} | "
                         f"{row['us']:.1f} | {row['tflop_per_s']:.1f} | {fmt(row.get('error_vs_dense'), '.1e')} |")
        else:
            lines.append(f"| | {row['prefix']} | {row['name']} | {row.get('skipped') or row.get('error', '')} | | |")
    return lines


def report(plan: Plan, statuses: list[dict], results: dict, decided: str) -> str:
    """The whole summary as markdown."""
    env = results.get("env") or {}
    versions = env.get("versions", {})
    bandwidth = results.get("bandwidth") or {}
    e2e = results.get("e2e") or {}
    kv = results.get("kv_write") or {}
    lines = ["# GPU check" + (" (tiny plan: Pallas interpret mode on the CPU; the numbers only show the script runs)"
                              if plan.tiny else ""), ""]
    lines += [f"jax {versions.get('jax', '?')}, jaxlib {versions.get('jaxlib', '?')}, backend "
              f"{versions.get('backend', '?')}; CUDA runtime {versions.get('cuda_runtime_get_version', '-')}, "
              f"driver {versions.get('cuda_driver_get_version', '-')}, cuDNN {versions.get('cudnn_get_version', '-')}",
              f"deprecation warnings: {'; '.join(env.get('warnings', [])) or 'none'}", ""]
    lines += steps_table(statuses, results) + [""]
    copies = [f"{row['variant']} {row['gb_per_s']:.0f}" for row in bandwidth.get("rows", []) if "gb_per_s" in row]
    lines += [f"copy bandwidth GB/s: {', '.join(copies) or 'not measured'}; "
              f"best {fmt(bandwidth.get('gb_per_s'), '.0f')}", ""]
    lines += ["decode (step 5), best setting per shape:", ""] + decode_table(plan, results.get("decode") or {}) + [""]
    lines += ["fallback (step 6), decode:", ""] + fallback_table(results.get("fallback") or {}) + [""]
    lines += ["prefill (step 7):", ""] + prefill_table(results.get("prefill") or {}) + [""]
    writes = [f"T={row['tokens']} {row['us']:.1f} µs {row['gb_per_s']:.0f} GB/s" for row in kv.get("rows", [])
              if "us" in row]
    lines += [f"kv write (step 8): {', '.join(writes) or 'not measured'}", ""]
    fp8_rows = [f"{row['mode']} {row['ms']:.2f} ms ({row['over_bf16']:.2f}x)" for row in
                (results.get("fp8") or {}).get("rows", []) if row.get("over_bf16") is not None]
    lines += [f"8B decode step (step 9): {', '.join(fp8_rows) or 'not measured'}", ""]
    flags = (results.get("flags") or {}).get("rows", [])
    flag_rows = [f"{row['variant']} {row['ms']:.2f} ms" + (f" ({row['over_default']:.2f}x)" if row.get("over_default")
                                                           else "")
                 for row in flags if "ms" in row]
    not_run = [row["variant"] for row in flags if "not_run" in row]  # variants the plan leaves out (the tiny one's)
    lines += [f"the bf16 step under XLA flags (step 10): {', '.join(flag_rows) or 'not measured'}"
              + (f"; not run (left out of the plan): {', '.join(not_run)}" if not_run else ""), ""]
    lines += profile_lines(results.get("profile") or {})
    lines += hf_lines(results.get("hf_peer") or {}) + [""]
    lines += e2e_lines(e2e) + [""]
    ratio = headline(results)["jaxserve_over_hf"]
    best = (results.get("hf_peer") or {}).get("best") or {}
    lines += [f"jaxserve end to end / Hugging Face's best ({best.get('system', 'none measured')}): "
              f"{fmt(ratio, '.2f')}x output tok/s", "", decided]
    return "\n".join(lines)


def profile_lines(profile: dict) -> list[str]:
    """Markdown: per kind of step (step 11), device time by category and the host gap, per step."""
    if not profile.get("kinds"):
        return [f"engine step profile (step 11): {profile.get('summary', 'no result saved')}", ""]
    lines = []
    for kind, found in profile["kinds"].items():
        shape = (profile.get("shapes") or {}).get(kind, {})
        lines += [f"engine step profile (step 11), {kind}: {shape.get('rows', '?')} rows, {shape.get('tokens', '?')} "
                  f"tokens, context {shape.get('context', '?')}, {profile.get('model_shape', '?')}, "
                  f"{profile.get('backend', '?')} attention; {found['steps']} steps, events from the "
                  f"{profile.get('source', '?')}:", "",
                  "| category | µs / step | % of step |", "| --- | ---: | ---: |"]
        lines += [f"| {row['category']} | {row['us']:.1f} | {100 * row['share']:.1f} |" for row in found["categories"]]
        lines += [f"| {label} | {found[key]:.1f} | {100 * found[key] / found['wall_us']:.1f} |"
                  for label, key in (("device busy", "busy_us"), ("host gap", "host_gap_us"), ("step", "wall_us"))]
        if found.get("other_names"):
            named = [f"{o['name'][:60]} {o['us']:.1f} µs" for o in found["other_names"][:8]]
            lines += ["", "other: " + ", ".join(named)]
        lines.append("")
    return lines


def hf_lines(hf: dict) -> list[str]:
    """Markdown: each Hugging Face configuration (step 12): measured, estimated or skipped."""
    if not hf.get("rows"):
        return [f"Hugging Face peer (step 12): {hf.get('summary', 'no result saved')}"]
    lines = [f"Hugging Face peer (step 12): transformers {hf.get('transformers', '?')}, torch {hf.get('torch', '?')}, "
             f"{hf.get('sampling', '')}:", "",
             "| configuration | requests | output tok/s | s | step ms | estimate tok/s | note |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in hf["rows"]:
        note = row.get("error") or row.get("cut") or row.get("skipped") or ""
        lines.append(f"| {row['system']} | {row.get('requests', '-')} | {fmt(row.get('output_tokens_per_s'), '.0f')} | "
                     f"{fmt(row.get('seconds'))} | {fmt(row.get('step_ms'))} | "
                     f"{fmt(row.get('estimated_tokens_per_s'), '.0f')} | {note} |")
    return lines


def e2e_lines(e2e: dict) -> list[str]:
    """Markdown: the end-to-end run (step 13): throughput, steps, step time, set-up and workload."""
    workload = e2e.get("workload") or {}
    lines = [f"end to end (step 13): {e2e.get('summary', 'no result saved')}"]
    if "output_tokens_per_s" in e2e:
        lines += ["", "| output tok/s | requests | in / out | rows | tokens a step | steps | ms a step | run s | "
                      "start-up s | KV pages |",
                  "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
                  f"| {e2e['output_tokens_per_s']:.0f} | {workload.get('num_requests', '?')} | "
                  f"{workload.get('input_len', '?')} / {workload.get('output_len', '?')} | "
                  f"{workload.get('max_num_seqs', '?')} | {workload.get('max_num_batched_tokens', '?')} | "
                  f"{e2e['steps']} | {fmt(e2e.get('step_ms'))} | {e2e['run_s']:.1f} | "
                  f"{fmt(e2e.get('engine_ready_s'))} | {e2e.get('kv_pages', '-')} |"]
    if "host_ms_per_step" in e2e:
        lines += ["", "host ms per step (timed run): " + ", ".join(f"{phase} {ms:.2f}" for phase, ms in
                                                                 e2e["host_ms_per_step"].items())
                  + f"; device idle {e2e['device_idle_percent']:.1f}% of the step loop; "
                    f"{e2e['rows_per_step']:.1f} requests running a step"]
    return lines


def headline(results: dict) -> dict:
    """The figures to compare across runs: end to end, the Hugging Face peer and the ratio, the profile."""
    e2e = results.get("e2e") or {}
    hf = results.get("hf_peer") or {}
    best = hf.get("best") or {}
    ours, theirs = e2e.get("output_tokens_per_s"), best.get("output_tokens_per_s")
    profile = {kind: {"wall_ms": found["wall_us"] / 1e3, "host_gap_share": found["host_gap_us"] / found["wall_us"],
                      "categories_us": {row["category"]: row["us"] for row in found["categories"]}}
               for kind, found in ((results.get("profile") or {}).get("kinds") or {}).items()}
    return {
        "e2e": {key: e2e.get(key) for key in ("output_tokens_per_s", "steps", "step_ms", "run_s", "engine_ready_s",
                                              "kv_pages", "workload", "ended", "host_ms_per_step",
                                              "device_idle_percent", "rows_per_step")},
        "hf_peer_best": {key: best.get(key) for key in ("system", "requests", "output_tokens_per_s")} if best else None,
        "jaxserve_over_hf": ours / theirs if ours and theirs else None,
        "profile": profile,
    }


def device_slug(plan: Plan, results: dict) -> str:
    """A short name of the device for file names: 'cpu' in the tiny plan, else from the GPU's name ('NVIDIA H200'
    -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100'), jax's device kind or nvidia-smi's list."""
    if plan.tiny:
        return "cpu"
    env = results.get("env") or {}
    names = [str(env.get("versions", {}).get("device_kind", ""))]
    names += re.findall(r"GPU \d+: ([^(\n]+)", str(env.get("nvidia_smi", "")))
    for name in names:
        if match := re.search(r"\b([a-z]{1,3}\d{2,4}[a-z]?)\b", name.lower()):
            return match[1]
    for name in names:
        if slug := re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-"):
            return slug
    return "unknown-device"


def dated_name(plan: Plan, results: dict, extension: str) -> str:
    """gpu_check-<UTC date>-<device>.<extension>: the name a run's file is committed under."""
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return f"gpu_check-{day}-{device_slug(plan, results)}.{extension}"


def run(plan: Plan, work_dir: str, out_dir: str | None) -> int:
    """Print the summary and the decision; write gpu_check.json and gpu_check.md under `out_dir`, and their dated
    copies. Exit 0."""
    results = {name: load_result(work_dir, name) for name in STEP_NAMES}
    statuses = load_statuses(work_dir)
    decided = decision(plan, results)
    text = report(plan, statuses, results, decided)
    written = []
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        document = {"tiny": plan.tiny, "device": device_slug(plan, results), "decision": decided,
                    "headline": headline(results), "steps": statuses, "results": results}
        for name in ("gpu_check.json", dated_name(plan, results, "json")):
            with open(os.path.join(out_dir, name), "w") as f:
                json.dump(document, f, indent=1, default=str)
            written.append(name)
        for name in ("gpu_check.md", dated_name(plan, results, "md")):
            with open(os.path.join(out_dir, name), "w") as f:
                f.write(text + "\n")
            written.append(name)
    print(text, flush=True)
    if written:
        print(f"(written under {out_dir}: {', '.join(written)})")
    print(decided, flush=True)
    return 0
