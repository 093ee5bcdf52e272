"""How soon the offline `LLM()` is ready and gives the README's first outputs, with background compiles (its default)
against every bucket compiled first, on the bundled model with no compilation cache (every compile is real).

    python -m benchmarks.offline_ready --repeats 2

Each run is a fresh process that builds `LLM(compilation_cache_dir=None, background_compile=...)` and generates the
README's two prompts (64 tokens each, temperature 0.8, seed 0): seconds from the process's start to `LLM()` returning
and to the outputs, and the buckets still compiling when they came. The two ways alternate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

WAYS = {"background (default)": True, "all first": False}
RUN = """
import json, sys, time
started = time.monotonic()
from jaxserve import LLM, SamplingParams
llm = LLM(compilation_cache_dir=None, show_progress=False, background_compile=sys.argv[1] == "True")
ready = time.monotonic() - started
llm.generate(["def fibonacci(n):", "import os\\n"], SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, seed=0),
             use_tqdm=False)
print(json.dumps({"ready_s": ready, "outputs_s": time.monotonic() - started,
                  "compiling": llm.stats()["background_compiles_left"]}))
"""


def run_once(background: bool) -> dict:
    """One fresh process's seconds to ready and to outputs, and the buckets left compiling."""
    result = subprocess.run([sys.executable, "-c", RUN, str(background)], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    """Run both ways `--repeats` times, alternating, and print the table (mean and best)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        for way, background in WAYS.items():
            runs[way].append(run_once(background))
    print("| LLM() | ready s, mean (best) | outputs s, mean (best) | buckets still compiling |")
    print("|---|---:|---:|---:|")
    for way, results in runs.items():
        ready = [r["ready_s"] for r in results]
        outputs = [r["outputs_s"] for r in results]
        print(f"| {way} | {statistics.mean(ready):.1f} ({min(ready):.1f}) | {statistics.mean(outputs):.1f} "
              f"({min(outputs):.1f}) | {', '.join(str(r['compiling']) for r in results)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=2)


if __name__ == "__main__":
    main()
