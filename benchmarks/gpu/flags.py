"""Step 10: the whole 8B decode step (step `fp8`'s bf16 mode: random weights, B rows at context C) under XLA flag
variants, each in its own process (XLA reads XLA_FLAGS once, when the backend starts): time per step and its
ratio to the default flags.

Why: a decode step must read every weight once, and the layers run as one `lax.scan` over weights stacked
(L, ...), so each layer's weights reach its GEMMs through a dynamic slice of the stack. Unless XLA fuses that
slice into the GEMM's operand (its dynamic-slice fusion, off by default in the XLA of jax 0.10-0.11), the
slice is a copy: each weight read, written and read again, 3x the floor's weight traffic. The 2026-12-04
H200 run measured the bf16 step at B64 ctx 2k in 20.3 ms where reading the 16 GB of weights once (3.9 ms) and
the 17 GB of KV at the decode kernel's measured 54% of copy bandwidth (7.7 ms) explain about 12: two more
passes over the weights (7.3 ms) would explain the rest. A variant much faster than the default names a flag
the engine should set on GPUs; command buffers (CUDA graphs) off shows what they are worth.

    python -m benchmarks.gpu flags --work-dir DIR --limit-s 75 [--tiny]

The tiny plan runs one variant on the CPU (XLA accepts the GPU flags there and ignores them, so every other
variant would run the same code again, each in a process of its own); the others are rows saying they were not
run. Its numbers only show that the code runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from benchmarks.gpu.step import Step, error_text

# (name, XLA flags added to the environment's); the first is the baseline every ratio is against, measured only
# when step 9 left no bf16 step (the same measurement under the same flags)
# (XLA turned dynamic-slice fusion on by default in mid 2026: `off` tells whether this jaxlib already has it)
VARIANTS = (
    ("default", ""),
    ("dynamic-slice fusion on", "--xla_gpu_enable_dynamic_slice_fusion=true"),
    ("dynamic-slice fusion off", "--xla_gpu_enable_dynamic_slice_fusion=false"),
    ("no command buffers", "--xla_gpu_enable_command_buffer="),
)
RESULT_PREFIX = "FLAGS_RESULT "  # the child's one line of JSON
# why a variant the plan leaves out (plan.flag_variants: the tiny plan's one) has no measurement
NOT_IN_PLAN = "left out of the plan: every variant runs the same code under other XLA flags"


def run(step: Step) -> dict:
    """Time the decode step under each variant of the plan, each in a child process, against step 9's bf16 step
    (the same measurement under the default flags; measured here too when step 9 has none); ok when every variant
    the plan runs was measured (the others are rows saying so)."""
    fp8_rows = (step.load("fp8") or {}).get("rows", [])
    baseline = next((row for row in fp8_rows if row.get("mode") == "bf16" and "ms" in row), None)
    rows, variants = [], VARIANTS
    if baseline is not None:
        rows.append({"variant": "default (step 9's bf16)", "flags": "", **baseline})
        print(f"flags {rows[0]['variant']:<26} {baseline['ms']:8.2f} ms (best {baseline['ms_best']:.2f})", flush=True)
        variants = VARIANTS[1:]
    chosen = step.plan.flag_variants  # None: every variant
    for name, flags in variants:
        if chosen is not None and name != VARIANTS[0][0] and name not in chosen:  # the default (baseline) always runs
            rows.append({"variant": name, "flags": flags, "not_run": NOT_IN_PLAN})
            print(f"flags {name:<26} not run ({NOT_IN_PLAN})", flush=True)
            continue
        left = step.deadline - time.monotonic()
        if left < 10:
            rows.append({"variant": name, "flags": flags, "skipped": "out of time"})
            print(f"flags {name:<26} skipped: out of time", flush=True)
            continue
        row = {"variant": name, "flags": flags, **child_measurement(step, flags, left)}
        rows.append(row)
        if "ms" in row:
            default = rows[0].get("ms")
            row["over_default"] = row["ms"] / default if default else None
            ratio = "" if row["over_default"] is None else f"  {row['over_default']:.2f}x the default's time"
            print(f"flags {name:<26} {row['ms']:8.2f} ms (best {row['ms_best']:.2f})  {row['gb_per_s']:.0f} GB/s"
                  f"{ratio}", flush=True)
        else:
            print(f"flags {name:<26} FAILED {row['error']}", flush=True)
    done = [row for row in rows if "ms" in row]
    planned = [row for row in rows if "not_run" not in row]
    summary = "; ".join(f"{row['variant']} {row['ms']:.2f} ms" for row in done) or "nothing measured"
    if len(planned) < len(rows):
        summary += "; not run (left out of the plan): " + ", ".join(row["variant"] for row in rows if "not_run" in row)
    return {"ok": len(done) == len(planned), "summary": summary, "rows": rows, "plan": step.plan.fp8}


def child_measurement(step: Step, flags: str, seconds: float) -> dict:
    """The bf16 decode step measured in a child process whose XLA_FLAGS add `flags`; {"error": ...} on failure."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(part for part in (env.get("XLA_FLAGS", ""), flags) if part)
    argv = [sys.executable, "-m", "benchmarks.gpu.flags", "--work-dir", step.work_dir, "--seed", str(step.seed)]
    argv += ["--tiny"] if step.plan.tiny else []
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {seconds:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {done.returncode}: {' | '.join(tail)}"}


def child_main() -> None:
    """In the child: measure the bf16 step (benchmarks/gpu/fp8.py's `measure`) and print it as one JSON line."""
    import argparse

    from benchmarks.gpu.config import plan_for
    from benchmarks.gpu.fp8 import measure

    parser = argparse.ArgumentParser()
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    step = Step(plan=plan_for(args.tiny), work_dir=args.work_dir, deadline=float("inf"), seed=args.seed)
    try:
        result = measure(step, "none", "auto")
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        result = {"error": error_text(exc)}
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    child_main()
