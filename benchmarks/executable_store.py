"""What the executable store saves a warm start: `jaxserve serve` to /health 200 and `jaxserve generate` to its first
token, with JAX's persistent compilation cache alone against the cache and the store.

    python -m benchmarks.executable_store --repeats 3
    python -m benchmarks.executable_store --after-edit --repeats 2   # starts after an edit to jaxserve's source

One cold run of each command (an empty cache folder) fills both; then, alternating, each warm run starts with the
store folder (`jaxserve-executables` inside the cache folder) as the cold run left it (`cache + store`) or removed
(`cache only`: every bucket is traced and lowered, then loaded from JAX's cache; the store the run refills is
removed again before the next). Fresh processes (the console script); prints mean and best seconds.

`--after-edit`: the offline `LLM()` of the bundled model, every bucket compiled at start, in a fresh process each,
from a copy of the jaxserve package: once on an empty cache, then after a one-line edit to the copy (a new source
digest, so every store key misses while JAX's cache, keyed by the lowered programs, still holds them) once and
`--repeats` more times; prints each start's seconds and what the store loaded and saved.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from benchmarks.background_compile import ready_seconds
from benchmarks.first_token import timed_run
from jaxserve.runner.executable_store import FOLDER_NAME, SOURCE_ROOT

COMMANDS = {"serve /health 200": lambda cache_dir: ready_seconds([], cache_dir),
            "generate first token": lambda cache_dir: timed_run([], cache_dir)["first_token_s"]}


def measure(command, repeats: int) -> dict[str, list[float]]:
    """Seconds of `command(cache_dir)` warm, with and without the store the cold run wrote, alternating."""
    runs: dict[str, list[float]] = {"cold": [], "cache only": [], "cache + store": []}
    with tempfile.TemporaryDirectory(prefix="jaxserve-cache-") as scratch:
        cache_dir, kept = os.path.join(scratch, "cache"), os.path.join(scratch, "store")
        runs["cold"].append(command(cache_dir))
        shutil.copytree(os.path.join(cache_dir, FOLDER_NAME), kept)
        for _ in range(repeats):
            for way in ("cache only", "cache + store"):
                shutil.rmtree(os.path.join(cache_dir, FOLDER_NAME), ignore_errors=True)
                if way == "cache + store":
                    shutil.copytree(kept, os.path.join(cache_dir, FOLDER_NAME))
                runs[way].append(command(cache_dir))
    return runs


START = """
import json, time
started = time.perf_counter()
from jaxserve import LLM
from jaxserve.runner import executables
LLM(compilation_cache_dir={cache_dir!r}, show_progress=False, skip_precompile=False, background_compile=False)
store = executables._store[0]
print(json.dumps({{"seconds": time.perf_counter() - started, "loaded": store.num_loaded, "saved": store.num_saved}}))
"""


def starts_after_an_edit(repeats: int) -> list[dict]:
    """Each start of a copy of jaxserve: on an empty cache, then after an edit to the copy, 1 + `repeats` times."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="jaxserve-edit-") as scratch:
        shutil.copytree(SOURCE_ROOT, os.path.join(scratch, "jaxserve"), ignore=shutil.ignore_patterns("__pycache__"))
        env = {**os.environ, "PYTHONPATH": scratch}
        code = START.format(cache_dir=os.path.join(scratch, "cache"))
        for label in ["empty cache", "after the edit"] + ["again"] * repeats:
            if label == "after the edit":
                with open(os.path.join(scratch, "jaxserve", "logs.py"), "a") as f:
                    f.write("# an edit\n")
            done = subprocess.run([sys.executable, "-c", code], env=env, cwd=scratch, capture_output=True, text=True,
                                  check=True)
            runs.append({"start": label, **json.loads(done.stdout.strip().splitlines()[-1])})
    return runs


def main(argv: list[str] | None = None) -> dict:
    """Measure each command; print and return the runs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--after-edit", action="store_true", help="starts after an edit to jaxserve's source")
    args = parser.parse_args(argv)
    if args.after_edit:
        runs = starts_after_an_edit(args.repeats)
        print("| start | seconds | store loaded | store saved |\n|---|---:|---:|---:|")
        for run in runs:
            print(f"| {run['start']} | {run['seconds']:.2f} | {run['loaded']} | {run['saved']} |")
        return {"after_edit": runs}
    results = {name: measure(command, args.repeats) for name, command in COMMANDS.items()}
    print("| command | cold s | warm, cache only s, mean (best) | warm, cache + store s, mean (best) |")
    print("|---|---:|---:|---:|")
    for name, runs in results.items():
        cells = [f"{statistics.mean(runs[way]):.2f} ({min(runs[way]):.2f})" for way in ("cache only", "cache + store")]
        print(f"| {name} | {runs['cold'][0]:.1f} | {cells[0]} | {cells[1]} |")
    return results


if __name__ == "__main__":
    main()
