"""Step 10: end to end: `jaxserve bench throughput` on the plan's model (on the H200 Llama-3.1-8B's shape
with random weights made on the device) with a fixed workload, 1000 input and 1000 output tokens per
request, the workload of TensorRT-LLM's published H200 table, for as long as the step's limit allows.

The command runs in a child process, its output passed through as it comes; it is stopped shortly
before the step's limit. It compiles into a fresh XLA cache (start-up time is part of the measurement)
unless JAX_COMPILATION_CACHE_DIR names a persistent one, as the tests do. Read from its log: the
engine's start-up time (compiling every bucket counts) and the timed run's output tokens/s, which
`bench throughput` prints as soon as that run finishes, so a run stopped later (in its engine-overhead
replay, say) still gives its throughput.
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
ENGINE_READY = re.compile(r"jaxserve: engine ready in ([\d.]+)s \((\d+) KV pages\)")
TIMED_RUN = re.compile(r"jaxserve: ([\d.]+)s, ([\d.]+) output tok/s, (\d+) steps")


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
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # a persistent cache the caller chose (the tests' shared one)
        options["--compilation-cache-dir"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
    return [sys.executable, "-m", "jaxserve.cli", "bench", "throughput"] + [
        str(part) for option, value in options.items() for part in (option, value)]


def run_with_deadline(argv: list[str], seconds: float) -> tuple[int | None, list[str]]:
    """Run `argv`, echoing its output line by line; stop it after `seconds`. (exit code or None, lines)."""
    lines: list[str] = []
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def echo():
        for line in child.stdout:
            lines.append(line.rstrip("\n"))
            print(f"  | {lines[-1]}", flush=True)

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    try:
        code = child.wait(timeout=max(seconds, 1.0))
    except subprocess.TimeoutExpired:
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
    return found


def run(step: Step) -> dict:
    """Step 10: the end-to-end run until done or the step's deadline; its output tokens/s when measured."""
    argv = command(step)
    seconds = step.deadline - time.monotonic()
    print(f"running for at most {seconds:.0f} s: {' '.join(argv[1:])}", flush=True)
    started = time.monotonic()
    code, lines = run_with_deadline(argv, seconds)
    found = parse(lines)
    e2e = step.plan.e2e
    ended = "finished" if code == 0 else f"exit {code}" if code is not None else f"stopped after {seconds:.0f} s"
    result = {"command": argv, "exit": code, "wall_s": time.monotonic() - started, "workload": e2e, **found}
    if "output_tokens_per_s" in found:
        summary = (f"{found['output_tokens_per_s']:.0f} output tok/s ({e2e['num_requests']} requests x "
                   f"{e2e['input_len']} in / {e2e['output_len']} out, {e2e['model_shape']}; timed run "
                   f"{found['run_s']:.1f} s after start-up in {found['engine_ready_s']:.0f} s; {ended})")
    else:
        ready = f"engine ready in {found['engine_ready_s']:.0f} s" if "engine_ready_s" in found else "engine not ready"
        summary = f"no timed run finished ({ready}; {ended})"
    return {"ok": "output_tokens_per_s" in found, "summary": summary, **result}
