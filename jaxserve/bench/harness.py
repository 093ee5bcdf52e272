"""The timing harness of `jaxserve bench effects`: engines built once and shared, systems run alike and side by
side (the same warm-up, then rounds running every system once, the order alternating), and their summaries."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from collections.abc import Callable, Sequence

from jaxserve.bench import stats
from jaxserve.bench.driver import DriveResult, bench_params, drive
from jaxserve.bench.workloads import BenchRequest, Workload
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

PAGE_SIZE = 16  # tokens per KV page


class Engines:
    """The experiments' engines, built on first use and shared: each is the base configuration (from the
    command line) with a few options changed."""

    def __init__(self, args: argparse.Namespace, folder: str, log: Callable[[str], None]):
        self.base = dict(model=folder, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, page_size=PAGE_SIZE,
                         min_token_bucket=args.min_token_bucket, min_page_bucket=args.min_page_bucket,
                         num_pages=args.num_pages,
                         compilation_cache_dir=args.compilation_cache_dir, load_format=args.load_format,
                         enable_structured_outputs=False)  # no experiment constrains outputs
        self.log = log
        self._built: dict[tuple, LLMEngine] = {}

    def get(self, **changes) -> LLMEngine:
        """The engine of the base configuration with `changes` (engine options, by flat name)."""
        key = tuple(sorted(changes.items()))
        if key not in self._built:
            start = time.perf_counter()
            engine = LLMEngine(EngineConfig(**{**self.base, **changes}), show_progress=False)
            self.log(f"engine {dict(changes)} ready in {time.perf_counter() - start:.1f}s "
                     f"({engine.stats()['kv_pages_total']} KV pages)")
            self._built[key] = engine
        return self._built[key]


@dataclasses.dataclass
class System:
    """One side of a comparison: an engine and what it runs."""

    name: str
    engine: LLMEngine
    workload: Workload
    warmup: Workload  # run once, untimed, before the timed rounds
    params: Callable[[BenchRequest], SamplingParams] = bench_params
    arrival_times: Sequence[float] | None = None  # s after the start, one per request; None: all at once


@dataclasses.dataclass
class Run:
    """One run of a system: what the driver recorded, and the engine counters it moved."""

    result: DriveResult
    prefix_cache_hits: int  # prompt tokens found computed in cached pages
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    preemptions: int
    timing: dict  # the engine's stats()["timing"] over this run
    swapped_out_requests: int = 0  # preemptions by swap
    swapped_out_pages: int = 0  # pages copied to the host pool

    @property
    def output_tokens(self) -> int:
        """Tokens generated, every sample counted."""
        return stats.token_totals(self.result.traces)["output_tokens"]

    @property
    def output_tokens_per_s(self) -> float:
        """Output tokens per second of the run's wall time."""
        return self.output_tokens / self.result.seconds


def run_once(engine: LLMEngine, workload: Workload, params: Callable[[BenchRequest], SamplingParams] = bench_params,
             arrival_times: Sequence[float] | None = None) -> Run:
    """One run of `workload` on `engine`, from an empty prefix cache."""
    engine.reset_prefix_cache()
    engine.core.timing.reset()
    gc.collect()
    before = engine.stats()
    result = drive(engine, workload, arrival_times, params)
    after = engine.stats()
    return Run(result, after["prefix_cache_hits"] - before["prefix_cache_hits"],
               after["prefix_cache_queries"] - before["prefix_cache_queries"],
               after["preemptions"] - before["preemptions"], after["timing"],
               after["swapped_out_requests"] - before["swapped_out_requests"],
               after["swapped_out_pages"] - before["swapped_out_pages"])


def compare(systems: list[System], repeats: int, log: Callable[[str], None]) -> list[list[Run]]:
    """The timing protocol: each system's warm-up, then `repeats` rounds running every system once, forward
    in even rounds and reversed in odd ones. Returns each system's timed runs, in round order."""
    for system in systems:
        run_once(system.engine, system.warmup, system.params)
    runs: list[list[Run]] = [[] for _ in systems]
    for round_index in range(repeats):
        order = list(range(len(systems)))
        for i in order if round_index % 2 == 0 else order[::-1]:
            run = run_once(systems[i].engine, systems[i].workload, systems[i].params, systems[i].arrival_times)
            runs[i].append(run)
            log(f"  round {round_index + 1}/{repeats} {systems[i].name}: {run.result.seconds:.2f}s, "
                f"{run.output_tokens} output tokens ({run.output_tokens_per_s:.0f} tok/s), "
                f"{len(run.result.steps)} steps")
    return runs


def timing(runs: list[Run]) -> dict:
    """A system's timed runs, as `jaxserve bench throughput` rows: requests/s, output and total tokens/s at the
    mean run and (best_*) at the best run, every sample's tokens counted; the runs' seconds and preemptions."""
    totals = [stats.token_totals(run.result.traces) for run in runs]
    counts = {(len(run.result.traces), t["prompt_tokens"], t["output_tokens"]) for run, t in zip(runs, totals)}
    if len(counts) != 1:
        raise RuntimeError(f"the runs of one system generated different numbers of tokens: {sorted(counts)}")
    num_requests, prompt_tokens, output_tokens = counts.pop()
    seconds = [run.result.seconds for run in runs]  # s, one per round
    return {**stats.throughput_of_runs(num_requests, prompt_tokens, output_tokens, seconds),
            "output_tokens": output_tokens, "preemptions_runs": [run.preemptions for run in runs]}


def ratios(a: dict, b: dict, a_runs: list[Run], b_runs: list[Run]) -> dict:
    """a's output tokens/s over b's: of the means, of the bests, and per round."""
    return {"mean": a["output_tokens_per_s"] / b["output_tokens_per_s"],
            "best": a["best_output_tokens_per_s"] / b["best_output_tokens_per_s"],
            "rounds": [x.output_tokens_per_s / y.output_tokens_per_s for x, y in zip(a_runs, b_runs)]}


def same_tokens(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """[requests whose token ids are equal in a and b, requests]."""
    return [sum(x == y for x, y in zip(a, b)), len(a)]


def ms(values: Sequence[float]) -> list[float]:
    """Seconds to milliseconds."""
    return [1000.0 * value for value in values]


def spread(values_ms: Sequence[float]) -> dict:
    """{"mean", "p50", "p90", "p99", "max"} of values in ms (all None when empty)."""
    summary = stats.summarize(values_ms, (50, 90, 99, 100))
    summary["max"] = summary.pop("p100")
    return summary


def cell(value: float | None) -> str:
    """A number of ms for a table cell; "-" for None."""
    return "-" if value is None else f"{value:.1f}"
