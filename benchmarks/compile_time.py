"""Start-up compile time of the bundled model's buckets: this tree against a git revision, side by side.

    python benchmarks/compile_time.py --baseline b9c6a46 --repeats 3
    python benchmarks/compile_time.py --baseline 68a272a --overrides '{"speculative_config": {"method": "ngram"}}'

Each run is a fresh process (`python -c`, the persistent compilation cache off) that builds the engine on the
bundled model with its default buckets (and --overrides, a JSON object of engine options) and reports how
long `Runner.warmup` took (tracing, lowering and compiling every bucket) and how many executables it compiled.
The baseline runs from a `git worktree` of the revision; runs alternate baseline / current, so a slow spell of a
shared machine hits both. Prints mean and best.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

MEASURE = """
import json, sys, time
from jaxserve.config import EngineConfig
try:
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.runner.runner import Runner
except ImportError:  # a revision before the layout by concern (85fc9ed)
    from jaxserve.engine import LLMEngine
    from jaxserve.runner import Runner
spent = {}
warmup = Runner.warmup
def timed_warmup(self, show_progress=True):
    start = time.perf_counter()
    warmup(self, show_progress)
    spent["seconds"] = time.perf_counter() - start
    tables = ("_forward_exec", "_sample_exec", "_prompt_exec", "_steps_exec", "_verify_exec", "_verify_sample_exec",
              "_verify_rows_exec")
    spent["executables"] = sum(len(getattr(self, table, {})) for table in tables)  # revisions hold some of them
Runner.warmup = timed_warmup
LLMEngine(EngineConfig.for_model(None, compilation_cache_dir=None, **json.loads(sys.argv[1])), show_progress=False)
print(json.dumps(spent))
"""


def measure(tree: str, overrides: str) -> dict:
    """One fresh process's warm-up seconds and executable count, running the code of `tree`."""
    env = {**os.environ, "PYTHONPATH": tree, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    done = subprocess.run([sys.executable, "-c", MEASURE, overrides], cwd=tree, env=env, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    """Time both trees' warm-up `--repeats` times, alternating, and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="git revision to compare with (e.g. HEAD~3)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--overrides", default="{}", help="engine options as a JSON object (default: none)")
    args = parser.parse_args()
    current = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as scratch:
        baseline = os.path.join(scratch, "baseline")
        subprocess.run(["git", "worktree", "add", "--detach", baseline, args.baseline], cwd=current, check=True,
                       capture_output=True)
        try:
            runs = {"baseline": [], "current": []}
            for repeat in range(args.repeats):
                order = [("baseline", baseline), ("current", current)]
                for name, tree in order if repeat % 2 == 0 else order[::-1]:
                    runs[name].append(measure(tree, args.overrides))
                    print(f"repeat {repeat + 1}: {name} {runs[name][-1]}", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", baseline], cwd=current, check=True)
    print("| tree | executables | warm-up s mean | best |\n|---|---|---|---|")
    for name, results in runs.items():
        seconds = [r["seconds"] for r in results]
        print(f"| {name} ({args.baseline if name == 'baseline' else 'working tree'}) | {results[0]['executables']} "
              f"| {statistics.mean(seconds):.2f} | {min(seconds):.2f} |")


if __name__ == "__main__":
    main()
