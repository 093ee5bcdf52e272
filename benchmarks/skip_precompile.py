"""Start-up with and without `skip_precompile` on the bundled model, side by side.

    python benchmarks/skip_precompile.py --repeats 3

Each run is a fresh process with the persistent compilation cache off (every compile is real) that builds `LLM()`
on the bundled model with its default buckets (configs/tiny-cpu.yaml), then generates the same workload twice
(16 prompts of 6 to 66 tokens, 32 greedy tokens each). It reports the seconds to a ready engine (after the imports),
the first run's seconds (under skip_precompile it compiles the buckets it meets), the second run's (nothing left to
compile either way) and the bucket executables the engine holds at the end. Runs alternate precompile / skip, so a
slow spell of a shared machine hits both. Prints mean and best of each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

MEASURE = """
import json, sys, time
from jaxserve import LLM, SamplingParams
start = time.perf_counter()
llm = LLM(compilation_cache_dir=None, skip_precompile=sys.argv[1] == "skip", show_progress=False)
ready = time.perf_counter()
prompts = ["def function_%d(" % i + ", ".join("argument_%d" % j for j in range(i)) + "):" for i in range(16)]
params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
runs, tokens = [], []
for _ in range(2):
    began = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    runs.append(time.perf_counter() - began)
    tokens.append([o.outputs[0].token_ids for o in outputs])
print(json.dumps({"ready_s": ready - start, "first_s": runs[0], "second_s": runs[1],
                  "executables": llm.stats()["executables"], "tokens": tokens[0], "same": tokens[0] == tokens[1]}))
"""
MODES = ("precompile", "skip")
FIELDS = ("ready_s", "first_s", "second_s")


def measure(mode: str) -> dict:
    """One fresh process's numbers for `mode`."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    result = subprocess.run([sys.executable, "-c", MEASURE, mode], cwd=root, env=env, capture_output=True, text=True,
                            check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            runs[mode].append(measure(mode))
    tokens = {mode: runs[mode][0]["tokens"] for mode in MODES}
    assert tokens["precompile"] == tokens["skip"], "skip_precompile must not change the tokens"
    assert all(run["same"] for mode in MODES for run in runs[mode])
    print(f"{args.repeats} fresh processes per mode, persistent compilation cache off; seconds, mean (best)")
    print("| mode | ready | first run | second run | executables |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        cells = [f"{statistics.mean(r[f] for r in runs[mode]):.2f} ({min(r[f] for r in runs[mode]):.2f})"
                 for f in FIELDS]
        print(f"| {mode} | {' | '.join(cells)} | {runs[mode][-1]['executables']} |")
    ready = {mode: statistics.mean(r["ready_s"] + r["first_s"] for r in runs[mode]) for mode in MODES}
    print(f"ready + first run: skip / precompile = {ready['skip'] / ready['precompile']:.2f}")


if __name__ == "__main__":
    main()
