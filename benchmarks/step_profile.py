"""The engine's step on the CPU, by op: device time per computed token on the recorded steps of one throughput run.

    python benchmarks/step_profile.py --model-shape llama-small
    python benchmarks/step_profile.py --model-shape bundled --num-requests 32 --repeats 3
    python benchmarks/step_profile.py --model-shape llama-small --baseline HEAD   # old code vs the working tree

One run of `jaxserve bench throughput`'s workload (the same options and engine config, from jaxserve/bench/offline.py)
is driven through an engine while every `Runner.dispatch` input is recorded (as offline.py's `device_only` does). The
recorded steps are then replayed, each timed alone (`block_until_ready`), for two variants of the step code side by
side in this one process: `baseline` (the step's modules, MODULES, as of the git revision --baseline, loaded from
`git show`: run it from the checkout or set GIT_DIR) and `current` (the working tree). Variants alternate
step by step, so a slow spell of a shared machine hits both.

Method: ablation. Besides the whole forward and the sampler (jitted as the runner jits them, KV caches donated),
each op is its own jitted function at the step's recorded shapes, run over every layer with the real weights:
  attention   the backend's paged attention (gathers + online softmax over the query tiles) on random queries
  gather      the same attention with the softmax fold replaced by a plain sum of the gathered K and V: the cost
              of walking and gathering the pages alone (an estimate: XLA fuses differently without the einsums)
  qkv/o       the q, k, v and o projections
  mlp         gate, up (SiLU) and down projections
  lm_head     final norm and LM head on the R rows' last tokens
  sampler     the sampler executable on the step's logits
  other       forward - (attention + qkv/o + mlp + lm_head): embedding, norms, RoPE, the KV write, page copies
Limits: isolated ops lose the fusion and overlap they have inside the forward (the parts do not add up exactly,
`other` absorbs the difference and can be negative); the CPU is shared, so read means with the best.

Tokens whose ids an asynchronous runner reads from the previous step's samples (`device_token_index`) are
replayed with the recorded placeholder id: the same work, other numbers.

Padding (from the recorded inputs): padded tokens / T, padded rows / R, and the page-table slots beyond the
pages each row needs / (R * W), per step bucket.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.batch.descriptor import BatchDescriptor
from jaxserve.batch.packing import pack, unpack
from jaxserve.bench import models, offline
from jaxserve.bench.driver import drive
from jaxserve.bench.workloads import workload_from_args
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.tokenizer import load_tokenizer

OPS = ("forward", "attention", "gather", "qkv/o", "mlp", "lm_head", "other", "sampler")
# The step's modules, in import order: a revision's own copies import each other (a file the revision lacks: today's).
# Their other imports resolve in today's tree, so a --baseline must be from the layout by concern (85fc9ed) on.
MODULES = {"fp8": "jaxserve/attention/fp8.py", "layers": "jaxserve/model/layers.py",
           "registry": "jaxserve/model/registry.py", "xla": "jaxserve/attention/xla.py",
           "llama": "jaxserve/model/llama.py", "sampler": "jaxserve/sampling/sampler.py"}


def load_revision(revision: str) -> dict[str, types.ModuleType]:
    """The step modules (MODULES) as of a git revision, loaded from `git show` as fresh modules that import one
    another (each stands in for today's module of its name while the next ones load)."""
    loaded, todays = {}, dict(sys.modules)
    try:
        for name, path in MODULES.items():
            source = subprocess.run(["git", "show", f"{revision}:{path}"], capture_output=True, text=True)
            if source.returncode:  # not in that revision
                continue
            module = types.ModuleType(f"baseline_{name}")
            sys.modules[module.__name__] = module  # dataclasses look their module up
            sys.modules[path.removesuffix(".py").replace("/", ".")] = module
            exec(compile(source.stdout, f"{revision}:{path}", "exec"), module.__dict__)
            loaded[name] = module
    finally:
        for path in MODULES.values():
            sys.modules[path.removesuffix(".py").replace("/", ".")] = todays[path.removesuffix(".py").replace("/", ".")]
    return loaded


def current_modules() -> dict[str, types.ModuleType]:
    """The step modules (MODULES) of the working tree."""
    from jaxserve.attention import fp8, xla
    from jaxserve.model import layers, llama, registry
    from jaxserve.sampling import sampler

    return {"fp8": fp8, "layers": layers, "registry": registry, "xla": xla, "llama": llama, "sampler": sampler}


def step_functions(modules: dict[str, types.ModuleType], spec, kv_heads: int, platform: str, mesh) -> tuple:
    """(forward(params, caches, batch), token_logits(params, hidden), attention(q, caches, layer, batch)) of one
    variant's modules, over the XLA attention backend, in either model API: the registry's NNX module (today) or
    llama.py's functions (revisions before the NNX modules)."""
    xla, llama = modules["xla"], modules["llama"]
    if hasattr(llama, "make_forward"):  # llama.py's functions
        backend = xla.make_backend(spec, platform)
        return (llama.make_forward(spec, kv_heads, backend.attention, backend.write_kv),
                lambda params, hidden: llama.token_logits(params, hidden, spec), backend.attention)
    from jaxserve.attention.base import LayerAttention

    backend = xla.make_backend(platform)
    model = modules["registry"].model_for(spec.architecture)
    how = LayerAttention(spec.head_dim**-0.5, spec.sliding_window)
    return (model.make_forward(spec, backend.attention, backend.write_kv, mesh),
            lambda params, hidden: model.token_logits(params, hidden, spec),
            functools.partial(backend.attention, how=how))


def gather_only_step(carry, q, k, v, visible, how):
    """Stand-in for `_online_softmax_step` that only consumes the gathered chunk (sums K + V over keys)."""
    # k, v: (U, K, Hkv, D); carry numerator: (N, Hkv, G, D)
    running_max, denominator, numerator = carry
    summed = jnp.sum((k + v).astype(jnp.float32), axis=1)[:, :, None, :]  # (U, Hkv, 1, D)
    return running_max, denominator + jnp.sum(visible), numerator + summed


class Variant:
    """One version of the step code, jitted the way the runner jits it, with its own copy of the KV caches."""

    def __init__(self, name: str, modules: dict[str, types.ModuleType], runner, platform: str):
        self.name = name
        spec, kv_heads = runner.spec, runner._num_cache_kv_heads
        forward, token_logits, attention = step_functions(modules, spec, kv_heads, platform, runner._replicated.mesh)
        sampler = modules["sampler"]
        self.caches = jax.tree_util.tree_map(jnp.copy, runner.kv_caches)  # each (L, P, S, Hkv, D)
        self.forward = jax.jit(lambda params, caches, words, layout: forward(
            params, caches, unpack(words, layout, BatchDescriptor)), donate_argnums=(1,), static_argnums=(3,))
        self.sample = jax.jit(lambda logits, words, layout: sampler.sample(
            logits, unpack(words, layout, sampler.SamplingBatch)), static_argnums=(2,))
        self.attention = jax.jit(functools.partial(attention_op, attention, spec.num_layers))
        self.lm_head = jax.jit(lambda params, x, batch: token_logits(params, x[batch.logits_indices]))
        self._gather_module = modules["xla"]
        # traced with the stand-in fold
        gather_attention = step_functions(modules, spec, kv_heads, platform, runner._replicated.mesh)[2]
        self._gather_fn = jax.jit(functools.partial(attention_op, gather_attention, spec.num_layers))
        self._gather_compiled = {}

    def gather(self, q, caches, batch):
        """The gather-only attention (compiled per shape with the stand-in fold swapped in)."""
        key = (q.shape, batch.page_table.shape)
        if key not in self._gather_compiled:
            real_fold = self._gather_module._online_softmax_step
            self._gather_module._online_softmax_step = gather_only_step
            try:
                self._gather_compiled[key] = self._gather_fn.lower(q, caches, batch).compile()
            finally:
                self._gather_module._online_softmax_step = real_fold
        return self._gather_compiled[key](q, caches, batch)


def attention_op(attention, num_layers: int, q, caches, batch):
    """The backend's attention for every layer on the same queries, summed so no layer is dropped."""
    # q: (T, Hq, D) -> (T, Hq, D)
    def body(total, layer):
        return total + attention(q, caches, layer, batch).astype(jnp.float32), None

    out, _ = jax.lax.scan(body, jnp.zeros(q.shape, jnp.float32), jnp.arange(num_layers, dtype=jnp.int32))
    return out


@jax.jit
def qkv_o_op(params, x):
    """The q, k, v and o projections of every layer (the attention between them left out)."""
    # x: (T, H) -> (T, H)
    def body(x, p):
        q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]  # (T, Hq*D), (T, Hkv*D), (T, Hkv*D)
        return x + q @ p["wo"] + (jnp.sum(k) + jnp.sum(v)).astype(x.dtype), None

    return jax.lax.scan(body, x, params["layers"])[0]


@jax.jit
def mlp_op(params, x):
    """The gate, up and down projections of every layer."""
    # x: (T, H) -> (T, H)
    def body(x, p):
        return x + (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"], None  # (T, H)

    return jax.lax.scan(body, x, params["layers"])[0]


def timed(fn, *args) -> tuple[float, object]:
    """Seconds of one call, waiting for its results; and the results."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - start, out


def padding(batch, page_size: int) -> dict[str, float]:
    """Real and padded tokens, rows and page-table slots of one recorded step."""
    num_tokens, (num_rows, width) = batch.input_ids.shape[0], batch.page_table.shape
    real_rows = int(batch.num_seqs)
    needed = -(-np.asarray(batch.seq_lens[:real_rows]) // page_size)  # (real rows,) pages each row needs
    return {"tokens": int(batch.query_start_loc[-1]), "T": num_tokens, "rows": real_rows, "R": num_rows,
            "pages": int(needed.sum()), "slots": num_rows * width}


def record(args: argparse.Namespace) -> tuple[LLMEngine, list, int]:
    """Build the benchmark's engine and drive the workload once, recording every Runner.dispatch input."""
    log = offline.make_logger()
    folder = models.model_from_args(args, log)
    offline.resolve_arguments(args, folder)
    workload = workload_from_args(args, load_tokenizer(folder), args.max_model_len)
    if args.num_pages is None:
        args.num_pages = offline.default_num_pages(workload, args.max_num_seqs, args.page_size, args.max_model_len)
    config = offline.engine_config(args, folder)  # the benchmark's jaxserve system
    engine = LLMEngine(config, show_progress=False)
    runner = engine.core.runner
    recorded, dispatch = [], runner.dispatch  # each step's (batch, sampling, prompt, decode steps)

    def recording_dispatch(*step_args):
        recorded.append(jax.tree_util.tree_map(lambda leaf: np.array(leaf, copy=True), step_args))
        return dispatch(*step_args)

    runner.dispatch = recording_dispatch
    try:
        drive(engine, workload)
    finally:
        del runner.dispatch  # the class's method again
    log(f"{workload.description}: {len(recorded)} steps recorded")
    return engine, recorded, workload.num_output_tokens


def run_ops(variant: Variant, params, batch, sampling, q, x) -> dict[str, float]:
    """Seconds of each op of one recorded step in `variant` (the forward updates the variant's caches)."""
    # q: (T, Hq, D) random queries; x: (T, H) random hidden states
    words, layout = pack(batch)
    sampling_words, sampling_layout = pack(sampling)
    words, sampling_words = jnp.asarray(words), jnp.asarray(sampling_words)
    device_batch = jax.tree_util.tree_map(jnp.asarray, batch)
    seconds = {}
    seconds["forward"], (logits, _, variant.caches) = timed(variant.forward, params, variant.caches, words, layout)
    seconds["sampler"], _ = timed(variant.sample, logits, sampling_words, sampling_layout)
    seconds["attention"], _ = timed(variant.attention, q, variant.caches, device_batch)
    seconds["gather"], _ = timed(variant.gather, q, variant.caches, device_batch)
    seconds["qkv/o"], _ = timed(qkv_o_op, params, x)
    seconds["mlp"], _ = timed(mlp_op, params, x)
    seconds["lm_head"], _ = timed(variant.lm_head, params, x, device_batch)
    seconds["other"] = seconds["forward"] - sum(seconds[op] for op in ("attention", "qkv/o", "mlp", "lm_head"))
    return seconds


def profile(engine: LLMEngine, recorded: list, variants: list[Variant], repeats: int) -> tuple[dict, dict, list]:
    """Replay the recorded steps `repeats` times through every variant, each op timed alone, after one untimed
    step of each bucket (compilation).

    Returns {variant: {op: [seconds of each repeat]}}, {variant: {(T, W): {op: seconds of the last repeat}}}
    and the padding counts of each step."""
    runner = engine.core.runner
    params, spec = runner.params, runner.spec
    rng = np.random.default_rng(0)
    dtype = params["embed"].dtype

    def random_inputs(batch):
        num_tokens = batch.input_ids.shape[0]
        q = jnp.asarray(rng.standard_normal((num_tokens, spec.num_heads, spec.head_dim)), dtype)  # (T, Hq, D)
        x = jnp.asarray(rng.standard_normal((num_tokens, spec.hidden_size)), dtype)  # (T, H)
        return q, x

    first_of_bucket = {}
    for batch, sampling, *_ in recorded:
        first_of_bucket.setdefault((batch.input_ids.shape, batch.page_table.shape, sampling.aux_token_ids.shape),
                                   (batch, sampling))
    for batch, sampling in first_of_bucket.values():
        for variant in variants:
            run_ops(variant, params, batch, sampling, *random_inputs(batch))
    totals = {v.name: {op: [] for op in OPS} for v in variants}
    by_bucket = {v.name: collections.defaultdict(collections.Counter) for v in variants}
    pads = [padding(batch, runner.page_size) for batch, *_ in recorded]
    for repeat in range(repeats):
        gc.collect()
        sums = {v.name: collections.Counter() for v in variants}
        for batch, sampling, *_ in recorded:
            q, x = random_inputs(batch)
            order = variants if repeat % 2 == 0 else variants[::-1]
            for variant in order:
                seconds = run_ops(variant, params, batch, sampling, q, x)
                sums[variant.name].update(seconds)
                if repeat == repeats - 1:
                    by_bucket[variant.name][(batch.input_ids.shape[0], batch.page_table.shape[1])].update(seconds)
        for variant in variants:
            for op in OPS:
                totals[variant.name][op].append(sums[variant.name][op])
        print(f"repeat {repeat + 1}/{repeats}: " + ", ".join(
            f"{name} forward {t['forward'][-1]:.2f}s sampler {t['sampler'][-1]:.2f}s" for name, t in totals.items()),
            file=sys.stderr, flush=True)
    return totals, by_bucket, pads


def report(totals: dict, by_bucket: dict, pads: list[dict], recorded: list, output_tokens: int) -> str:
    """The tables: per op (ms per step, us per computed token, mean and best over the repeats), padding per
    bucket, and each variant's ops per bucket."""
    num_steps, computed = len(recorded), sum(p["tokens"] for p in pads)
    lines = [f"{num_steps} steps, {computed} computed tokens ({output_tokens} output tokens)", "",
             "| op | " + " | ".join(f"{name} ms/step mean | best | us/token mean | best" for name in totals) + " |",
             "|---|" + "---|" * (4 * len(totals))]
    for op in OPS:
        cells = []
        for name, ops in totals.items():
            mean, best = float(np.mean(ops[op])), float(min(ops[op]))
            cells += [f"{1e3 * mean / num_steps:.3f}", f"{1e3 * best / num_steps:.3f}",
                      f"{1e6 * mean / computed:.2f}", f"{1e6 * best / computed:.2f}"]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    buckets = collections.defaultdict(list)
    for (batch, *_), pad in zip(recorded, pads):
        buckets[(batch.input_ids.shape[0], batch.page_table.shape[1])].append(pad)
    lines += ["", "Padding per step bucket T x W: padded tokens / T, padded rows / R, page-table slots past each row's "
              "pages / (R * W)", "| T x W | steps | pad tokens | pad rows | pad page slots |", "|---|---|---|---|---|"]
    for key in sorted(buckets):
        group = buckets[key]
        share = [1 - sum(p[real] for p in group) / sum(p[size] for p in group)
                 for real, size in (("tokens", "T"), ("rows", "R"), ("pages", "slots"))]
        lines.append(f"| {key[0]} x {key[1]} | {len(group)} | " + " | ".join(f"{100 * x:.0f}%" for x in share) + " |")
    for name in totals:
        lines += ["", f"{name}: ms per step of each bucket (last repeat)",
                  "| T x W | steps | " + " | ".join(OPS) + " |", "|---|---|" + "---|" * len(OPS)]
        for key in sorted(buckets):
            seconds = by_bucket[name][key]
            lines.append(f"| {key[0]} x {key[1]} | {len(buckets[key])} | "
                         + " | ".join(f"{1e3 * seconds[op] / len(buckets[key]):.2f}" for op in OPS) + " |")
    total = {name: sum(p[size] for p in pads) for name, size in (("T", "T"), ("R", "R"), ("slots", "slots"))}
    lines += ["", f"padding over the run: tokens {100 * (1 - computed / total['T']):.1f}%, rows "
              f"{100 * (1 - sum(p['rows'] for p in pads) / total['R']):.1f}%, page-table slots "
              f"{100 * (1 - sum(p['pages'] for p in pads) / total['slots']):.1f}%"]
    return "\n".join(lines)


def main() -> None:
    """Record one run of the throughput workload and print the per-op profile of each variant."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    offline.add_arguments(parser)
    parser.add_argument("--baseline", metavar="REV", default=None,
                        help="also time the step modules as of this git revision, side by side (e.g. HEAD)")
    args = parser.parse_args()
    args.systems = ["jaxserve"]
    engine, recorded, output_tokens = record(args)
    runner = engine.core.runner
    platform = jax.devices()[0].platform
    variants = [Variant("current", current_modules(), runner, platform)]
    if args.baseline:
        variants.insert(0, Variant("baseline", load_revision(args.baseline), runner, platform))
    totals, by_bucket, pads = profile(engine, recorded, variants, args.repeats)
    print(report(totals, by_bucket, pads, recorded, output_tokens))


if __name__ == "__main__":
    main()
