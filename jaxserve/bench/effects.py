"""`jaxserve bench effects`: one engine feature on and off, side by side on the same weights and requests.

Each experiment (--effect; all but preemption by default) has its own workload:

chunked-prefill    decode requests (short prompts, long outputs) are running when long prompts arrive, one
                   at a time, evenly spread over the decodes' lifetime (the mean of one untimed run of the
                   decodes alone on each system); the same arrival times for both systems. On: a step holds at most
                   --max-num-batched-tokens tokens, so a long prompt is computed in chunks beside the
                   decodes. Off: a prompt is computed in one step, so the budget must hold the longest
                   prompt beside every running request: max(--max-model-len, --long-prompt-len +
                   --max-num-seqs) tokens (with equal budgets that large, chunking would never split a
                   prompt and the two systems would be the same). Reports the decodes' inter-token latency
                   (p50, p99, max) and TPOT, the long prompts' TTFT, output tokens/s, and whether the greedy
                   tokens agree.
prefix-cache       a --prefix-len system prompt shared by every request, each with its own question, with
                   prefix caching on and off: hit rate against the ideal (every request but the first
                   could reuse the prefix's full pages), output tokens/s, mean TTFT; and a workload with no
                   shared prefixes (random prompts, long-tailed outputs) on and off: output tokens/s, and the
                   host time spent in the cache's hashing and lookups in one more, instrumented, run.
overlap            asynchronous scheduling and multi-step decoding on the workload sharing nothing: the
                   synchronous engine, then async scheduling with --scheduler-steps K decode iterations per
                   device call (1, 4, 8 by default): output tokens/s, inter-token latency (p50, p99; a K-step
                   call brings K tokens at once, so ITL trades against throughput), TPOT, the host's ms per
                   step by phase and the device's idle share (stats()["timing"]), and whether the greedy tokens
                   equal the synchronous engine's.
parallel-sampling  prompts each sampled n times (temperature 1, seeded): one request with n samples (they
                   fork the prompt's pages) against n requests with seeds seed + i, on one engine with
                   prefix caching off (so the forks are the only sharing): peak KV pages, pages per running
                   sample, output tokens/s, and whether sample 0 matches the request seeded like it.
preemption         long contexts under memory pressure, preempted by recompute, by swap to host memory and
                   auto: throughput, the preempted requests' latency, the swap copy bandwidth (bench/preemption.py).
speculation        n-gram speculative decoding off and on, on code-editing prompts (the answer is in the prompt), at
                   batch sizes 1, 8 and 64: throughput, inter-token latency, acceptance length
                   (bench/speculation.py).
quantization       weights none, int8 and fp8, and an fp8 KV cache, on the workload sharing nothing: output
                   tokens/s, greedy agreement with the float engine and the KV pool's tokens (bench/quantization.py).

Timing protocol (every comparison): the same untimed warm-up for each system, then --repeats rounds each
running every system once, the order alternating between rounds; mean and best per system, and ratios. The
prefix cache is reset before every run. Every run is `jaxserve.bench.driver.drive` over an `LLMEngine`.

Example:
    jaxserve bench effects --json effects.json
    jaxserve bench effects --effect prefix-cache parallel-sampling --quick
    jaxserve bench effects --effect preemption --model-shape llama-small-4k --max-model-len 2304
    jaxserve bench effects --effect speculation --model-shape bundled
    jaxserve bench effects --effect quantization --model-shape bundled
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence

from jaxserve.bench import models, preemption, quantization, speculation, stats
from jaxserve.bench.harness import (
    PAGE_SIZE,
    Engines,
    Run,
    System,
    cell,
    compare,
    ms,
    ratios,
    run_once,
    same_tokens,
    spread,
    timing,
)
from jaxserve.bench.offline import make_logger
from jaxserve.bench.results import command_args, write_json
from jaxserve.bench.workloads import BenchRequest, Workload, random_workload, shared_prefix_workload, vocab_ids
from jaxserve.config import DEFAULT_CACHE_DIR
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.step_timing import PHASES
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import load_tokenizer

EFFECTS = ("chunked-prefill", "prefix-cache", "overlap", "parallel-sampling", "preemption", "speculation",
           "quantization")
# Asked for by name: preemption's long contexts need a model of more positions, speculation one that can copy;
# quantization builds four more engines.
DEFAULT_EFFECTS = EFFECTS[:4]
WARMUP_OUTPUT_LEN = 8  # tokens generated per warm-up request
# The workload sharing nothing (throughput.py's shape): prompts uniform in (low, high) tokens, outputs lognormal
# (median, low, high) tokens.
UNSHARED_PROMPT_RANGE = (16, 256)
UNSHARED_OUTPUT = (32, 8, 128)
# Workload sizes: (full, --quick). Flags left unset take one of these.
SIZES = {
    "repeats": (3, 2),
    "decode_requests": (16, 8),
    "decode_prompt_len": (32, 32),
    "decode_output_len": (256, 64),
    "long_requests": (4, 2),
    "long_prompt_len": (896, 448),
    "long_output_len": (16, 8),
    "prefix_requests": (128, 16),
    "prefix_len": (512, 256),
    "question_len": (32, 32),
    "prefix_output_len": (32, 16),
    "unshared_requests": (128, 32),
    "parallel_prompts": (16, 2),
    "parallel_prompt_len": (512, 256),
    "parallel_output_len": (32, 16),
    "swap_requests": (12, 6),
    "swap_prompt_len": (2048, 768),
    "swap_output_len": (128, 32),
}


def _sized(group, flag: str, text: str) -> None:
    """Add a size option whose default comes from SIZES."""
    full, quick = SIZES[flag[2:].replace("-", "_")]
    group.add_argument(flag, type=int, help=f"{text} (default {full}, quick {quick})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `jaxserve bench effects`."""
    parser.add_argument("--effect", nargs="+", choices=EFFECTS, default=list(DEFAULT_EFFECTS),
                        help=f"which experiments to run (default: {' '.join(DEFAULT_EFFECTS)})")
    _sized(parser, "--repeats", "timed rounds per comparison")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the workloads and the samples (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="small sizes, for iteration")
    models.add_model_arguments(parser)
    parser.set_defaults(model_shape="llama-small")  # llama-small allows 1024 positions: --max-model-len <= 1024
    engine = parser.add_argument_group("engines (equal for every system unless the experiment says otherwise)")
    engine.add_argument("--max-model-len", type=int, default=1024, help="tokens (default %(default)s)")
    engine.add_argument("--max-num-seqs", type=int, default=64, help="(default %(default)s)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=256,
                        help="tokens per step; with chunked prefill, the chunk budget (default %(default)s)")
    engine.add_argument("--min-token-bucket", type=int, default=8, help="smallest token bucket (default %(default)s)")
    engine.add_argument("--min-page-bucket", type=int, default=1,
                        help="smallest page-table width bucket, in pages (default %(default)s)")
    engine.add_argument("--num-pages", type=int, help="KV pages per engine (default: the engine's own sizing)")
    engine.add_argument("--compilation-cache-dir", default=DEFAULT_CACHE_DIR, help="(default %(default)s)")
    chunked = parser.add_argument_group("chunked-prefill")
    _sized(chunked, "--decode-requests", "requests decoding from the start")
    _sized(chunked, "--decode-prompt-len", "their prompt tokens")
    _sized(chunked, "--decode-output-len", "their output tokens")
    _sized(chunked, "--long-requests", "long prompts arriving while they decode")
    _sized(chunked, "--long-prompt-len", "tokens of a long prompt")
    _sized(chunked, "--long-output-len", "output tokens of a long request")
    prefix = parser.add_argument_group("prefix-cache")
    _sized(prefix, "--prefix-requests", "requests sharing the prefix")
    _sized(prefix, "--prefix-len", "tokens of the shared prefix")
    _sized(prefix, "--question-len", "tokens of each request's own question")
    _sized(prefix, "--prefix-output-len", "output tokens per request")
    low, high = UNSHARED_PROMPT_RANGE
    median, out_low, out_high = UNSHARED_OUTPUT
    _sized(prefix, "--unshared-requests", f"requests of the no-sharing workload: prompts uniform in {low}-{high} "
                                          f"tokens, outputs lognormal with median {median} in {out_low}-{out_high}")
    overlapping = parser.add_argument_group("overlap (its workload is prefix-cache's sharing nothing)")
    overlapping.add_argument("--scheduler-steps", type=int, nargs="+", default=[1, 4],
                             help="num_scheduler_steps of the asynchronous systems (default: 1 4; more systems "
                             "may exhaust the process's memory mappings on the CPU: run K = 8 in a second command)")
    parallel = parser.add_argument_group("parallel-sampling")
    parallel.add_argument("--n", type=int, default=8, help="samples per prompt (default %(default)s)")
    _sized(parallel, "--parallel-prompts", "prompts")
    _sized(parallel, "--parallel-prompt-len", "tokens per prompt")
    _sized(parallel, "--parallel-output-len", "tokens per sample")
    preemption.add_arguments(parser, _sized)
    speculation.add_arguments(parser)
    output = parser.add_argument_group("output")
    output.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    output.add_argument("--plot-dir", metavar="DIR",
                        help="write the chunked-prefill step timelines (chunked_on.png, chunked_off.png) here")


def resolve_sizes(args: argparse.Namespace) -> None:
    """Fill the size flags left unset from SIZES (full, or --quick), then check that every request of the chosen
    experiments fits in --max-model-len."""
    for name, (full, quick) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.repeats < 1 or args.n < 1:
        raise ValueError("--repeats and --n must be >= 1")
    longest = [  # (effect, flags, tokens of its longest request)
        ("chunked-prefill", "--long-prompt-len + --long-output-len", args.long_prompt_len + args.long_output_len),
        ("chunked-prefill", "--decode-prompt-len + --decode-output-len",
         args.decode_prompt_len + args.decode_output_len),
        ("prefix-cache", "--prefix-len + --question-len + --prefix-output-len",
         args.prefix_len + args.question_len + args.prefix_output_len),
        ("prefix-cache", "the no-sharing workload", UNSHARED_PROMPT_RANGE[1] + UNSHARED_OUTPUT[2]),
        ("parallel-sampling", "--parallel-prompt-len + --parallel-output-len",
         args.parallel_prompt_len + args.parallel_output_len),
        ("preemption", "--swap-prompt-len + --swap-output-len", args.swap_prompt_len + args.swap_output_len),
    ]
    for effect, flags, tokens in longest:
        if effect in args.effect and tokens > args.max_model_len:
            raise ValueError(f"{flags} = {tokens} tokens exceed --max-model-len {args.max_model_len}")


# ---- chunked prefill ---------------------------------------------------------------------------------

def chunked_workloads(args: argparse.Namespace, ids: Sequence[int]) -> tuple[Workload, Workload, Workload]:
    """(the decode requests alone, decodes + long prompts, its warm-up): the decodes come first."""

    def fixed(num: int, prompt_len: int, output_len: int, seed: int) -> Workload:
        return random_workload(num, ids, "fixed", prompt_len, 1, 1, "fixed", output_len, 1, 1, seed)

    def mix(num_decode: int, decode_out: int, num_long: int, long_out: int, seed: int) -> Workload:
        decodes = fixed(num_decode, args.decode_prompt_len, decode_out, seed)
        longs = fixed(num_long, args.long_prompt_len, long_out, seed + 1)
        return Workload("long-prompt-mix", decodes.requests + longs.requests,
                        f"{num_decode} requests of {args.decode_prompt_len} prompt + {decode_out} output tokens "
                        f"decoding while {num_long} prompts of {args.long_prompt_len} tokens arrive "
                        f"({long_out} output tokens each)")

    decodes = fixed(args.decode_requests, args.decode_prompt_len, args.decode_output_len, args.seed)
    workload = mix(args.decode_requests, args.decode_output_len, args.long_requests, args.long_output_len, args.seed)
    warmup = mix(args.decode_requests, WARMUP_OUTPUT_LEN, args.long_requests, 2, args.seed + 100)
    return decodes, workload, warmup


def long_arrivals(decode_seconds: float, num_decode: int, num_long: int) -> list[float]:
    """Arrival times (s): the decodes at 0, long prompt k at (k + 1) / (num_long + 1) of `decode_seconds`."""
    return [0.0] * num_decode + [(k + 1) * decode_seconds / (num_long + 1) for k in range(num_long)]


def chunked_side(runs: list[Run], num_decode: int) -> dict:
    """Latencies of one system over all its timed runs (ms): the decodes' ITL and TPOT, the long prompts'
    TTFT."""
    decodes = [trace for run in runs for trace in run.result.traces[:num_decode]]
    longs = [trace for run in runs for trace in run.result.traces[num_decode:]]
    return {"decode_itl_ms": spread(ms([itl for trace in decodes for itl in trace.itls])),
            "decode_tpot_ms": spread(ms([trace.tpot for trace in decodes if trace.tpot is not None])),
            "long_ttft_ms": spread(ms([trace.ttft for trace in longs])),
            "max_step_tokens": max(step.num_tokens for run in runs for step in run.result.steps)}


def chunked_prefill(args: argparse.Namespace, engines: Engines, ids: Sequence[int],
                    log: Callable[[str], None]) -> dict:
    """Chunked prefill on against off (see the module docstring)."""
    off_budget = max(args.max_model_len, args.long_prompt_len + args.max_num_seqs)  # tokens per step
    on = engines.get(enable_prefix_caching=False)
    off = engines.get(enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=off_budget)
    decodes, workload, warmup = chunked_workloads(args, ids)
    log(f"chunked-prefill: {workload.description}")
    decode_alone = [run_once(engine, decodes).result.seconds for engine in (on, off)]  # s, untimed
    arrivals = long_arrivals(sum(decode_alone) / 2, args.decode_requests, args.long_requests)
    log(f"  the decodes alone took {decode_alone[0]:.2f}s (on), {decode_alone[1]:.2f}s (off); long prompts arrive "
        "at " + ", ".join(f"{t:.2f}" for t in arrivals[args.decode_requests:]) + " s")
    systems = [System("chunked prefill on", on, workload, warmup, arrival_times=arrivals),
               System("chunked prefill off", off, workload, warmup, arrival_times=arrivals)]
    on_runs, off_runs = compare(systems, args.repeats, log)
    sides = []
    for system, runs, budget in zip(systems, (on_runs, off_runs), (args.max_num_batched_tokens, off_budget)):
        sides.append({"system": system.name, "max_num_batched_tokens": budget, **timing(runs),
                      **chunked_side(runs, args.decode_requests)})
    return {"workload": workload.description, "arrivals_s": arrivals[args.decode_requests:],
            "decode_alone_s": decode_alone, "systems": sides,
            "throughput_on_over_off": ratios(sides[0], sides[1], on_runs, off_runs),
            "same_tokens": same_tokens(on_runs[0].result.output_token_ids, off_runs[0].result.output_token_ids),
            "plots": plot_timelines(args.plot_dir, [on_runs[0], off_runs[0]]) if args.plot_dir else []}


def plot_timelines(plot_dir: str, runs: list[Run]) -> list[str]:
    """The step timelines (tokens and KV pages per step) of the first timed run of chunked prefill on and off."""
    from jaxserve.bench.plots import step_timeline

    os.makedirs(plot_dir, exist_ok=True)
    return [step_timeline(run.result.steps, PAGE_SIZE, os.path.join(plot_dir, name))
            for run, name in zip(runs, ("chunked_on.png", "chunked_off.png"))]


# ---- prefix caching ----------------------------------------------------------------------------------

@contextlib.contextmanager
def timed_methods(owner: object, names: Sequence[str]) -> Iterator[dict[str, dict]]:
    """Time the methods `names` of `owner` (an object, or a class: every instance's calls) while inside: yields
    {name: {"seconds", "calls"}}, summed over the calls. Each is wrapped by an attribute of `owner`, removed at the
    end (a class gets its own function back)."""
    totals = {name: {"seconds": 0.0, "calls": 0} for name in names}
    own = {name: vars(owner)[name] for name in names if name in vars(owner)}  # a class's own functions

    def timed(method, total):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                total["seconds"] += time.perf_counter() - start
                total["calls"] += 1
        return wrapper

    for name in names:
        setattr(owner, name, timed(getattr(owner, name), totals[name]))
    try:
        yield totals
    finally:
        for name in names:
            if name in own:
                setattr(owner, name, own[name])
            else:
                delattr(owner, name)


def cache_host_time(engine: LLMEngine, workload: Workload) -> dict:
    """One more, untimed, run with the prefix cache's hashing (cache_full_pages) and lookups
    (find_cached_prefix) timed: the host work caching adds (the pool's bookkeeping is not counted)."""
    with timed_methods(engine.core.kv, ("find_cached_prefix", "cache_full_pages")) as totals:
        run = run_once(engine, workload)
    cache_s = sum(total["seconds"] for total in totals.values())
    return {"run_s": run.result.seconds, "cache_s": cache_s, "share": cache_s / run.result.seconds,
            "methods": totals}


def prefix_side(system: System, runs: list[Run], ideal: int | None) -> dict:
    """One system of a prefix-cache comparison: timing, TTFT, cache hits (and hit rate against `ideal`)."""
    mean_ttfts = [stats.latency_summary(run.result.traces)["ttft_ms"]["mean"] for run in runs]  # ms, per run
    side = {"system": system.name, **timing(runs), "mean_ttft_ms": sum(mean_ttfts) / len(mean_ttfts),
            "mean_ttft_runs_ms": mean_ttfts, "hits_runs": [run.prefix_cache_hits for run in runs],
            "queries_runs": [run.prefix_cache_queries for run in runs]}
    if ideal is not None:
        side["hit_rate_runs"] = [run.prefix_cache_hits / ideal for run in runs]
    return side


def prefix_cache(args: argparse.Namespace, engines: Engines, ids: Sequence[int],
                 log: Callable[[str], None]) -> dict:
    """Prefix caching on against off, on a shared prefix and on a workload sharing nothing."""
    on, off = engines.get(), engines.get(enable_prefix_caching=False)
    shared = shared_prefix_workload(args.prefix_requests, ids, args.prefix_len, args.question_len,
                                    args.prefix_output_len, args.seed)
    shared_warmup = shared_prefix_workload(4, ids, args.prefix_len, args.question_len, WARMUP_OUTPUT_LEN,
                                           args.seed + 100)
    # The first request computes the prefix; every other one could reuse its full pages.
    ideal = (args.prefix_requests - 1) * (args.prefix_len // PAGE_SIZE) * PAGE_SIZE  # tokens
    log(f"prefix-cache, shared: {shared.description}")
    systems = [System("prefix caching on", on, shared, shared_warmup),
               System("prefix caching off", off, shared, shared_warmup)]
    on_runs, off_runs = compare(systems, args.repeats, log)
    shared_sides = [prefix_side(s, r, ideal) for s, r in zip(systems, (on_runs, off_runs))]
    shared_result = {"workload": shared.description, "ideal_hits": ideal, "systems": shared_sides,
                     "throughput_on_over_off": ratios(*shared_sides, on_runs, off_runs),
                     "ttft_off_over_on": shared_sides[1]["mean_ttft_ms"] / shared_sides[0]["mean_ttft_ms"],
                     "same_tokens": same_tokens(on_runs[0].result.output_token_ids,
                                                off_runs[0].result.output_token_ids)}

    unshared = random_workload(args.unshared_requests, ids, "uniform", 0, *UNSHARED_PROMPT_RANGE, "lognormal",
                               *UNSHARED_OUTPUT, args.seed + 1)
    unshared_warmup = random_workload(8, ids, "uniform", 0, *UNSHARED_PROMPT_RANGE, "fixed", WARMUP_OUTPUT_LEN, 1, 1,
                                      args.seed + 101)
    log(f"prefix-cache, nothing shared: {unshared.description}")
    systems = [System("prefix caching on", on, unshared, unshared_warmup),
               System("prefix caching off", off, unshared, unshared_warmup)]
    on_runs, off_runs = compare(systems, args.repeats, log)
    unshared_sides = [prefix_side(s, r, None) for s, r in zip(systems, (on_runs, off_runs))]
    host = cache_host_time(on, unshared)
    log(f"  instrumented run: {host['cache_s'] * 1000:.1f} ms of {host['run_s']:.2f}s in the cache's hashing and "
        f"lookups")
    unshared_result = {"workload": unshared.description, "systems": unshared_sides,
                       "throughput_on_over_off": ratios(*unshared_sides, on_runs, off_runs), "cache_host": host,
                       "same_tokens": same_tokens(on_runs[0].result.output_token_ids,
                                                  off_runs[0].result.output_token_ids)}
    return {"shared_prefix": shared_result, "no_sharing": unshared_result}


# ---- parallel sampling -------------------------------------------------------------------------------

def parallel_workloads(args: argparse.Namespace, ids: Sequence[int], num_prompts: int, output_len: int, seed: int,
                       params: dict[int, SamplingParams]) -> tuple[Workload, Workload]:
    """(one request per prompt with n samples, n requests per prompt), recording each request's SamplingParams
    in `params` under id(request). Prompt p's samples use the seeds seed + 1000 p + i, i < n (the engine seeds
    sample i of a request with its seed + i)."""
    prompts = random_workload(num_prompts, ids, "fixed", args.parallel_prompt_len, 1, 1, "fixed", output_len,
                              1, 1, seed)
    description = (f"{num_prompts} prompts of {args.parallel_prompt_len} tokens, {args.n} samples of {output_len} "
                   f"tokens each (temperature 1, seeded)")
    independent = []
    for p, request in enumerate(prompts.requests):
        prompt_seed = seed + 1000 * p
        params[id(request)] = SamplingParams(n=args.n, temperature=1.0, seed=prompt_seed, max_tokens=output_len,
                                             ignore_eos=True)
        for i in range(args.n):
            copy = BenchRequest(request.prompt_token_ids, output_len)  # its own object, so its own params
            params[id(copy)] = SamplingParams(temperature=1.0, seed=prompt_seed + i, max_tokens=output_len,
                                              ignore_eos=True)
            independent.append(copy)
    return (Workload(prompts.name, prompts.requests, description),
            Workload(prompts.name, tuple(independent), description))


def parallel_side(system: System, runs: list[Run]) -> dict:
    """One system of the parallel-sampling comparison: timing and KV pages (the peak over its runs; pages
    per running sample summed over the steps of its first run)."""
    peaks = [stats.peak_kv(run.result.steps, PAGE_SIZE) for run in runs]
    peak = max(peaks, key=lambda p: p["pages_in_use"])
    steps = runs[0].result.steps
    per_sample = sum(s.pages_in_use for s in steps) / max(1, sum(s.num_running for s in steps))
    return {"system": system.name, **timing(runs), "peak_kv": peak,
            "peak_pages_runs": [p["pages_in_use"] for p in peaks], "pages_per_running_sample": per_sample,
            "pages_per_sample_at_peak": peak["pages_in_use"] / max(1, peak["running"])}


def parallel_sampling(args: argparse.Namespace, engines: Engines, ids: Sequence[int],
                      log: Callable[[str], None]) -> dict:
    """n samples in one request (sharing the prompt's pages) against n independent requests."""
    engine = engines.get(enable_prefix_caching=False)
    params: dict[int, SamplingParams] = {}  # id(request) -> its sampling parameters
    shared, independent = parallel_workloads(args, ids, args.parallel_prompts, args.parallel_output_len, args.seed,
                                             params)
    warm_shared, warm_independent = parallel_workloads(args, ids, 1, WARMUP_OUTPUT_LEN, args.seed + 100, params)
    log(f"parallel-sampling: {shared.description}")
    systems = [System(f"n={args.n} in one request", engine, shared, warm_shared, lambda r: params[id(r)]),
               System(f"{args.n} independent requests", engine, independent, warm_independent,
                      lambda r: params[id(r)])]
    shared_runs, independent_runs = compare(systems, args.repeats, log)
    sides = [parallel_side(s, r) for s, r in zip(systems, (shared_runs, independent_runs))]
    first_samples = independent_runs[0].result.output_token_ids[::args.n]  # the requests seeded like sample 0
    return {"workload": shared.description, "systems": sides,
            "peak_pages_shared_over_independent": sides[0]["peak_kv"]["pages_in_use"]
            / sides[1]["peak_kv"]["pages_in_use"],
            "pages_per_sample_shared_over_independent": sides[0]["pages_per_running_sample"]
            / sides[1]["pages_per_running_sample"],
            "throughput_shared_over_independent": ratios(*sides, shared_runs, independent_runs),
            "same_tokens": same_tokens(shared_runs[0].result.output_token_ids, first_samples)}


# ---- asynchronous scheduling and multi-step decoding ---------------------------------------------------

def overlap(args: argparse.Namespace, engines: Engines, ids: Sequence[int], log: Callable[[str], None]) -> dict:
    """The synchronous engine against asynchronous scheduling with each of --scheduler-steps (see the module
    docstring)."""
    workload = random_workload(args.unshared_requests, ids, "uniform", 0, *UNSHARED_PROMPT_RANGE, "lognormal",
                               *UNSHARED_OUTPUT, args.seed + 1)
    warmup = random_workload(8, ids, "uniform", 0, *UNSHARED_PROMPT_RANGE, "fixed", WARMUP_OUTPUT_LEN, 1, 1,
                             args.seed + 101)
    log(f"overlap: {workload.description}")
    systems = [System("sync, 1 step", engines.get(async_scheduling=False), workload, warmup)]
    systems += [System(f"async, {steps} step{'s' if steps > 1 else ''}",
                       engines.get(async_scheduling=True, num_scheduler_steps=steps), workload, warmup)
                for steps in args.scheduler_steps]
    runs = compare(systems, args.repeats, log)
    sides = [overlap_side(system, system_runs) for system, system_runs in zip(systems, runs)]
    return {"workload": workload.description, "systems": sides,
            "throughput_over_sync": [ratios(side, sides[0], side_runs, runs[0])
                                     for side, side_runs in zip(sides[1:], runs[1:])],
            "same_tokens_as_sync": [same_tokens(side_runs[0].result.output_token_ids,
                                                runs[0][0].result.output_token_ids) for side_runs in runs[1:]]}


def overlap_side(system: System, runs: list[Run]) -> dict:
    """One system of the overlap experiment: throughput, ITL and TPOT over all its runs (ms), the steps
    dispatched to the device in each run, and the engine's timing of its best run."""
    traces = [trace for run in runs for trace in run.result.traces]
    best = min(runs, key=lambda run: run.result.seconds)
    return {"system": system.name, **timing(runs),
            "itl_ms": spread(ms([itl for trace in traces for itl in trace.itls])),
            "tpot_ms": spread(ms([trace.tpot for trace in traces if trace.tpot is not None])),
            "steps_runs": [run.timing["steps"] for run in runs], "timing_best_run": best.timing}  # device steps


EXPERIMENTS = {"chunked-prefill": chunked_prefill, "prefix-cache": prefix_cache, "overlap": overlap,
               "parallel-sampling": parallel_sampling, "preemption": preemption.preemption,
               "speculation": speculation.speculation,
               "quantization": lambda args, engines, ids, log: quantization.quantization(
                   args, engines, ids, log, UNSHARED_PROMPT_RANGE, UNSHARED_OUTPUT, WARMUP_OUTPUT_LEN)}


# ---- report -------------------------------------------------------------------------------------------

def _timing_cells(side: dict) -> str:
    """The mean tok/s, best tok/s and timed runs cells of a table row."""
    return (f"{side['output_tokens_per_s']:.0f} | {side['best_output_tokens_per_s']:.0f} | "
            + ", ".join(f"{s:.2f}" for s in side["runs_s"]))


def _ratio_text(ratio: dict) -> str:
    """Throughput ratios in words."""
    return (f"{ratio['mean']:.2f}x mean, {ratio['best']:.2f}x best, per round "
            + ", ".join(f"{r:.2f}x" for r in ratio["rounds"]))


def chunked_lines(result: dict) -> list[str]:
    """The chunked-prefill report."""
    on, off = result["systems"]
    lines = [f"### chunked prefill: {result['workload']}", "",
             "long prompts arrive at " + ", ".join(f"{t:.2f}" for t in result["arrivals_s"])
             + " s (spread over the decodes' lifetime: alone, untimed, they took "
             + " s on and ".join(f"{t:.2f}" for t in result["decode_alone_s"]) + " s off)", "",
             "| system | step budget / largest step (tokens) | mean tok/s | best tok/s | timed runs (s) "
             "| decode ITL p50 / p99 / max (ms) | decode TPOT mean / p99 (ms) | long-prompt TTFT mean / max (ms) |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    for side in result["systems"]:
        itl, tpot, ttft = side["decode_itl_ms"], side["decode_tpot_ms"], side["long_ttft_ms"]
        lines.append(f"| {side['system']} | {side['max_num_batched_tokens']} / {side['max_step_tokens']} | "
                     f"{_timing_cells(side)} | {cell(itl['p50'])} / {cell(itl['p99'])} / {cell(itl['max'])} | "
                     f"{cell(tpot['mean'])} / {cell(tpot['p99'])} | {cell(ttft['mean'])} / {cell(ttft['max'])} |")
    lines += ["", f"on / off: throughput {_ratio_text(result['throughput_on_over_off'])}; decode ITL off / on: "
              f"p99 {off['decode_itl_ms']['p99'] / on['decode_itl_ms']['p99']:.2f}x, max "
              f"{off['decode_itl_ms']['max'] / on['decode_itl_ms']['max']:.2f}x; long-prompt TTFT on / off "
              f"{on['long_ttft_ms']['mean'] / off['long_ttft_ms']['mean']:.2f}x (mean); greedy tokens on == off for "
              f"{result['same_tokens'][0]}/{result['same_tokens'][1]} requests"]
    return lines + [f"wrote {path}" for path in result["plots"]]


def _prefix_table(sides: list[dict]) -> list[str]:
    """A prefix-cache comparison's table."""
    lines = ["| system | mean tok/s | best tok/s | timed runs (s) | mean TTFT (ms) | prefix-cache hits / queries "
             "(tokens, first run) |", "|---|---:|---:|---|---:|---:|"]
    for side in sides:
        lines.append(f"| {side['system']} | {_timing_cells(side)} | {side['mean_ttft_ms']:.1f} | "
                     f"{side['hits_runs'][0]} / {side['queries_runs'][0]} |")
    return lines


def prefix_lines(result: dict) -> list[str]:
    """The prefix-cache report: the shared prefix, then the workload sharing nothing."""
    shared, unshared = result["shared_prefix"], result["no_sharing"]
    rates = shared["systems"][0]["hit_rate_runs"]
    host = unshared["cache_host"]
    calls = ", ".join(f"{name} {t['calls']} calls {1000 * t['seconds']:.1f} ms" for name, t in host["methods"].items())
    return [f"### prefix caching, shared prefix: {shared['workload']}", "", *_prefix_table(shared["systems"]), "",
            f"hit rate with caching on: {shared['systems'][0]['hits_runs'][0]} hit tokens / {shared['ideal_hits']} "
            f"ideal = {100 * rates[0]:.1f}% (lowest over the runs {100 * min(rates):.1f}%); off "
            f"{100 * shared['systems'][1]['hit_rate_runs'][0]:.1f}%",
            f"on / off: throughput {_ratio_text(shared['throughput_on_over_off'])}; mean TTFT off / on "
            f"{shared['ttft_off_over_on']:.2f}x; greedy tokens on == off for {shared['same_tokens'][0]}/"
            f"{shared['same_tokens'][1]} requests", "",
            f"### prefix caching, nothing shared: {unshared['workload']}", "", *_prefix_table(unshared["systems"]),
            "", f"on / off: throughput {_ratio_text(unshared['throughput_on_over_off'])}; greedy tokens on == off "
            f"for {unshared['same_tokens'][0]}/{unshared['same_tokens'][1]} requests",
            f"host time in the cache's hashing and lookups (one more run, caching on): {1000 * host['cache_s']:.1f} ms "
            f"of {host['run_s']:.2f} s = {100 * host['share']:.2f}% ({calls})"]


def overlap_lines(result: dict) -> list[str]:
    """The overlap report: asynchronous scheduling and multi-step decoding against the synchronous engine."""
    lines = [f"### asynchronous scheduling and multi-step decoding: {result['workload']}", "",
             "| system | mean tok/s | best tok/s | timed runs (s) | device steps | ITL p50 / p99 (ms) "
             "| TPOT mean / p99 (ms) "
             "| host ms per step: schedule / build / dispatch / wait / update / output (best run) | device idle |",
             "|---|---:|---:|---|---:|---:|---:|---|---:|"]
    for side in result["systems"]:
        itl, tpot, host = side["itl_ms"], side["tpot_ms"], side["timing_best_run"]
        phases = " / ".join(f"{host[phase + '_ms']:.2f}" for phase in PHASES)
        lines.append(f"| {side['system']} | {_timing_cells(side)} | {side['steps_runs'][0]} | {cell(itl['p50'])} / "
                     f"{cell(itl['p99'])} | {cell(tpot['mean'])} / {cell(tpot['p99'])} | {phases} | "
                     f"{100 * host['device_idle_fraction']:.1f}% |")
    lines.append("")
    for side, ratio, same in zip(result["systems"][1:], result["throughput_over_sync"], result["same_tokens_as_sync"]):
        lines.append(f"{side['system']} / sync: throughput {_ratio_text(ratio)}; greedy tokens equal for "
                     f"{same[0]}/{same[1]} requests")
    return lines


def parallel_lines(result: dict) -> list[str]:
    """The parallel-sampling report."""
    lines = [f"### parallel sampling: {result['workload']}", "",
             "| system | mean tok/s | best tok/s | timed runs (s) | peak KV pages | samples running at the peak "
             "(most) | pages per running sample (over steps) | pages per sample at the peak |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for side in result["systems"]:
        peak = side["peak_kv"]
        lines.append(f"| {side['system']} | {_timing_cells(side)} | {peak['pages_in_use']} | {peak['running']} "
                     f"({peak['max_running']}) | {side['pages_per_running_sample']:.1f} | "
                     f"{side['pages_per_sample_at_peak']:.1f} |")
    same = result["same_tokens"]
    return lines + ["", f"shared / independent: peak pages {result['peak_pages_shared_over_independent']:.3f}, "
                    f"pages per running sample {result['pages_per_sample_shared_over_independent']:.3f}, throughput "
                    f"{_ratio_text(result['throughput_shared_over_independent'])}; sample 0 == the request seeded "
                    f"like it for {same[0]}/{same[1]} prompts"]


def report_lines(result: dict) -> list[str]:
    """The whole report, one section per experiment run."""
    lines = [f"## jaxserve bench effects: {result['model']} ({result['elapsed_s']:.0f} s in all; load average "
             f"{result['load_before']} before, {result['load_after']} after)"]
    sections = {"chunked-prefill": chunked_lines, "prefix-cache": prefix_lines, "overlap": overlap_lines,
                "parallel-sampling": parallel_lines, "preemption": preemption.preemption_lines,
                "speculation": speculation.speculation_lines, "quantization": quantization.quantization_lines}
    for effect, effect_result in result["effects"].items():
        lines += ["", *sections[effect](effect_result)]
    return lines


def _load_average() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(f"{load:.1f}" for load in os.getloadavg())


def run(args: argparse.Namespace) -> dict:
    """Run `jaxserve bench effects`: print the report, write --json (and --plot-dir); the result."""
    resolve_sizes(args)
    start = time.perf_counter()
    log = make_logger()
    result = {"load_before": _load_average()}
    folder = models.model_from_args(args, log)
    ids = vocab_ids(load_tokenizer(folder))
    engines = Engines(args, folder, log)
    result.update(model=folder, args=command_args(args), effects={})
    for effect in EFFECTS:
        if effect in args.effect:
            result["effects"][effect] = EXPERIMENTS[effect](args, engines, ids, log)
    result.update(load_after=_load_average(), elapsed_s=time.perf_counter() - start)
    print("\n".join(report_lines(result)))
    if args.json:
        write_json(args.json, result)
    return result
