"""The README's first command, timed: seconds from launching `jaxserve generate` to its first generated text.

    python -m benchmarks.first_token --repeats 3

Each run launches `jaxserve generate --prompt "def fibonacci(n):"` (the console script, as `python -m
jaxserve.console`) on the bundled model in a fresh process, with a fresh, empty compilation cache (`cold`) and then
again with the cache that run filled (`warm`), for each way of compiling: `first use` (generate's default: each
step bucket compiles when a step first needs it) and `all first` (`--no-skip-precompile`: every bucket compiles
before the first step, generate's default until 2026-12-06). It reports the seconds until stdout shows text past
the echoed prompt (the first token) and until the process exits. Ways alternate run by run, so a slow spell of a
shared machine hits both; prints mean and best.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

from benchmarks.interrupt import PROMPT, Command

WAYS = {"first use": [], "all first": ["--no-skip-precompile"]}


def timed_run(flags: list[str], cache_dir: str) -> dict:
    """One `generate`: seconds to its first generated text and to its exit."""
    started = time.monotonic()
    command = Command(["generate", "--prompt", PROMPT, "--compilation-cache-dir", cache_dir, *flags])
    command.wait_for(lambda: len(command.text("stdout").rstrip("\n")) > len(PROMPT), "the first token")
    first_token_s = time.monotonic() - started
    code = command.process.wait()
    if code != 0:
        raise RuntimeError(f"generate exited {code}: {command.text('stderr')[-2000:]}")
    return {"first_token_s": first_token_s, "exit_s": time.monotonic() - started}


def cold_then_warm(ways: dict[str, list[str]], measure, repeats: int) -> dict[tuple[str, str], list]:
    """`measure(flags, cache_dir)` of each way with a fresh, empty compilation cache (`cold`), then with the cache
    that run filled (`warm`), the ways alternating, `repeats` times: {(way, cache): [results]}."""
    runs = {(way, cache): [] for way in ways for cache in ("cold", "warm")}
    for _ in range(repeats):
        for way, flags in ways.items():
            cache_dir = tempfile.mkdtemp(prefix="jaxserve-cache-")
            try:
                for cache in ("cold", "warm"):
                    runs[way, cache].append(measure(flags, cache_dir))
            finally:
                shutil.rmtree(cache_dir, ignore_errors=True)
    return runs


def main(argv: list[str] | None = None) -> dict:
    """Measure each way, cold then warm, `--repeats` times; print and return the runs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    runs = cold_then_warm(WAYS, timed_run, args.repeats)
    print(f"{'way':<10}{'cache':<6}{'first token s, mean (best)':>28}{'exit s, mean (best)':>22}")
    for (way, cache), samples in runs.items():
        first = [sample["first_token_s"] for sample in samples]
        done = [sample["exit_s"] for sample in samples]
        print(f"{way:<10}{cache:<6}{statistics.mean(first):>20.1f} ({min(first):.1f}){statistics.mean(done):>15.1f} "
              f"({min(done):.1f})")
    return {f"{way}, {cache}": samples for (way, cache), samples in runs.items()}


if __name__ == "__main__":
    main()
