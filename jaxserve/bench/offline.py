"""`jaxserve bench throughput`: one workload through several systems in turn, on the same weights and prompts.

Systems (--systems; all six by default):
  jaxserve         continuous batching with a paged KV cache: the engine as it serves
  jaxserve-sync    the same with async_scheduling off: each step's samples reach the host before the next
                   step is planned (the engine without asynchronous scheduling)
  jaxserve-static  the same engine options and KV budget (same --num-pages) with batching="static" and no
                   prefix caching: a batch is admitted only when the previous one has finished, and each
                   sequence reserves max_model_len of pages up front (a pre-paging server)
  hf-generate      Hugging Face transformers `generate` in static batches (in request order, left padded,
                   EOS disabled, each batch generating its longest requested output); best of --hf-batch-sizes
  hf-continuous    transformers' own continuous batching (its paged cache with the same page size, pages and
                   batch limits as jaxserve), each request with its own max_new_tokens and no EOS
  ctranslate2      CTranslate2 converted from the same folder, static batches like hf-generate, in its own
                   process (it and torch fight over OpenMP threads in one)
Peers that cannot run (torch or ctranslate2 missing, no weights in the folder, jaxserve on dummy weights) are
reported as skipped, with the reason.

Timing is the same for every system: the same untimed warm-up (--warmup-requests of the workload's first
requests, --warmup-tokens tokens each), then --repeats rounds, each running every system once on the whole
workload, the order alternating between rounds (so a slow spell of a shared machine does not always hit the
same system). Every request generates exactly its requested tokens (EOS ignored), so every system does the
same useful work; the table gives mean and best requests/s, output and total tokens/s, and each system's
ratio to jaxserve (mean over mean, best over best).

Also reported: KV memory at the step holding the most pages (pages in use against token slots used:
fragmentation, and for static batching what reservation wastes), the most requests running at once, the
headline ratio jaxserve / jaxserve-static at the same KV budget, jaxserve's engine overhead (1 - device-only /
end-to-end time: one more untimed run records every Runner.dispatch input, and replaying them through the same
executables gives the device-only time; for jaxserve and jaxserve-sync), the host time per step by phase and
the device's idle share (EngineCore.stats()["timing"]), and checks that jaxserve's first greedy tokens equal
Hugging Face's (batch of one) and that jaxserve-sync's and jaxserve-static's outputs equal jaxserve's.

KV budget: --num-pages defaults to enough pages for --max-num-seqs sequences of the workload's mean length
(prompt + output, rounded up to pages), plus the null page; at least one max_model_len sequence. The paged
engine is then rarely short of pages, while static batching fits (num_pages - 1) // ceil(max_model_len /
page_size) sequences at once.

Example:
    jaxserve bench throughput --quick
    jaxserve bench throughput --model-shape llama-small --json tp.json --plot-dir bench-plots
    jaxserve bench throughput --model-shape llama-3.1-8b --systems jaxserve jaxserve-static
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxserve.bench import ct2_worker, hf_systems, models, stats
from jaxserve.bench.driver import DriveResult, drive
from jaxserve.bench.results import command_args, write_json
from jaxserve.bench.workloads import BenchRequest, Workload, add_workload_arguments, workload_from_args
from jaxserve.config import VALID_DTYPES, EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.step_timing import PHASES
from jaxserve.kv.cache_manager import pages_for_tokens
from jaxserve.model.registry import load_model_spec
from jaxserve.tokenizer import load_tokenizer

SYSTEMS = ("jaxserve", "jaxserve-sync", "jaxserve-static", "hf-generate", "hf-continuous", "ctranslate2")
JAXSERVE_SYSTEMS = SYSTEMS[:3]
PEERS = SYSTEMS[3:]
DEFAULT_MAX_MODEL_LEN = 1024  # tokens, bounded by the model's max_position_embeddings
NUM_REQUESTS = 128  # default workload size
QUICK_NUM_REQUESTS = 32  # with --quick
ENGINE_COUNTERS = ("steps", "preemptions", "compilations_after_warmup", "lazy_bucket_compilations")

# A system (jaxserve's below, hf_systems.HFGenerate / HFContinuous, ct2_worker.CTranslate2) has `name` and:
#   warm_up(requests: Sequence[BenchRequest], tokens: int)  untimed: generate `tokens` tokens for each request
#   timed_run(workload: Workload)                          one timed run of the whole workload (recorded)
#   result() -> {"runs_s": [s, ...], "output_token_ids": [[id, ...] per request], "details": {...}}
#   close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `jaxserve bench throughput`."""
    add_workload_arguments(parser)
    parser.set_defaults(num_requests=None)
    for action in parser._actions:
        if action.dest == "num_requests":
            action.help = f"requests in the workload (default {NUM_REQUESTS}; {QUICK_NUM_REQUESTS} with --quick)"
    models.add_model_arguments(parser)
    systems = parser.add_argument_group("systems")
    systems.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS),
                         help="which systems to run, in this order in the first round (default: all)")
    systems.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16, 64],
                         help="static batch sizes tried by hf-generate and ctranslate2; each is timed in every "
                              "round and the best mean is reported (default: 16 64)")
    systems.add_argument("--peer-threads", type=int, default=None,
                         help="torch threads of the Hugging Face systems and CTranslate2's intra_threads (default: "
                              "the faster of os.cpu_count() and 1 on a short generate, per configuration: on a "
                              "shared machine, OpenMP threads can be many times slower when a core is busy)")
    systems.add_argument("--calibration-tokens", type=int, default=8,
                         help="new tokens of that short generate (default: %(default)s)")
    engine = parser.add_argument_group("engine (both jaxserve systems; hf-continuous shares the KV budget and "
                                       "the limits)")
    engine.add_argument("--max-num-seqs", type=int, default=128, help="(default: %(default)s)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="tokens per step (default: %(default)s)")
    engine.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: %(default)s)")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help=f"longest prompt + output; static batching reserves this much KV per sequence "
                             f"(default: {DEFAULT_MAX_MODEL_LEN}, or the model's max_position_embeddings if less)")
    engine.add_argument("--num-pages", type=int, default=None,
                        help="KV pages of each engine, the KV budget (default: --max-num-seqs sequences of the "
                             "workload's mean length, plus the null page)")
    engine.add_argument("--dtype", choices=VALID_DTYPES, default="auto",
                        help="weights and KV dtype of every system (default: the model's)")
    engine.add_argument("--min-token-bucket", type=int, default=8,
                        help="smallest token bucket (default: %(default)s)")
    engine.add_argument("--min-page-bucket", type=int, default=1,
                        help="smallest page-table width bucket, in pages (default: %(default)s)")
    engine.add_argument("--compilation-cache-dir", default=None,
                        help="XLA compilation cache (default: <cache-dir>/xla-cache)")
    timing = parser.add_argument_group("timing")
    timing.add_argument("--repeats", type=int, default=3,
                        help="timed rounds, each running every system once (default: %(default)s)")
    timing.add_argument("--warmup-requests", type=int, default=8,
                        help="the untimed warm-up every system gets: this many of the first requests ... "
                             "(default: %(default)s)")
    timing.add_argument("--warmup-tokens", type=int, default=16,
                        help="... generating this many tokens each (default: %(default)s)")
    checks = parser.add_argument_group("checks")
    checks.add_argument("--check-requests", type=int, default=4,
                        help="requests whose first greedy tokens are compared with Hugging Face's "
                             "(default: %(default)s)")
    checks.add_argument("--check-tokens", type=int, default=8,
                        help="tokens compared per request (default: %(default)s)")
    output = parser.add_argument_group("output")
    output.add_argument("--quick", action="store_true",
                        help=f"a small workload for iteration ({QUICK_NUM_REQUESTS} requests)")
    output.add_argument("--json", metavar="PATH", help="write every result as JSON here")
    output.add_argument("--plot-dir", metavar="DIR",
                        help="write throughput.png and the step timelines (timeline_jaxserve.png, "
                             "timeline_jaxserve-static.png) here")


# ---- jaxserve -------------------------------------------------------------------------------------------

class JaxserveSystem:
    """One jaxserve engine (continuous or static batching) driven by driver.drive."""

    def __init__(self, name: str, config: EngineConfig, log: Callable[[str], None]):
        self.name, self.log = name, log
        start = time.perf_counter()
        self.engine = LLMEngine(config, show_progress=False)
        self.build_s = time.perf_counter() - start
        self.runs: list[DriveResult] = []
        self.counters: list[dict] = []  # ENGINE_COUNTERS moved by each run
        log(f"  {name}: engine ready in {self.build_s:.1f}s ({self.engine.core.num_pages} KV pages)")

    def warm_up(self, requests: Sequence[BenchRequest], tokens: int) -> None:
        """Generate `tokens` tokens for each request."""
        warm = tuple(BenchRequest(r.prompt_token_ids, tokens) for r in requests)
        drive(self.engine, Workload("warm-up", warm, "warm-up"))

    def timed_run(self, workload: Workload) -> None:
        """One timed run of the whole workload, from an empty prefix cache."""
        self.engine.reset_prefix_cache()
        self.engine.core.timing.reset()
        before = self.engine.stats()
        run = drive(self.engine, workload)
        after = self.engine.stats()
        wrong = sum(len(ids) != r.output_len for ids, r in zip(run.output_token_ids, workload.requests))
        if wrong:
            raise RuntimeError(f"{self.name} gave {wrong} requests the wrong number of tokens")
        self.runs.append(run)
        self.counters.append({**{key: after[key] - before[key] for key in ENGINE_COUNTERS}, "timing": after["timing"]})
        self.log(f"  {self.name}: {run.seconds:.2f}s, {workload.num_output_tokens / run.seconds:.1f} output tok/s, "
                 f"{len(run.steps)} steps")
        timing = after["timing"]
        rows = sum(record.num_running for record in run.steps) / max(len(run.steps), 1)
        self.log(f"  {self.name} host ms per step: " + ", ".join(f"{phase} {timing[phase + '_ms']:.2f}"
                                                                   for phase in PHASES)
                 + f"; device idle {100 * timing['device_idle_fraction']:.1f}%; {rows:.1f} requests running a step")

    def best_run(self) -> DriveResult:
        """The fastest timed run."""
        return min(self.runs, key=lambda run: run.seconds)

    def result(self) -> dict:
        """{"runs_s", "output_token_ids", "details"}."""
        best = self.runs.index(self.best_run())
        return {"runs_s": [run.seconds for run in self.runs], "output_token_ids": self.runs[0].output_token_ids,
                "details": {"engine_build_s": self.build_s, "num_pages": self.engine.core.num_pages,
                            "max_model_len": self.engine.max_model_len, **self.counters[best]}}

    def device_only(self, workload: Workload, replays: int) -> dict:
        """Engine overhead: one more (untimed) run records every Runner.dispatch input (host copies), then
        the recorded steps are replayed `replays` times through the same runner and executables, each
        dispatched as soon as the last one is (the host does nothing else) and the last one waited for.
        Returns the replays' seconds and 1 - device-only / end-to-end (best over best, mean over mean)."""
        import jax

        runner = self.engine.core.runner
        recorded = []  # (batch, sampling, prompt) per step, as numpy copies
        dispatch = runner.dispatch

        def recording_dispatch(*step_args):
            recorded.append(jax.tree_util.tree_map(lambda leaf: np.array(leaf, copy=True), step_args))
            return dispatch(*step_args)

        runner.dispatch = recording_dispatch
        try:
            self.engine.reset_prefix_cache()
            drive(self.engine, workload)
        finally:
            del runner.dispatch  # the class's method again
        replay_s = []
        for _ in range(replays):
            gc.collect()
            start = time.perf_counter()
            for step_args in recorded:
                pending = runner.dispatch(*step_args)
            pending.fetch()
            replay_s.append(time.perf_counter() - start)
        self.engine.reset_prefix_cache()  # the replays rewrote the KV of cached pages
        runs_s = [run.seconds for run in self.runs]
        return {"device_only_runs_s": replay_s, "end_to_end_runs_s": runs_s, "recorded_steps": len(recorded),
                "timed_steps": self.counters[self.runs.index(self.best_run())]["steps"],  # dispatched steps
                "overhead_best": 1.0 - min(replay_s) / min(runs_s),
                "overhead_mean": 1.0 - float(np.mean(replay_s)) / float(np.mean(runs_s))}

    def close(self) -> None:
        """Drop the engine (its device buffers go with it)."""
        self.engine = None
        gc.collect()


# ---- setup --------------------------------------------------------------------------------------------

def make_logger() -> Callable[[str], None]:
    """A log function: timestamped lines (seconds since now) on stderr."""
    start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {message}", file=sys.stderr, flush=True)

    return log


def model_dtype(folder: str, dtype: str) -> str:
    """`dtype`, or the model's own when "auto" (config.json's dtype / torch_dtype, else float32)."""
    if dtype != "auto":
        return dtype
    return load_model_spec(folder).torch_dtype


def default_max_model_len(folder: str) -> int:
    """DEFAULT_MAX_MODEL_LEN, or the model's max_position_embeddings when smaller."""
    return min(DEFAULT_MAX_MODEL_LEN, load_model_spec(folder).max_position_embeddings)


def default_num_pages(workload: Workload, max_num_seqs: int, page_size: int, max_model_len: int) -> int:
    """Pages for `max_num_seqs` sequences of the workload's mean length (prompt + output, in whole pages), plus
    the null page; at least one max_model_len sequence plus the null page."""
    mean_len = (workload.num_prompt_tokens + workload.num_output_tokens) / len(workload.requests)  # tokens
    per_sequence = pages_for_tokens(int(np.ceil(mean_len)), page_size)
    return 1 + max(max_num_seqs * per_sequence, pages_for_tokens(max_model_len, page_size))


def engine_config(args: argparse.Namespace, folder: str, system: str = "jaxserve") -> EngineConfig:
    """The engine options of a jaxserve system (jaxserve-sync: async_scheduling off; jaxserve-static:
    batching="static", which turns prefix caching off), without the structured-output sampler buckets."""
    extra = {"jaxserve": {}, "jaxserve-sync": {"async_scheduling": False},
             "jaxserve-static": {"batching": "static"}}[system]
    return EngineConfig(
        model=folder, dtype=args.dtype, max_model_len=args.max_model_len, page_size=args.page_size,
        num_pages=args.num_pages, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        min_token_bucket=args.min_token_bucket, min_page_bucket=args.min_page_bucket, seed=args.seed,
        compilation_cache_dir=args.compilation_cache_dir,
        load_format=args.load_format, enable_structured_outputs=False, **extra)  # no benchmark request constrains


def peer_blocker(name: str, args: argparse.Namespace, folder: str, dtype: str) -> str | None:
    """Why peer `name` cannot run on this model; None when it can."""
    if args.load_format == "dummy":
        if models.needs_dummy_weights(folder):
            return "the model folder has no weights (jaxserve runs random device weights: load_format dummy)"
        return "jaxserve runs random device weights (load_format dummy), not the folder's"
    if name == "ctranslate2":
        return ct2_worker.unavailable_reason()
    if dtype not in hf_systems.TORCH_DTYPES:
        return f"dtype {dtype} is not one of {', '.join(hf_systems.TORCH_DTYPES)}"
    return hf_systems.unavailable_reason()


def build_systems(args: argparse.Namespace, folder: str, dtype: str, pad_id: int,
                  log: Callable[[str], None]) -> tuple[list, dict[str, str], object]:
    """(the systems, in --systems order; {skipped system: reason}; the Hugging Face model or None)."""
    systems, skipped, hf_model = {}, {}, None
    for name in JAXSERVE_SYSTEMS:
        if name in args.systems:
            systems[name] = JaxserveSystem(name, engine_config(args, folder, name), log)
    for name in (name for name in PEERS if name in args.systems):
        reason = peer_blocker(name, args, folder, dtype)
        if reason is None:
            try:
                systems[name], hf_model = make_peer(name, args, folder, dtype, pad_id, hf_model, log)
            except Exception as error:  # a peer that fails to start is reported, not fatal
                reason = f"failed to start: {type(error).__name__}: {error}"
        if reason is not None:
            skipped[name] = reason
            log(f"  {name}: skipped ({reason})")
    return [systems[name] for name in args.systems if name in systems], skipped, hf_model


def peer_threads(args: argparse.Namespace) -> list[int]:
    """Thread counts the peers try: --peer-threads, else os.cpu_count() and 1."""
    return [args.peer_threads] if args.peer_threads else sorted({os.cpu_count() or 1, 1}, reverse=True)


def make_peer(name: str, args: argparse.Namespace, folder: str, dtype: str, pad_id: int, hf_model,
              log: Callable[[str], None]):
    """(the peer system `name`, the Hugging Face model: loaded here on first need)."""
    if name == "ctranslate2":
        return ct2_worker.CTranslate2(folder, args.cache_dir, dtype, args.hf_batch_sizes, peer_threads(args),
                                      args.calibration_tokens, log), hf_model
    if hf_model is None:
        import torch

        torch.manual_seed(args.seed)
        start = time.perf_counter()
        hf_model = hf_systems.load_model(folder, dtype)
        log(f"  Hugging Face model loaded in {time.perf_counter() - start:.1f}s (torch {torch.__version__})")
    if name == "hf-generate":
        return hf_systems.HFGenerate(hf_model, pad_id, args.hf_batch_sizes, peer_threads(args),
                                     args.calibration_tokens, log), hf_model
    return hf_systems.HFContinuous(hf_model, args.page_size, args.num_pages, args.max_num_seqs,
                                   args.max_num_batched_tokens, args.seed, peer_threads(args),
                                   args.calibration_tokens, log), hf_model


# ---- measuring ------------------------------------------------------------------------------------------

def run_each(systems: list, action: Callable, stage: str, skipped: dict[str, str],
             log: Callable[[str], None]) -> list:
    """`action(system)` for each system in order. A peer that fails is closed and dropped (the reason goes to
    `skipped`); jaxserve's errors propagate. Returns the systems still standing, in order."""
    standing = []
    for system in systems:
        gc.collect()
        try:
            action(system)
        except Exception as error:
            if isinstance(system, JaxserveSystem):
                raise
            skipped[system.name] = f"failed in {stage}: {type(error).__name__}: {error}"
            log(f"  {system.name}: {skipped[system.name]}")
            system.close()
            continue
        standing.append(system)
    return standing


def timed_rounds(systems: list, skipped: dict[str, str], workload: Workload, repeats: int,
                 log: Callable[[str], None]) -> list:
    """`repeats` rounds, each timing every system once on the whole workload, in forward then reversed order;
    returns the systems still standing (see run_each)."""
    for repeat in range(repeats):
        order = systems if repeat % 2 == 0 else systems[::-1]
        log(f"timed round {repeat + 1}/{repeats}: {', '.join(system.name for system in order)}")
        standing = run_each(order, lambda system: system.timed_run(workload), f"round {repeat + 1}", skipped, log)
        systems = [system for system in systems if system in standing]
    return systems


def throughput_row(system: str, runs_s: Sequence[float], workload: Workload) -> dict:
    """A table row: requests/s, output and total tokens/s at the mean run and (best_*) at the best run."""
    return {"system": system, **stats.throughput_of_runs(len(workload.requests), workload.num_prompt_tokens,
                                                         workload.num_output_tokens, runs_s)}


def add_ratios(rows: list[dict], reference: str = "jaxserve") -> None:
    """Each row's output tokens/s over the reference row's: "ratio_mean" (mean over mean) and "ratio_best"
    (best over best); None without a reference row."""
    ref = next((row for row in rows if row["system"] == reference), None)
    for row in rows:
        row["ratio_mean"] = row["output_tokens_per_s"] / ref["output_tokens_per_s"] if ref else None
        row["ratio_best"] = row["best_output_tokens_per_s"] / ref["best_output_tokens_per_s"] if ref else None


def kv_report(system: JaxserveSystem, page_size: int) -> dict:
    """KV memory of the system's fastest run: at its step with the most pages held (stats.peak_kv), the
    fragmentation at its step holding the most tokens, and the mean fragmentation over the steps holding pages,
    weighted by step time. For static batching also the pages each sequence reserves, how many sequences fit,
    and what reservation wastes (1 - used / reserved: that mean)."""
    steps = system.best_run().steps
    report = stats.peak_kv(steps, page_size)
    holding = [step for step in steps if step.pages_in_use]
    if holding:
        fullest = max(holding, key=lambda step: step.token_slots_used)
        each = [stats.fragmentation(step.pages_in_use, page_size, step.token_slots_used) for step in holding]
        report.update(fragmentation_at_most_tokens=stats.fragmentation(fullest.pages_in_use, page_size,
                                                                       fullest.token_slots_used),
                      fragmentation_mean=float(np.average(each, weights=[s.end - s.start for s in holding])))
    if system.engine.config.scheduler_config.batching == "static":
        reserved = pages_for_tokens(system.engine.max_model_len, page_size)
        report.update(reserved_pages_per_sequence=reserved,
                      capacity_sequences=(system.engine.core.num_pages - 1) // reserved,
                      reservation_waste=report.get("fragmentation_mean", 0.0))
    return report


def check_outputs(outputs: dict[str, list[list[int]]], workload: Workload, hf_model, pad_id: int,
                  num_requests: int, num_tokens: int) -> dict:
    """Greedy agreement: for `num_requests` evenly spread requests, jaxserve's first tokens against Hugging
    Face's `generate` of that prompt alone (when hf_model is given) and against every other system's; and
    jaxserve-sync's and jaxserve-static's whole outputs against jaxserve's."""
    reference = outputs.get("jaxserve")
    if reference is None or num_requests < 1:
        return {}
    picks = sorted(set(np.linspace(0, len(workload.requests) - 1, num_requests).round().astype(int).tolist()))
    tokens = min(num_tokens, *(workload.requests[i].output_len for i in picks))
    check = {"requests": picks, "tokens": tokens, "agreement": {
        name: sum(ids[i][:tokens] == reference[i][:tokens] for i in picks) for name, ids in outputs.items()
        if name != "jaxserve"}}
    if hf_model is not None:
        mismatches = []
        for i in picks:
            prompt = workload.requests[i].prompt_token_ids
            want = hf_systems.generate_static(hf_model, [prompt], tokens, pad_id)[0].tolist()
            if reference[i][:tokens] != want:
                mismatches.append({"request": i, "jaxserve": reference[i][:tokens], "hf": want})
        check["hf_reference"] = {"matching": len(picks) - len(mismatches), "of": len(picks), "mismatches": mismatches}
    check["equal_to_jaxserve"] = {name: {"matching": sum(a == b for a, b in zip(outputs[name], reference)),
                                         "of": len(reference)}
                                  for name in JAXSERVE_SYSTEMS[1:] if name in outputs}
    return check


# ---- report ---------------------------------------------------------------------------------------------

def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_report(result: dict) -> str:
    """The printed report of a run's result."""
    engine, workload = result["engine"], result["workload"]
    lines = ["", "throughput: every system on the same weights and prompts (EOS ignored: exact output lengths)",
             f"model: {result['model']['folder']} ({result['model']['dtype']}, load_format "
             f"{result['model']['load_format']})",
             f"workload: {workload['description']} (seed {workload['seed']}); {workload['prompt_tokens']} prompt + "
             f"{workload['output_tokens']} output tokens",
             f"engine: max_num_seqs {engine['max_num_seqs']}, max_num_batched_tokens "
             f"{engine['max_num_batched_tokens']}, "
             f"page_size {engine['page_size']}, max_model_len {engine['max_model_len']}, KV budget "
             f"{engine['num_pages']} pages ({engine['num_pages'] * engine['page_size']} token slots)",
             f"timing: the same warm-up ({result['timing']['warmup_requests']} requests x "
             f"{result['timing']['warmup_tokens']} tokens), then {result['timing']['repeats']} timed round(s) in "
             f"alternating order",
             ""]
    header = (f"{'system':<16}{'req/s':>8}{'out tok/s':>11}{'best':>9}{'total tok/s':>13}{'best':>9}"
              f"{'x jaxserve':>12}{'best':>7}  runs (s)")
    lines += [header, "-" * len(header)]
    for row in result["rows"]:
        lines.append(f"{row['system']:<16}{row['requests_per_s']:>8.2f}{row['output_tokens_per_s']:>11.1f}"
                     f"{row['best_output_tokens_per_s']:>9.1f}{row['total_tokens_per_s']:>13.1f}"
                     f"{row['best_total_tokens_per_s']:>9.1f}{_ratio(row['ratio_mean']):>12}"
                     f"{_ratio(row['ratio_best']):>7}  {', '.join(f'{s:.2f}' for s in row['runs_s'])}")
    for name, reason in result["skipped"].items():
        lines.append(f"{name:<16}skipped: {reason}")
    for name, system in result["systems"].items():
        if "batch_size" in system["details"]:
            lines.append(f"{name}: batch size {system['details']['batch_size']} (best mean of "
                         f"{', '.join(system['details']['batch_sizes'])})")
    lines.append("")
    for name, kv in result["kv"].items():
        lines.append(f"KV {name}: at the peak, {kv['pages_in_use']} pages in use hold {kv['token_slots_used']} "
                     f"tokens of {kv['pages_in_use'] * engine['page_size']} slots (fragmentation "
                     f"{100 * kv['fragmentation']:.1f}%), {kv['running']} running; at most {kv['max_running']} "
                     f"running at once")
        if "fragmentation_mean" in kv:
            lines.append(f"  fragmentation {100 * kv['fragmentation_mean']:.1f}% over the run (mean, by step time), "
                         f"{100 * kv['fragmentation_at_most_tokens']:.1f}% at the step holding the most tokens")
        if "reservation_waste" in kv:
            lines.append(f"  each sequence reserves {kv['reserved_pages_per_sequence']} pages (max_model_len), so "
                         f"{kv['capacity_sequences']} fit: reservation wastes {100 * kv['reservation_waste']:.1f}% "
                         f"of the KV it holds")
    if result["paged_over_static"]:
        lines.append(f"paging + continuous batching / static batching with reservation, same KV budget: "
                     f"{_ratio(result['paged_over_static']['mean'])} output tok/s (mean), "
                     f"{_ratio(result['paged_over_static']['best'])} (best)")
    for name, overhead in result["engine_overhead"].items():
        lines.append(f"{name} engine overhead: {100 * overhead['overhead_best']:.1f}% (best: device-only "
                     f"{min(overhead['device_only_runs_s']):.2f}s / end-to-end "
                     f"{min(overhead['end_to_end_runs_s']):.2f}s), "
                     f"{100 * overhead['overhead_mean']:.1f}% (mean); {overhead['recorded_steps']} steps replayed")
    for name, details in result["systems"].items():
        timing = details["details"].get("timing")
        if timing:
            lines.append(f"{name} host ms per step (best run): " + ", ".join(
                f"{phase} {timing[phase + '_ms']:.2f}" for phase in PHASES)
                + f"; device idle {100 * timing['device_idle_fraction']:.1f}% of the step loop")
    check = result["check"]
    if "hf_reference" in check:
        hf = check["hf_reference"]
        lines.append(f"check: jaxserve's first {check['tokens']} greedy tokens equal Hugging Face's (batch of one) "
                     f"for {hf['matching']}/{hf['of']} requests {check['requests']}"
                     + ("" if hf["matching"] == hf["of"] else "  !!! MISMATCH !!!"))
    if check.get("agreement"):
        lines.append(f"check: first {check['tokens']} tokens equal to jaxserve's, of {len(check['requests'])}: "
                     + ", ".join(f"{name} {n}" for name, n in check["agreement"].items()))
    for name, same in check.get("equal_to_jaxserve", {}).items():
        lines.append(f"check: {name}'s outputs equal jaxserve's for {same['matching']}/{same['of']} requests")
    lines.append(f"command: {result['command']}")
    return "\n".join(lines)


def write_plots(result: dict, jaxserve_systems: dict[str, JaxserveSystem], plot_dir: str, page_size: int) -> list[str]:
    """throughput.png (output tokens/s per system) and a step timeline per jaxserve system; their paths."""
    from jaxserve.bench import plots

    os.makedirs(plot_dir, exist_ok=True)
    paths = [plots.throughput_bars(result["rows"], os.path.join(plot_dir, "throughput.png"))]
    for name, system in jaxserve_systems.items():
        steps = system.best_run().steps
        if steps:
            paths.append(plots.step_timeline(steps, page_size, os.path.join(plot_dir, f"timeline_{name}.png")))
    return paths


# ---- the command ----------------------------------------------------------------------------------------

def resolve_arguments(args: argparse.Namespace, folder: str) -> None:
    """Fill the options left to defaults that depend on others (sizes, max_model_len, cache dir)."""
    if args.num_requests is None:
        args.num_requests = QUICK_NUM_REQUESTS if args.quick else NUM_REQUESTS
    if args.max_model_len is None:
        args.max_model_len = default_max_model_len(folder)
    if args.compilation_cache_dir is None:
        args.compilation_cache_dir = os.path.join(args.cache_dir, "xla-cache")
    if min(args.repeats, args.warmup_requests, args.warmup_tokens, *args.hf_batch_sizes) < 1:
        raise ValueError("--repeats, --warmup-requests, --warmup-tokens and --hf-batch-sizes must be >= 1")
    args.systems = list(dict.fromkeys(args.systems))


def run(args: argparse.Namespace) -> dict:
    """Run `jaxserve bench throughput`: print the report, write --json and --plot-dir; returns the result."""
    log = make_logger()
    started = time.perf_counter()
    folder = models.model_from_args(args, log)
    resolve_arguments(args, folder)
    tokenizer = load_tokenizer(folder)
    workload = workload_from_args(args, tokenizer, args.max_model_len)
    if args.num_pages is None:
        args.num_pages = default_num_pages(workload, args.max_num_seqs, args.page_size, args.max_model_len)
    dtype = model_dtype(folder, args.dtype)
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    log(f"model {folder} ({dtype}, load_format {args.load_format}); workload: {workload.description}")
    log(f"engine: max_model_len {args.max_model_len}, KV budget {args.num_pages} pages of {args.page_size}; "
        f"setting up {', '.join(args.systems)}")
    systems, skipped, hf_model = build_systems(args, folder, dtype, pad_id, log)
    try:
        warm = workload.requests[:args.warmup_requests]
        log(f"untimed warm-up of every system: {len(warm)} requests x {args.warmup_tokens} tokens")
        systems = run_each(systems, lambda system: system.warm_up(warm, args.warmup_tokens), "the warm-up",
                           skipped, log)
        systems = timed_rounds(systems, skipped, workload, args.repeats, log)
        jaxserve = {system.name: system for system in systems if isinstance(system, JaxserveSystem)}
        overhead = {}
        for name in ("jaxserve", "jaxserve-sync"):
            if name in jaxserve:
                log(f"{name} engine overhead: one recorded run, then replays of its steps")
                overhead[name] = jaxserve[name].device_only(workload, args.repeats)
        results = {system.name: system.result() for system in systems}
        log("checks")
        check = check_outputs({name: r["output_token_ids"] for name, r in results.items()}, workload, hf_model,
                              pad_id, args.check_requests, args.check_tokens)
        result = assemble(args, folder, dtype, workload, results, skipped, jaxserve, overhead, check)
        result["total_wall_s"] = time.perf_counter() - started
        if args.plot_dir:
            result["plots"] = write_plots(result, jaxserve, args.plot_dir, args.page_size)
    finally:
        for system in systems:
            system.close()
    print(format_report(result), flush=True)
    if args.json:
        write_json(args.json, result, log)
    return result


def assemble(args: argparse.Namespace, folder: str, dtype: str, workload: Workload, results: dict[str, dict],
             skipped: dict[str, str], jaxserve: dict[str, JaxserveSystem], overhead: dict | None,
             check: dict) -> dict:
    """The JSON-able result of a run."""
    rows = [throughput_row(name, r["runs_s"], workload) for name, r in results.items()]
    add_ratios(rows)
    by_name = {row["system"]: row for row in rows}
    paged_over_static = None
    if "jaxserve" in by_name and "jaxserve-static" in by_name:
        static = by_name["jaxserve-static"]
        paged_over_static = {"mean": 1.0 / static["ratio_mean"], "best": 1.0 / static["ratio_best"]}
    return {
        "command": shlex.join(sys.argv),
        "args": command_args(args),
        "model": {"folder": folder, "shape": None if args.model else args.model_shape, "dtype": dtype,
                  "load_format": args.load_format},
        "workload": {"name": workload.name, "description": workload.description, "seed": args.seed,
                     "num_requests": len(workload.requests), "prompt_tokens": workload.num_prompt_tokens,
                     "output_tokens": workload.num_output_tokens},
        "engine": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "page_size": args.page_size, "max_model_len": args.max_model_len, "num_pages": args.num_pages,
                   "min_token_bucket": args.min_token_bucket, "min_page_bucket": args.min_page_bucket,
                   "dtype": args.dtype},
        "timing": {"warmup_requests": args.warmup_requests, "warmup_tokens": args.warmup_tokens,
                   "repeats": args.repeats},
        "rows": rows,
        "systems": {name: {"runs_s": r["runs_s"], "output_tokens": sum(len(ids) for ids in r["output_token_ids"]),
                           "details": r["details"]} for name, r in results.items()},
        "skipped": skipped,
        "kv": {name: kv_report(system, args.page_size) for name, system in jaxserve.items()},
        "paged_over_static": paged_over_static,
        "engine_overhead": overhead,
        "check": check,
        "plots": [],
    }
