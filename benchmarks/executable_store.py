"""What the executable store saves a warm start: `jaxserve serve` to /health 200 and `jaxserve generate` to its first
token, with JAX's persistent compilation cache alone against the cache and the store.

    python -m benchmarks.executable_store --repeats 3

One cold run of each command (an empty cache folder) fills both; then, alternating, each warm run starts with the
store folder (`jaxserve-executables` inside the cache folder) as the cold run left it (`cache + store`) or removed
(`cache only`: every bucket is traced and lowered, then loaded from JAX's cache; such loads are never stored, so
the folder stays empty). Fresh processes (the console script); prints mean and best seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile

from benchmarks.background_compile import ready_seconds
from benchmarks.first_token import timed_run
from jaxserve.runner.executable_store import FOLDER_NAME

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


def main(argv: list[str] | None = None) -> dict:
    """Measure each command; print and return the runs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    results = {name: measure(command, args.repeats) for name, command in COMMANDS.items()}
    print("| command | cold s | warm, cache only s, mean (best) | warm, cache + store s, mean (best) |")
    print("|---|---:|---:|---:|")
    for name, runs in results.items():
        cells = [f"{statistics.mean(runs[way]):.2f} ({min(runs[way]):.2f})" for way in ("cache only", "cache + store")]
        print(f"| {name} | {runs['cold'][0]:.1f} | {cells[0]} | {cells[1]} |")
    return results


if __name__ == "__main__":
    main()
