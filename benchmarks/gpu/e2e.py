"""Step 13: end to end: `jaxserve bench throughput` on the plan's model (on the H200 Llama-3.1-8B's shape
with random weights made on the device) with a fixed workload, 1000 input and 1000 output tokens per
request, the workload of TensorRT-LLM's published H200 table, at the batch sizes a user chasing throughput
would set (the plan's max_num_seqs and max_num_batched_tokens), for as long as the step's limit allows.

The command runs in a child process, its output passed through as it comes; it is stopped shortly
before the step's limit, or right after its timed run when the engine-overhead runs that follow could not
end in time (OVERHEAD_RUNS). It compiles into a fresh XLA cache (start-up time is part of the measurement)
unless JAX_COMPILATION_CACHE_DIR names a persistent one, as the tests do. Read from its log: the
engine's start-up time (compiling every bucket counts), its KV pages, and the timed run's output tokens/s and
engine steps (a step's mean time: the run's seconds / steps) with the host's milliseconds per step by phase,
the device's idle share and the requests running a step, which `bench throughput` prints as soon as that
run finishes, so a run stopped later (in its engine-overhead replay, say) still gives its throughput.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

from benchmarks.gpu.step import Step

STOP_GRACE_S = 10  # after SIGTERM, this long before SIGKILL
POLL_S = 0.5  # how often the step looks whether the child is done or must stop
# After its timed run, `bench throughput` measures the engine's overhead: one more recorded run of the workload and
# its replay, about this many times the timed run. When that cannot end before the deadline, the step stops the
# child as soon as the timed run's throughput is printed (step 11's host gap measures the same thing per step)
# instead of letting it run on until the deadline.
OVERHEAD_RUNS = 2.5
OVERHEAD_MARGIN_S = 15
# A GPU smaller than the plan's (an H100's 80 GB against the 67 GB of KV that 256 rows of 2000 tokens take at the 8B
# shape, beside 16 GB of weights) gets the KV pages that fit: this share of its memory less the weights and this
# much room for activations and XLA's workspace; the engine then queues or preempts rows instead of failing.
MEMORY_SHARE, HEADROOM_BYTES = 0.9, 8e9
ENGINE_READY = re.compile(r"jaxserve: engine ready in ([\d.]+)s \((\d+) KV pages\)")
TIMED_RUN = re.compile(r"jaxserve: ([\d.]+)s, ([\d.]+) output tok/s, (\d+) steps")
HOST_TIMING = re.compile(r"jaxserve host ms per step: (.*); device idle ([\d.]+)%; ([\d.]+) requests running a step")


def command(step: Step) -> list[str]:
    """The `jaxserve bench throughput` command line of the plan's end-to-end run."""
    e2e = step.plan.e2e
    options = {
        "--model-shape": e2e["model_shape"], "--systems": "jaxserve", "--num-requests": e2e["num_requests"],
        "--input-len-dist": "fixed", "--input-len": e2e["input_len"], "--output-len-dist": "fixed",
        "--output-len": e2e["output_len"], "--max-model-len": e2e["max_model_len"], "--page-size": e2e["page_size"],
        "--max-num-seqs": e2e["max_num_seqs"], "--max-num-batched-tokens": e2e["max_num_batched_tokens"],
        "--min-token-bucket": e2e["min_token_bucket"], "--repeats": 1, "--warmup-requests": e2e["warmup_requests"],
        "--warmup-tokens": e2e["warmup_tokens"], "--check-requests": 0,
        "--cache-dir": os.path.join(step.work_dir, "e2e-cache"),
        "--json": os.path.join(step.work_dir, "e2e_bench.json"),
    }
    if (pages := pages_that_fit(step)) is not None:
        options["--num-pages"] = pages
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # a persistent cache the caller chose (the tests' shared one)
        options["--compilation-cache-dir"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
    return [sys.executable, "-m", "jaxserve", "bench", "throughput"] + [
        str(part) for option, value in options.items() for part in (option, value)]


def pages_that_fit(step: Step) -> int | None:
    """KV pages for a GPU too small for bench's default (max_num_seqs whole requests), from the memory nvidia-smi
    reported in step 1; None when the default fits or nothing says what the GPU holds."""
    from jaxserve.bench.models import SHAPES

    e2e = step.plan.e2e
    found = re.search(r"\n[^\n]*?, (\d+) MiB", str((step.load("env") or {}).get("nvidia_smi", "")))
    shape = SHAPES.get(e2e["model_shape"])
    if not found or shape is None:
        return None
    page_bytes = shape.num_layers * 2 * e2e["page_size"] * shape.num_kv_heads * shape.head_dim * 2  # bf16 K and V
    weights = shape.num_params * 2
    fit = int((MEMORY_SHARE * int(found[1]) * 2**20 - weights - HEADROOM_BYTES) // page_bytes)
    default = 1 + e2e["max_num_seqs"] * -(-(e2e["input_len"] + e2e["output_len"]) // e2e["page_size"])
    return fit if fit < default else None


def run_with_deadline(argv: list[str], seconds: float, stop_after=None) -> tuple[int | None, list[str]]:
    """Run `argv`, echoing its output line by line; stop it after `seconds`, or as soon as it prints a line
    for which `stop_after(line)` is true. (exit code or None when stopped, lines)."""
    lines: list[str] = []
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    stop_now = threading.Event()

    def echo():
        for line in child.stdout:
            lines.append(line.rstrip("\n"))
            print(f"  | {lines[-1]}", flush=True)
            if stop_after is not None and stop_after(lines[-1]):
                stop_now.set()

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    deadline = time.monotonic() + max(seconds, 1.0)
    code = None
    while code is None and not stop_now.is_set() and time.monotonic() < deadline:
        try:
            code = child.wait(timeout=min(POLL_S, max(deadline - time.monotonic(), 0.01)))
        except subprocess.TimeoutExpired:
            pass
    if code is None:
        child.terminate()
        try:
            child.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        code = None
    reader.join(timeout=5)
    return code, lines


def parse(lines: list[str]) -> dict:
    """The engine's start-up seconds and the timed run's numbers, where the log has them."""
    found = {}
    for line in lines:
        if match := ENGINE_READY.search(line):
            found["engine_ready_s"], found["kv_pages"] = float(match[1]), int(match[2])
        if match := TIMED_RUN.search(line):
            found.update(run_s=float(match[1]), output_tokens_per_s=float(match[2]), steps=int(match[3]))
            found["step_ms"] = 1e3 * found["run_s"] / max(found["steps"], 1)
        if match := HOST_TIMING.search(line):  # the timed run's host time per step by phase
            phases = dict(part.rsplit(" ", 1) for part in match[1].split(", "))
            found["host_ms_per_step"] = {phase: float(ms) for phase, ms in phases.items()}
            found["device_idle_percent"], found["rows_per_step"] = float(match[2]), float(match[3])
    return found


def run(step: Step) -> dict:
    """Step 13: the end-to-end run until done or the step's deadline; its output tokens/s when measured."""
    argv = command(step)
    seconds = step.deadline - time.monotonic()
    print(f"running for at most {seconds:.0f} s: {' '.join(argv[1:])}", flush=True)
    started = time.monotonic()
    stopped_early = []

    timed_run_s = []  # the timed run's seconds, once printed

    def no_time_for_overhead(line: str) -> bool:  # asked at its host-timing line, the last about the timed run
        if match := TIMED_RUN.search(line):
            timed_run_s.append(float(match[1]))
        if (HOST_TIMING.search(line) and timed_run_s
                and time.monotonic() + OVERHEAD_RUNS * timed_run_s[0] + OVERHEAD_MARGIN_S > step.deadline):
            stopped_early.append(line)
            print("(stopping it after its timed run: the engine-overhead runs that follow would not end in time)",
                  flush=True)
            return True
        return False

    code, lines = run_with_deadline(argv, seconds, no_time_for_overhead)
    found = parse(lines)
    e2e = step.plan.e2e
    if stopped_early:
        ended = "stopped after its timed run"
    else:
        ended = "finished" if code == 0 else f"exit {code}" if code is not None else f"stopped after {seconds:.0f} s"
    result = {"command": argv, "exit": code, "ended": ended, "wall_s": time.monotonic() - started, "workload": e2e,
              **found}
    if "output_tokens_per_s" in found:
        summary = (f"{found['output_tokens_per_s']:.0f} output tok/s ({e2e['num_requests']} requests x "
                   f"{e2e['input_len']} in / {e2e['output_len']} out, up to {e2e['max_num_seqs']} rows and "
                   f"{e2e['max_num_batched_tokens']} tokens a step, {e2e['model_shape']}; timed run "
                   f"{found['run_s']:.1f} s, {found['steps']} steps of {found['step_ms']:.1f} ms, after start-up in "
                   f"{found.get('engine_ready_s', float('nan')):.0f} s; {ended})")
    else:
        ready = f"engine ready in {found['engine_ready_s']:.0f} s" if "engine_ready_s" in found else "engine not ready"
        summary = f"no timed run finished ({ready}; {ended})"
    return {"ok": "output_tokens_per_s" in found, "summary": summary, **result}
