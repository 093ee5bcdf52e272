"""The host's (Python's) time per engine step at large batch sizes, with the device's time zero (issue 46).

    python benchmarks/host_step.py                                  # 64, 256 and 512 decoding rows
    python benchmarks/host_step.py --rows 512 --profile             # where the host time goes (cProfile)
    python benchmarks/host_step.py --rows 64 --steps 50 --json out.json
    python benchmarks/host_step.py --rows 512 --output-kind cumulative delta final_only

An `LLMEngine` runs its real host path: `EngineCore.step` with the real Scheduler (schedule, update), the real batch
builders (build_batch, build_sampling_batch, ...), the step timing, and the output processor with the real
incremental detokenizer and stop-string checker on the bundled model's tokenizer (tiny-stdlib-llama). Only the
Runner is a fake (`FakeRunner`): its dispatch packs the step's arrays into their buffers as the real runner does
(`batch.packing.pack`, host numpy), then returns at once a `PendingStep` whose samples are already on the host. No
jax device work, no KV arrays: the KV pool is page accounting only, so it can be as large as the workload needs.
What this leaves out of the real runner's dispatch: moving the buffers to the device and calling the executables.

Workload, per row count R: R requests with max_num_seqs = R, each a different ~1000-token prompt (text of the
Python standard library, which the tokenizer was trained on), ignore_eos and max_tokens enough that the measured
window is steady-state decode with all R rows decoding (checked: every timed step schedules R one-token decodes and
returns R outputs). Asynchronous scheduling on (the default), prefix caching on (the default). Two sampling setups:
`sampled` (temperature 0.8, top_p 0.95, seeded) and `greedy`. The fake's sample for a row is a fixed function of the
row's seed and position (a token of the same corpus), so the detokenizer sees text, not noise. The requests' output
kind (SamplingParams.output_kind): `cumulative` (the API's default: each step's outputs hold everything so far),
`delta` (only the step's new tokens and text: `jaxserve bench`'s driver) or `final_only` (no output before a
request ends: `LLM.generate`).

Per timed step (after the warm-up steps): the wall time of `LLMEngine.step()` and its phases from the engine's step
timing (`stats()["timing"]`'s counters, read per step): schedule, swap, build, dispatch, wait, update (EngineCore)
and output (the output processor: detokenize, stop strings, RequestOutputs; finishing stopped requests); `other` is
the rest of the step (the step loop itself). Mean and best over the timed steps, each phase's best on its own.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import cProfile
import dataclasses
import functools
import gc
import glob
import io
import json
import os
import pstats
import sys
import tempfile
import time
from unittest import mock

# Run as a script, this folder comes first on sys.path, where kernels.py would stand in for the `kernels` package
# that transformers looks for: this script imports nothing of its neighbours.
sys.path[:] = [path for path in sys.path if os.path.abspath(path or ".") != os.path.dirname(os.path.abspath(__file__))]

import numpy as np  # noqa: E402

from jaxserve.batch.packing import pack  # noqa: E402
from jaxserve.bench.results import write_json  # noqa: E402
from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.engine import core_builder  # noqa: E402
from jaxserve.engine.llm_engine import LLMEngine, default_model_path  # noqa: E402
from jaxserve.engine.step_timing import PHASES  # noqa: E402
from jaxserve.tokenizer import load_tokenizer  # noqa: E402
from jaxserve.kv.cache_manager import pages_for_tokens  # noqa: E402
from jaxserve.runner.runner import PendingStep  # noqa: E402
from jaxserve.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

SAMPLINGS = {"sampled": {"temperature": 0.8, "top_p": 0.95}, "greedy": {"temperature": 0.0}}
# what is timed per step, in ms; `gc` (Python's cyclic garbage collector) is inside the phases it interrupted
COLUMNS = ("total",) + PHASES + ("other", "gc")
MAX_NUM_BATCHED_TOKENS = 8192  # the prompts' steps; a decode step of R rows takes R tokens of it


class FakeRunner:
    """The surface of runner/runner.py's Runner that EngineCore uses to run generate steps, without a device.

    `dispatch` packs the inputs into int32 buffers as the real runner does before moving them, and returns a
    PendingStep already done: row r's sample is `corpus[(seed + position) % len(corpus)]`, from the row's seed
    (SamplingBatch.seeds) and the position of the token it samples (BatchDescriptor.seq_lens), so a request's
    output does not depend on the batch it runs in. Prompt logprobs, pooling, multi-step decodes, speculative
    proposals and swapping are not faked (NotImplementedError)."""

    def __init__(self, corpus: np.ndarray, spec, params, mesh, *, page_size: int, cache_dtype, **_):
        """`corpus`: (C,) int32 token ids the samples are drawn from; the rest: the real Runner's arguments."""
        self.corpus = corpus  # (C,) int32
        self.spec, self.params, self.mesh, self.page_size, self.cache_dtype = spec, params, mesh, page_size, cache_dtype
        self.host_swap = None  # no host swap pool (preemption_mode recompute)
        self.num_lazy_compiles = self.num_background_compiles = self.num_repadded_steps = 0
        self.num_pages = 0

    def page_bytes(self) -> int:
        """Bytes a page of K and V of every layer would take (only sizes a pool left unset: num_pages is set here)."""
        spec = self.spec
        return 2 * spec.num_layers * self.page_size * spec.num_kv_heads * spec.head_dim * self.cache_dtype.itemsize

    def allocate_kv(self, num_pages: int) -> None:
        """Note the pool's size (no arrays)."""
        self.num_pages = num_pages

    def warmup(self, show_progress: bool = True, background: bool = False) -> None:
        """Nothing to compile."""

    def background_compiles_left(self) -> int:
        """Nothing compiles."""
        return 0

    def num_executables(self) -> int:
        """No executables."""
        return 0

    def set_lora(self, slot: int, adapter: dict) -> None:
        """LoRA is not faked."""
        raise NotImplementedError("FakeRunner serves no LoRA adapters")

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Swapping is not faked."""
        raise NotImplementedError("FakeRunner has no host swap pool")

    def dispatch(self, batch, sampling, prompt=None, decode_steps=None, proposals=None, pooling=None) -> PendingStep:
        """A plain step's forward and sampler, done at once."""
        if decode_steps is not None:
            raise NotImplementedError("FakeRunner runs no multi-step decodes")
        return self.dispatch_sampler(self.dispatch_forward(batch, prompt, pooling), sampling, proposals)

    def dispatch_forward(self, batch, prompt=None, pooling=None):
        """The step's batch, packed as the real runner packs it (the forward it would start has nothing to do)."""
        if prompt is not None or pooling is not None:
            raise NotImplementedError("FakeRunner scores no prompt logprobs and pools nothing")
        pack(batch)
        return batch

    def dispatch_sampler(self, batch, sampling, proposals=None) -> PendingStep:
        """The rows' samples, on the host at once; the sampling batch packed as the real runner packs it."""
        if proposals is not None:
            raise NotImplementedError("FakeRunner verifies no proposals")
        pack(sampling)
        positions = sampling.seeds[:, 0].astype(np.int64) + batch.seq_lens  # (R,)
        token_ids = self.corpus[positions % len(self.corpus)]  # (R,) int32
        ready = concurrent.futures.Future()
        ready.set_result(time.perf_counter())
        return PendingStep(token_ids, None, None, int(batch.num_seqs), 0, ready=ready)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One measurement's shape."""

    rows: int  # R: requests, all decoding at once (max_num_seqs)
    sampling: str  # a key of SAMPLINGS
    output_kind: str  # a RequestOutputKind's name, lower case
    prompt_len: int
    warmup: int  # steps after every request has its first token, before the timed ones
    steps: int  # timed steps

    @property
    def max_tokens(self) -> int:
        """Enough that no request finishes in the timed window: the first prompts' requests decode while the
        later prompts run (about R * prompt_len / MAX_NUM_BATCHED_TOKENS steps)."""
        prompt_steps = pages_for_tokens(self.rows * self.prompt_len, MAX_NUM_BATCHED_TOKENS)
        return prompt_steps + self.warmup + self.steps + 8

    @property
    def max_model_len(self) -> int:
        """The longest sequence, rounded up to a page of 16."""
        return pages_for_tokens(self.prompt_len + self.max_tokens, 16) * 16


def corpus_token_ids(tokenizer, num_tokens: int) -> np.ndarray:
    """(C,) int32: the token ids of Python standard library sources (the bundled model's training text), at least
    `num_tokens` of them."""
    ids: list[int] = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            ids += tokenizer.encode(f.read(), add_special_tokens=False, verbose=False)
        if len(ids) >= num_tokens:
            break
    return np.asarray(ids, np.int32)


@contextlib.contextmanager
def model_folder(max_model_len: int):
    """The bundled model's folder with max_position_embeddings raised to `max_model_len` (its own is 1024, short of
    a 1000-token prompt and its output); the weights and the tokenizer are the bundled files (linked)."""
    source = default_model_path()
    with tempfile.TemporaryDirectory(prefix="host_step_") as folder:
        for name in os.listdir(source):
            if name != "config.json":
                os.symlink(os.path.join(source, name), os.path.join(folder, name))
        with open(os.path.join(source, "config.json")) as f:
            config = json.load(f)
        config["max_position_embeddings"] = max(config["max_position_embeddings"], max_model_len)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
        yield folder


def make_engine(workload: Workload, folder: str, corpus: np.ndarray) -> LLMEngine:
    """An LLMEngine over the model in `folder` whose runner is a FakeRunner drawing from `corpus`, with a KV pool of
    pages for every request's whole sequence."""
    num_pages = workload.rows * pages_for_tokens(workload.max_model_len, 16) + 1
    config = EngineConfig(model=folder, max_model_len=workload.max_model_len, page_size=16, num_pages=num_pages,
                          max_num_seqs=workload.rows, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                          skip_precompile=True, compilation_cache_dir=None, enable_structured_outputs=False)
    with mock.patch.object(core_builder, "Runner", functools.partial(FakeRunner, corpus)):
        return LLMEngine(config, show_progress=False)


def run(workload: Workload, folder: str, corpus: np.ndarray, profile: cProfile.Profile | None = None,
        gc_threshold: int | None = None) -> dict:
    """Drive one workload to steady decode and time `workload.steps` steps (under the garbage collector's
    first-generation threshold `gc_threshold`, when given); returns the per-step times (ms) of each column, the rows
    each timed step decoded, and the engine's timing summary."""
    engine = make_engine(workload, folder, corpus)
    engine_thresholds = gc.get_threshold()
    if gc_threshold is not None:
        gc.set_threshold(gc_threshold, *engine_thresholds[1:])
    params = SamplingParams(max_tokens=workload.max_tokens, ignore_eos=True, **SAMPLINGS[workload.sampling],
                            output_kind=RequestOutputKind[workload.output_kind.upper()])
    stride = max(1, (len(corpus) - workload.prompt_len) // workload.rows)
    for index in range(workload.rows):
        prompt = corpus[index * stride : index * stride + workload.prompt_len].tolist()
        seed = None if params.temperature == 0 else index
        engine.add_request(str(index), prompt, dataclasses.replace(params, seed=seed))
    while any(not request.output_token_ids for request in engine.core.scheduler.requests.values()):  # the prompts
        engine.step()
    for _ in range(workload.warmup):
        engine.step()
    core_engine, seconds = engine.core, engine.core.timing.seconds
    times = {column: [] for column in COLUMNS}
    decoded = []
    gc_clock = GcClock()
    gc.callbacks.append(gc_clock)
    try:
        for _ in range(workload.steps):
            before, tokens_before, gc_before = dict(seconds), core_engine.counters["scheduled_tokens"], gc_clock.seconds
            start = time.perf_counter()
            if profile is not None:
                profile.enable()
            outputs = engine.step()
            if profile is not None:
                profile.disable()
            total = time.perf_counter() - start
            phases = {phase: seconds[phase] - before[phase] for phase in PHASES}
            times["total"].append(1e3 * total)
            for phase, spent in phases.items():
                times[phase].append(1e3 * spent)
            times["other"].append(1e3 * (total - sum(phases.values())))
            times["gc"].append(1e3 * (gc_clock.seconds - gc_before))
            scheduled = core_engine.counters["scheduled_tokens"] - tokens_before
            running = len(core_engine.scheduler.running)
            num_outputs = 0 if workload.output_kind == "final_only" else workload.rows
            if scheduled != workload.rows or running != workload.rows or len(outputs) != num_outputs:
                raise RuntimeError(f"not a steady decode of {workload.rows} rows: {scheduled} tokens scheduled, "
                                   f"{running} running, {len(outputs)} outputs")
            decoded.append(scheduled)
    finally:
        gc.callbacks.remove(gc_clock)
        gc.set_threshold(*engine_thresholds)
    return {"rows": workload.rows, "sampling": workload.sampling, "output_kind": workload.output_kind,
            "prompt_len": workload.prompt_len,
            "steps": workload.steps, "decoding_rows": decoded,
            "mean_ms": {column: float(np.mean(values)) for column, values in times.items()},
            "best_ms": {column: float(np.min(values)) for column, values in times.items()},
            "step_ms": times, "timing": engine.stats()["timing"]}


class GcClock:
    """A `gc.callbacks` entry adding up the seconds Python's cyclic garbage collector runs."""

    def __init__(self):
        self.seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started


def table(results: list[dict]) -> str:
    """The results as a text table: mean (best) ms per step of each column."""
    shown = [column for column in COLUMNS if column != "swap"]  # (no swapping in this workload)
    lines = [f"{'rows':>5} {'sampling':>8} {'outputs':>10} " + " ".join(f"{column:>15}" for column in shown)]
    for result in results:
        cells = [f"{result['mean_ms'][c]:7.3f} ({result['best_ms'][c]:5.3f})" for c in shown]
        lines.append(f"{result['rows']:>5} {result['sampling']:>8} {result['output_kind']:>10} "
                     + " ".join(f"{cell:>15}" for cell in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; prints the table (and the profile) and returns the results, one per (rows, sampling,
    output kind)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=5, help="steps after the prompts, before the timed ones")
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--sampling", nargs="+", choices=sorted(SAMPLINGS), default=list(SAMPLINGS))
    parser.add_argument("--output-kind", nargs="+", default=["cumulative"],
                        choices=[kind.name.lower() for kind in RequestOutputKind],
                        help="what the requests' outputs hold (SamplingParams.output_kind)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the timed steps of each measurement; print the top functions")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    parser.add_argument("--gc-threshold", type=int, metavar="N",
                        help="the garbage collector's first-generation threshold, set once the engine has started "
                             "(700, CPython's default: the collector untuned); default: the engine's "
                             "(engine/host_gc.py)")
    args = parser.parse_args(argv)
    workloads = [Workload(rows, sampling, kind, args.prompt_len, args.warmup, args.steps)
                 for rows in args.rows for sampling in args.sampling for kind in args.output_kind]
    longest = max(workload.max_model_len for workload in workloads)
    tokenizer = load_tokenizer(default_model_path())
    corpus = corpus_token_ids(tokenizer, max(args.rows) * 64 + args.prompt_len)
    results = []
    with model_folder(longest) as folder:
        for workload in workloads:
            profile = cProfile.Profile() if args.profile else None
            results.append(run(workload, folder, corpus, profile, args.gc_threshold))
            print(table(results[-1:]).splitlines()[-1], flush=True)
            if profile is not None:
                text = io.StringIO()
                pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
                print(text.getvalue(), flush=True)
    print(f"\nhost ms per step, mean (best) over {args.steps} timed steps:\n{table(results)}")
    if args.json:
        write_json(args.json, results)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
