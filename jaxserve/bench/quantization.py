"""The quantization experiment of `jaxserve bench effects`: weights and KV cache quantized or not.

The workload sharing nothing (random prompts, long-tailed outputs, greedy) on engines that differ only in
`quantization` (none, int8, fp8) and `kv_cache_dtype` (auto, fp8): output tokens/s (mean, best), the ratio to the
float engine, how many requests' greedy tokens equal the float engine's (a quantized model may pick another
token where two are close; quality is measured teacher-forced by benchmarks/quantization_quality.py), and the
tokens each engine's KV pool holds in the same `cpu_kv_cache_gib`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxserve.bench.harness import Engines, System, compare, ratios, same_tokens, timing
from jaxserve.bench.workloads import random_workload

MODES = {  # name -> EngineConfig changes
    "none": {}, "int8": {"quantization": "int8"}, "fp8": {"quantization": "fp8"}, "fp8 KV": {"kv_cache_dtype": "fp8"},
    "fp8 + fp8 KV": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


def quantization(args, engines: Engines, ids: Sequence[int], log: Callable[[str], None],
                 prompt_range: tuple[int, int], output: tuple[int, int, int], warmup_len: int) -> dict:
    """Each mode on the same requests (see the module docstring)."""
    workload = random_workload(args.unshared_requests, ids, "uniform", 0, *prompt_range, "lognormal", *output,
                               args.seed + 1)
    warmup = random_workload(8, ids, "uniform", 0, *prompt_range, "fixed", warmup_len, 1, 1, args.seed + 101)
    log(f"quantization: {workload.description}")
    systems = [System(mode, engines.get(**changes), workload, warmup) for mode, changes in MODES.items()]
    runs = compare(systems, args.repeats, log)
    sides = [{"system": system.name, **timing(system_runs), "kv_tokens": kv_tokens(system.engine)}
             for system, system_runs in zip(systems, runs)]
    for side, side_runs in zip(sides[1:], runs[1:]):
        side["over_float"] = ratios(side, sides[0], side_runs, runs[0])
        side["same_tokens"] = same_tokens(side_runs[0].result.output_token_ids, runs[0][0].result.output_token_ids)
    return {"workload": workload.description, "systems": sides}


def kv_tokens(engine) -> int:
    """Tokens the engine's KV pool holds (its pages, the null page left out)."""
    return (engine.stats()["kv_pages_total"] - 1) * engine.config.cache_config.page_size


def quantization_lines(result: dict) -> list[str]:
    """The quantization report: one table row per mode."""
    lines = [f"### quantization: {result['workload']}", "",
             "| quantization | KV pool tokens | mean tok/s | best tok/s | timed runs (s) | over float (mean, best) "
             "| greedy tokens equal to float |", "|---|---:|---:|---:|---|---:|---:|"]
    for side in result["systems"]:
        extra = "|"  # two empty cells
        if "over_float" in side:
            ratio, same = side["over_float"], side["same_tokens"]
            extra = f"{ratio['mean']:.2f}x, {ratio['best']:.2f}x | {same[0]}/{same[1]}"
        lines.append(f"| {side['system']} | {side['kv_tokens']:,} | {side['output_tokens_per_s']:.0f} "
                     f"| {side['best_output_tokens_per_s']:.0f} "
                     f"| {', '.join(f'{s:.2f}' for s in side['runs_s'])} | {extra} |")
    return lines
