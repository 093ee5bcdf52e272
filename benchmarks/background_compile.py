"""`background_compile` against compiling every bucket first, on the bundled model: how soon `jaxserve serve` answers,
and the throughput while the background compiles run and after.

    python -m benchmarks.background_compile --repeats 2

1. Ready: `jaxserve serve` launched (the console script, a fresh process) with an empty compilation cache, then
   with the cache that run filled; seconds until /health answers 200, with `--background-compile` (serve's
   default) and `--no-background-compile`. Alternating.
2. Throughput: in this process, an engine with background_compile (the persistent cache off and no executables
   shared, so every compile is real) generates a workload (64 prompts of 16 to 200 tokens, 32 greedy tokens each)
   at once, while its buckets compile; then, the compiles done, the same workload again; an engine that compiled
   everything first runs it twice too. Each run from an empty prefix cache. Output tokens/s of each run, and how
   many steps ran in the largest bucket.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.first_token import cold_then_warm
from benchmarks.interrupt import Command, free_port, healthy

WAYS = {"background": ["--background-compile"], "all first": ["--no-background-compile"]}


def ready_seconds(flags: list[str], cache_dir: str) -> float:
    """Seconds from launching `serve` to /health 200; the server is then stopped."""
    port = free_port()
    started = time.monotonic()
    command = Command(["serve", "--port", str(port), "--compilation-cache-dir", cache_dir, "--log-level", "warning",
                       *flags])
    command.wait_for(lambda: healthy(port), "/health 200")
    seconds = time.monotonic() - started
    command.interrupt()
    return seconds


def throughput(repeats: int) -> dict:
    """Output tokens/s of the workload, each run from an empty prefix cache: an engine with background_compile
    runs it at once (while its buckets compile) and again once they are done; an engine that compiled everything
    first runs it twice too. No executables shared between repeats, the persistent cache off."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.runner.executables import clear_shared_executables

    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(10, 1000, size=int(n)).tolist()}
               for n in rng.integers(16, 200, size=64)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    tokens = 32 * len(prompts)

    def run(llm) -> float:
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return tokens / (time.perf_counter() - start)

    rows = {"background: first run, compiling": [], "background: second run, compiled": [],
            "all first: first run": [], "all first: second run": []}
    for _ in range(repeats):
        clear_shared_executables()
        llm = LLM(background_compile=True, compilation_cache_dir=None, show_progress=False)
        rows["background: first run, compiling"].append(run(llm))
        left = llm.engine.core.runner.background_compiles_left()
        llm.engine.core.runner.wait_for_background_compiles()
        rows["background: second run, compiled"].append(run(llm))
        steps = llm.stats()["steps_in_the_largest_bucket"]
        del llm
        clear_shared_executables()
        llm = LLM(compilation_cache_dir=None, show_progress=False)
        rows["all first: first run"].append(run(llm))
        rows["all first: second run"].append(run(llm))
        del llm
        print(f"  (background: {left} buckets left when its first run ended, {steps} steps in the largest bucket)")
    return rows


def main(argv: list[str] | None = None) -> None:
    """Both measurements; prints their tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--parts", nargs="+", choices=("ready", "throughput"), default=["ready", "throughput"])
    args = parser.parse_args(argv)
    ready = cold_then_warm(WAYS, ready_seconds, args.repeats if "ready" in args.parts else 0)
    print(f"{'serve':<12}{'cache':<6}{'/health 200 after s, mean (best)':>34}")
    for (way, cache), samples in ready.items():
        if samples:
            print(f"{way:<12}{cache:<6}{statistics.mean(samples):>26.1f} ({min(samples):.1f})")
    if "throughput" in args.parts:
        rows = throughput(args.repeats)
        print(f"\n{'run':<36}{'output tok/s, mean (best)':>28}")
        for name, samples in rows.items():
            print(f"{name:<36}{statistics.mean(samples):>20.0f} ({max(samples):.0f})")


if __name__ == "__main__":
    main()
