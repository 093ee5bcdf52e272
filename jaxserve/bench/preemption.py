"""The preemption experiment of `jaxserve bench effects`: preemption by swap against recompute under memory
pressure.

--swap-requests requests of --swap-prompt-len prompt and --swap-output-len output tokens arrive at once on a KV
pool sized to hold --swap-pool-contexts of them with half their output, so the running requests outgrow it as
they decode and some are preempted. The systems are one engine configuration with preemption_mode recompute, swap and
auto (swap_space --swap-space GiB). Reported per system: output tokens/s (mean, best), preemptions and swaps per run,
the end-to-end latency of the requests that were preempted (and of every request), the host ms per step spent
dispatching swap copies, and whether the greedy tokens agree; then the copy bandwidth of the swap engine's host pool:
--swap-bandwidth-pages pages out to the host and back in, each way timed until the data has arrived (mean and best of
5).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from jaxserve.bench import stats
from jaxserve.bench.harness import (
    PAGE_SIZE,
    Engines,
    Run,
    System,
    cell,
    compare,
    ms,
    ratios,
    same_tokens,
    spread,
    timing,
)
from jaxserve.bench.workloads import random_workload
from jaxserve.kv.cache_manager import pages_for_tokens

MODES = ("recompute", "swap", "auto")
WARMUP_OUTPUT_LEN = 4  # tokens generated per warm-up request


def add_arguments(parser: argparse.ArgumentParser, sized: Callable[..., None]) -> None:
    """The experiment's options; `sized(group, flag, text)` adds a size flag whose default is in effects.SIZES."""
    group = parser.add_argument_group("preemption (long contexts need --model-shape llama-small-4k and a "
                                      "--max-model-len that holds them)")
    sized(group, "--swap-requests", "requests, all arriving at once")
    sized(group, "--swap-prompt-len", "prompt tokens of each")
    sized(group, "--swap-output-len", "output tokens of each")
    group.add_argument("--swap-pool-contexts", type=int, default=4,
                       help="requests whose prompt and half their output the KV pool holds (default %(default)s)")
    group.add_argument("--swap-space", type=float, default=4.0, help="GiB of host swap space (default %(default)s)")
    group.add_argument("--swap-bandwidth-pages", type=int, default=256,
                       help="pages copied each way to measure the swap bandwidth (default %(default)s)")


def preemption(args: argparse.Namespace, engines: Engines, ids: Sequence[int], log: Callable[[str], None]) -> dict:
    """Recompute, swap and auto on the same preempting workload (see the module docstring)."""
    # Room for each of --swap-pool-contexts requests' prompt and half its output: they are admitted, then outgrow it.
    num_pages = args.swap_pool_contexts * pages_for_tokens(args.swap_prompt_len + args.swap_output_len // 2,
                                                           PAGE_SIZE) + 1
    workload = random_workload(args.swap_requests, ids, "fixed", args.swap_prompt_len, 1, 1, "fixed",
                               args.swap_output_len, 1, 1, args.seed + 3)
    warmup = random_workload(2, ids, "fixed", args.swap_prompt_len, 1, 1, "fixed", WARMUP_OUTPUT_LEN, 1, 1,
                             args.seed + 103)
    log(f"preemption: {workload.description}; a pool of {num_pages} pages")
    systems = [System(mode, engines.get(enable_prefix_caching=False, num_pages=num_pages, preemption_mode=mode,
                                        swap_space=args.swap_space), workload, warmup) for mode in MODES]
    runs = compare(systems, args.repeats, log)
    sides = [preemption_side(system, system_runs) for system, system_runs in zip(systems, runs)]
    swap_engine = systems[1].engine
    bandwidth_pages = min(args.swap_bandwidth_pages, num_pages - 1, swap_engine.core.kv.host_pool.num_usable)
    runner = swap_engine.core.runner
    runner.kv_caches, bandwidth = runner.host_swap.measure_bandwidth(runner.kv_caches, bandwidth_pages)
    return {"workload": workload.description, "num_pages": num_pages, "systems": sides,
            "throughput_over_recompute": [ratios(side, sides[0], side_runs, runs[0])
                                          for side, side_runs in zip(sides[1:], runs[1:])],
            "same_tokens_as_recompute": [same_tokens(side_runs[0].result.output_token_ids,
                                                     runs[0][0].result.output_token_ids) for side_runs in runs[1:]],
            "bandwidth": {"pages": bandwidth_pages, "page_bytes": runner.host_swap.page_bytes, **bandwidth}}


def preemption_side(system: System, runs: list[Run]) -> dict:
    """One system: throughput, preemptions and swaps per run, end-to-end latency of the preempted requests and of
    all (ms, over every run), and the host's ms per step dispatching swaps (best run)."""
    preempted = [trace for run in runs for trace, count in zip(run.result.traces, run.result.preemptions) if count]
    every = [trace for run in runs for trace in run.result.traces]
    best = min(runs, key=lambda run: run.result.seconds)
    return {"system": system.name, **timing(runs),
            "preempted_requests_runs": [sum(1 for count in run.result.preemptions if count) for run in runs],
            "swapped_out_requests_runs": [run.swapped_out_requests for run in runs],
            "swapped_pages_runs": [run.swapped_out_pages for run in runs],
            "preempted_e2e_ms": spread(ms([trace.end - trace.start for trace in preempted])),
            "all_e2e_ms": spread(ms([trace.end - trace.start for trace in every])),
            "mean_ttft_ms": stats.summarize(ms([trace.ttft for trace in every]), ())["mean"],
            "swap_ms_per_step": best.timing["swap_ms"]}


def preemption_lines(result: dict) -> list[str]:
    """The preemption report."""
    lines = [f"### preemption by swap and by recompute: {result['workload']}, a pool of {result['num_pages']} pages",
             "", "| system | mean tok/s | best tok/s | timed runs (s) | preemptions (requests preempted) per run "
             "| swapped requests / pages per run | preempted e2e p50 / p99 / max (ms) | all e2e mean / max (ms) "
             "| mean TTFT (ms) | swap dispatch ms per step |", "|---|---:|---:|---|---|---|---:|---:|---:|---:|"]
    for side in result["systems"]:
        pre, every = side["preempted_e2e_ms"], side["all_e2e_ms"]
        preemptions = ", ".join(f"{p} ({r})" for p, r in zip(side["preemptions_runs"], side["preempted_requests_runs"]))
        swaps = ", ".join(f"{r} / {p}" for r, p in zip(side["swapped_out_requests_runs"], side["swapped_pages_runs"]))
        lines.append(f"| {side['system']} | {side['output_tokens_per_s']:.0f} | {side['best_output_tokens_per_s']:.0f} "
                     f"| {', '.join(f'{s:.2f}' for s in side['runs_s'])} | {preemptions} | {swaps} | "
                     f"{cell(pre['p50'])} / {cell(pre['p99'])} / {cell(pre['max'])} | {cell(every['mean'])} / "
                     f"{cell(every['max'])} | {cell(side['mean_ttft_ms'])} | {side['swap_ms_per_step']:.2f} |")
    lines.append("")
    for side, ratio, same in zip(result["systems"][1:], result["throughput_over_recompute"],
                                 result["same_tokens_as_recompute"]):
        lines.append(f"{side['system']} / recompute: throughput {ratio['mean']:.2f}x mean, {ratio['best']:.2f}x best; "
                     f"greedy tokens equal for {same[0]}/{same[1]} requests")
    bandwidth = result["bandwidth"]
    size = bandwidth["pages"] * bandwidth["page_bytes"] / 2**20
    lines.append(f"swap copy bandwidth ({bandwidth['pages']} pages, {size:.1f} MiB each way): device to host "
                 f"{bandwidth['out_gbps'][0]:.2f} GB/s mean, {bandwidth['out_gbps'][1]:.2f} best; host to device "
                 f"{bandwidth['in_gbps'][0]:.2f} GB/s mean, {bandwidth['in_gbps'][1]:.2f} best")
    return lines

