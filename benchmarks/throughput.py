#!/usr/bin/env python
"""Offline throughput: jaxserve vs Hugging Face transformers static batching, on the same weights.

One run does everything and prints side-by-side ratios (absolute numbers on a shared machine are
noisy; ratios measured in one run are the deliverable):

1. builds (or reuses, under --cache-dir) a seeded random-weight Llama saved as a Hugging Face folder
   (4 layers, hidden 256, 8 heads / 2 KV heads, intermediate 1024, vocab 4096, float32) with a
   4096-entry word-level tokenizer and a generation_config.json;
2. builds a seeded workload: prompts of random token ids with lengths uniform in
   [--min-prompt, --max-prompt], long-tailed output lengths (lognormal, clipped), EOS ignored so
   request i produces exactly L_i tokens;
3. sets up every system: one jaxserve engine per --max-num-seqs (AOT compilation) and Hugging Face
   `model.generate` (float32, CPU, greedy, left padding, EOS disabled) in static batches of each
   --hf-batch-sizes (torch threads calibrated per batch size), processing the requests in order;
4. gives every system the same untimed warm-up (--warmup-requests requests x --warmup-tokens tokens);
5. times every system the same way: --repeats rounds, each running every system once on the whole
   workload, the order alternating between rounds; reports mean and best per system and the ratios
   (best jaxserve configuration / best HF configuration) of means and of bests. Each jaxserve run
   also records every (batch, sampling) pair given to `Runner.step` plus a per-phase host breakdown
   (that bookkeeping is inside its timed run, so it can only slow jaxserve down), and after it,
   untimed, replays the recorded steps through `Runner.step` (the same AOT executables) to get
   device-only time: engine overhead = 1 - device_only / end_to_end, with the device time per bucket;
6. checks that jaxserve's first greedy tokens equal HF's for a few requests;
7. optionally profiles a separate (untimed) jaxserve generate with cProfile.

Example:
    python benchmarks/throughput.py                 # full run (128 requests)
    python benchmarks/throughput.py --quick         # 32 requests, for iteration
    python benchmarks/throughput.py --json /tmp/tp.json --max-num-seqs 64 --hf-batch-sizes 64
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import hashlib
import io
import json
import math
import os
import pstats
import shlex
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

# ---- model ------------------------------------------------------------------------------------

MODEL_SPEC = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=1024,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]  # ids 0..3
BOS_ID, EOS_ID, UNK_ID, PAD_ID = 0, 1, 2, 3
# Init: matrices N(0, GAIN^2 / fan_in), embeddings/lm_head N(0, EMBED_STD^2), norms 1 + N(0, 0.1^2).
# Larger-than-default stds make greedy logits "peaky", so float32 torch and XLA agree on argmax.
LINEAR_GAIN = 1.6
EMBED_STD = 0.3
NORM_STD = 0.1
MODEL_FORMAT_VERSION = 1


def model_fingerprint(seed: int) -> dict:
    return {"spec": MODEL_SPEC, "seed": seed, "gain": LINEAR_GAIN, "embed_std": EMBED_STD,
            "norm_std": NORM_STD, "version": MODEL_FORMAT_VERSION}


def build_tokenizer():
    """A 4096-entry word-level tokenizer ('<s>', '</s>', '<unk>', '<pad>', 't4' ... 't4095')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), MODEL_SPEC["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )


def ensure_model(cache_dir: str, seed: int, log) -> str:
    """The model folder under `cache_dir`, built on first use (or when the recipe changed)."""
    fingerprint = model_fingerprint(seed)
    digest = hashlib.sha1(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:10]
    folder = os.path.join(cache_dir, f"llama-4l-256h-gqa8x2-v4096-{digest}")
    marker = os.path.join(folder, "bench_fingerprint.json")
    if os.path.isfile(marker):
        log(f"reusing model folder {folder}")
        return folder

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    log(f"building random-weight model in {folder}")
    torch.manual_seed(seed)
    spec = dict(MODEL_SPEC)
    rope_theta = spec.pop("rope_theta")
    config = LlamaConfig(
        **spec, rope_parameters=dict(rope_type="default", rope_theta=rope_theta),
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + NORM_STD * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(EMBED_STD * noise)
            else:  # nn.Linear weight (out, in)
                p.copy_(LINEAR_GAIN / math.sqrt(p.shape[1]) * noise)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    with open(marker, "w") as f:  # written last: its presence means the folder is complete
        json.dump(fingerprint, f, indent=1)
    return folder


# ---- workload ---------------------------------------------------------------------------------

def make_workload(args) -> tuple[list[list[int]], list[int]]:
    """Seeded prompts (random non-special ids) and long-tailed output lengths."""
    rng = np.random.default_rng(args.seed)
    prompt_lens = rng.integers(args.min_prompt, args.max_prompt + 1, size=args.num_requests)
    prompts = [rng.integers(len(SPECIAL_TOKENS), MODEL_SPEC["vocab_size"], size=n).tolist() for n in prompt_lens]
    raw = rng.lognormal(mean=math.log(args.output_median), sigma=args.output_sigma, size=args.num_requests)
    out_lens = np.clip(np.round(raw), 1, args.max_output).astype(int).tolist()
    return prompts, out_lens


# ---- jaxserve ---------------------------------------------------------------------------------

def _copy_tree(tree):
    import jax
    return jax.tree_util.tree_map(lambda x: np.array(x, copy=True), tree)


class PhaseTimers:
    """Wraps engine methods (on instances / the engine_core module namespace) to sum their wall time.

    Installed only for the timed run; each wrapper costs well under a microsecond per call.
    """

    def __init__(self):
        self.seconds = collections.Counter()
        self.calls = collections.Counter()
        self._undo = []

    def wrap(self, owner, attr: str, label: str, on_call=None):
        original = getattr(owner, attr)
        seconds, calls = self.seconds, self.calls

        def wrapped(*a, **kw):
            if on_call is not None:
                on_call(*a, **kw)
            t0 = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                seconds[label] += time.perf_counter() - t0
                calls[label] += 1

        self._undo.append((owner, attr, original, attr in vars(owner)))
        setattr(owner, attr, wrapped)

    def restore(self):
        """Put every wrapped attribute back (an instance falls back to its class's method again)."""
        for owner, attr, original, had_own in reversed(self._undo):
            if had_own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)
        self._undo.clear()


def start_jaxserve(args, folder: str, max_num_seqs: int, log) -> dict:
    """Build one jaxserve engine (AOT compilation); returns its session: the LLM and its timed runs."""
    from jaxserve import LLM

    log(f"[jaxserve max_num_seqs={max_num_seqs}] building engine (AOT warm-up, compilation cache "
        f"{args.compilation_cache_dir}) ...")
    t0 = time.perf_counter()
    llm = LLM(
        model=folder, max_model_len=args.max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size,
        compilation_cache_dir=args.compilation_cache_dir, min_token_bucket=args.min_token_bucket,
        show_progress=False,
    )
    build_s = time.perf_counter() - t0
    core = llm.engine.core
    runner = core.runner
    log(f"  engine ready in {build_s:.1f}s: {len(runner._forward_exec)} forward + {len(runner._sample_exec)} "
        f"sampler executables; ladders T={core.ladders.tokens} W={core.ladders.page_widths}; "
        f"{core.num_pages} KV pages")
    return dict(name=f"jaxserve max_num_seqs={max_num_seqs}", max_num_seqs=max_num_seqs, llm=llm, build_s=build_s,
                runs=[])


def warm_up_jaxserve(session: dict, warm_prompts: list[list[int]], warm_tokens: int) -> None:
    """The untimed warm-up every system gets: greedy-generate `warm_tokens` tokens for each of `warm_prompts`."""
    from jaxserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=warm_tokens, ignore_eos=True)
    session["llm"].generate(warm_prompts, [params] * len(warm_prompts), use_tqdm=False)


def timed_jaxserve_run(args, session: dict, prompts, out_lens, log) -> float:
    """One timed `LLM.generate` of the whole workload (recording its steps, with phase timers), then an
    untimed replay of the recorded steps through the same runner; appends the run to session["runs"] and
    returns its end-to-end seconds."""
    import jaxserve.engine_core as engine_core_mod
    from jaxserve.sampling_params import SamplingParams

    llm = session["llm"]
    core = llm.engine.core
    runner = core.runner
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    recorded = []
    record_s = [0.0]

    def record(*step_args):
        """Keep a host copy of runner.step's arguments (batch, sampling[, prompt scoring batch])."""
        t = time.perf_counter()
        recorded.append(tuple(_copy_tree(a) for a in step_args))
        record_s[0] += time.perf_counter() - t

    timers = PhaseTimers()
    timers.wrap(runner, "step", "runner.step (device+transfer)", on_call=record)
    timers.wrap(core.scheduler, "schedule", "scheduler.schedule")
    timers.wrap(core.scheduler, "update", "scheduler.update")
    timers.wrap(core, "_sampled_tokens", "core._sampled_tokens")
    timers.wrap(engine_core_mod, "build_batch", "build_batch")
    timers.wrap(engine_core_mod, "build_sampling_batch", "build_sampling_batch")
    timers.wrap(llm.engine.output_processor, "process", "output_processor.process")
    timers.wrap(llm.engine, "submit", "engine.submit (queue requests)")
    timers.wrap(llm.engine, "make_requests", "engine.make_requests (validate)")

    base = llm.stats()
    gc.collect()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    e2e_s = time.perf_counter() - t0
    timers.restore()
    after = llm.stats()
    counted = ("steps", "scheduled_tokens", "padded_tokens", "preemptions", "compilations_after_warmup",
               "lazy_bucket_compilations")
    stats = {k: after[k] - base[k] for k in counted}

    produced = [len(o.outputs[0].token_ids) for o in outputs]
    bad = [i for i, (n, want) in enumerate(zip(produced, out_lens)) if n != want]
    if bad:
        log(f"!!! jaxserve produced the wrong number of tokens for {len(bad)} requests, e.g. #{bad[0]}: "
            f"{produced[bad[0]]} != {out_lens[bad[0]]}")

    # Replay the recorded steps through the same runner (same executables): device-only time.
    replay = []
    for step_args in recorded:
        t = time.perf_counter()
        runner.step(*step_args)
        replay.append(time.perf_counter() - t)
    in_situ_s = timers.seconds["runner.step (device+transfer)"]
    session["runs"].append(dict(
        e2e_s=e2e_s, replay_s=sum(replay), in_situ_runner_s=in_situ_s, record_copy_s=record_s[0],
        stats=stats, wrong_length=len(bad), per_step=replay, recorded=recorded,
        phases={label: dict(seconds=timers.seconds[label], calls=timers.calls[label]) for label in timers.seconds},
        first_tokens={i: list(o.outputs[0].token_ids[: args.check_tokens]) for i, o in enumerate(outputs)}))
    log(f"  {session['name']} timed run {len(session['runs'])}/{args.repeats}: {e2e_s:.2f}s end to end "
        f"({sum(out_lens) / e2e_s:.1f} tok/s), {stats['steps']} steps, runner.step in situ {in_situ_s:.2f}s, "
        f"replay {sum(replay):.2f}s")
    return e2e_s


def finish_jaxserve(args, session: dict, prompts, out_lens, log) -> dict:
    """Summarise a jaxserve session's timed runs (mean and best), then the untimed analyses of the fastest
    run's steps: per-step floor, per-bucket device time, attention probe, optional cProfile."""
    import jax
    from jaxserve.packing import pack
    from jaxserve.sampling_params import SamplingParams

    llm, max_num_seqs, build_s, runs = session["llm"], session["max_num_seqs"], session["build_s"], session["runs"]
    core = llm.engine.core
    runner = core.runner
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    best = min(runs, key=lambda r: r["e2e_s"])
    e2e_s = best["e2e_s"]
    device_s = min(r["replay_s"] for r in runs)
    recorded = best["recorded"]
    same_steps = all(len(r["recorded"]) == len(recorded) and all(
        a[0].input_ids.shape == b[0].input_ids.shape and a[0].page_table.shape == b[0].page_table.shape
        for a, b in zip(r["recorded"], recorded)) for r in runs)
    per_step = [min(ts) for ts in zip(*(r["per_step"] for r in runs))] if same_steps else best["per_step"]

    # Fixed cost of one step: runner.step on the smallest bucket with an all-padding batch.
    from jaxserve.batch import padded_batch_arrays, padded_sampling_arrays
    from jaxserve.batch_descriptor import BatchDescriptor
    from jaxserve.sampler import SamplingBatch

    smallest = core.ladders.tokens[0]
    tiny_batch = BatchDescriptor(**padded_batch_arrays(smallest, core.ladders.rows_for(smallest), 1, args.page_size))
    tiny_sampling = SamplingBatch(**padded_sampling_arrays(core.ladders.rows_for(smallest), 0))
    floor_times = []
    for _ in range(30):
        t = time.perf_counter()
        runner.step(tiny_batch, tiny_sampling)
        floor_times.append(time.perf_counter() - t)
    floor_s = float(np.median(floor_times[5:]))

    # Optionally split forward vs sampler per step by calling the two executables directly.
    split = {}
    if args.split_forward_sampler:
        for index, (batch, sampling, *_) in enumerate(recorded):
            num_tokens, (num_rows, width) = batch.input_ids.shape[0], batch.page_table.shape
            fwd = runner._forward_exec[(num_tokens, width)]
            smp = runner._sample_exec[(num_rows, sampling.aux_token_ids.shape[1])]
            t = time.perf_counter()
            logits, _, runner.k_cache, runner.v_cache = fwd(
                runner.params, runner.k_cache, runner.v_cache, pack(batch)[0])
            logits.block_until_ready()
            t1 = time.perf_counter()
            jax.device_get(smp(logits, pack(sampling)[0]))
            t2 = time.perf_counter()
            split[index] = (t1 - t, t2 - t1)

    buckets = collections.OrderedDict()
    examples = {}
    for index, (batch, *_) in enumerate(recorded):
        num_tokens, (num_rows, width) = batch.input_ids.shape[0], batch.page_table.shape
        num_seqs = int(batch.num_seqs)
        real_tokens = int(batch.query_start_loc[num_seqs]) if num_seqs else 0
        key = (num_tokens, width)
        examples.setdefault(key, batch)
        b = buckets.setdefault(key, dict(T=num_tokens, W=width, R=num_rows, steps=0, real_tokens=0,
                                         real_rows=0, device_s=0.0, forward_s=0.0, sampler_s=0.0,
                                         attention_ms=None))
        b["steps"] += 1
        b["real_tokens"] += real_tokens
        b["real_rows"] += num_seqs
        b["device_s"] += per_step[index]
        if index in split:
            b["forward_s"] += split[index][0]
            b["sampler_s"] += split[index][1]
    bucket_rows = sorted(buckets.values(), key=lambda b: -b["device_s"])

    if args.attention_probe:
        for b in bucket_rows[: args.attention_probe]:
            b["attention_ms"] = 1e3 * probe_attention(runner, core.spec, examples[(b["T"], b["W"])])

    stats = best["stats"]
    steps = stats["steps"]
    result = dict(
        max_num_seqs=max_num_seqs,
        engine_build_s=build_s,
        e2e_s=e2e_s,
        **timing_summary([r["e2e_s"] for r in runs], sum(out_lens)),
        device_only_s=device_s,
        replay_runs_s=[r["replay_s"] for r in runs],
        overhead=1.0 - device_s / e2e_s,
        overhead_runs=[1.0 - r["replay_s"] / r["e2e_s"] for r in runs],
        in_situ_runner_s=best["in_situ_runner_s"],
        host_outside_runner=1.0 - best["in_situ_runner_s"] / e2e_s,
        host_outside_runner_runs=[1.0 - r["in_situ_runner_s"] / r["e2e_s"] for r in runs],
        record_copy_s=best["record_copy_s"],
        steps=steps,
        step_floor_s=floor_s,
        mean_real_tokens_per_step=stats["scheduled_tokens"] / max(steps, 1),
        mean_padded_tokens_per_step=stats["padded_tokens"] / max(steps, 1),
        mean_real_rows_per_step=sum(int(b.num_seqs) for b, *_ in recorded) / max(len(recorded), 1),
        mean_padded_rows_per_step=sum(b.page_table.shape[0] for b, *_ in recorded) / max(len(recorded), 1),
        preemptions=stats["preemptions"],
        compilations_after_warmup=stats["compilations_after_warmup"],
        lazy_bucket_compilations=stats["lazy_bucket_compilations"],
        wrong_length_requests=max(r["wrong_length"] for r in runs),
        phases=best["phases"],
        buckets=bucket_rows,
        first_tokens=runs[0]["first_tokens"],
    )

    if args.profile:
        n = min(args.profile_requests or len(prompts), len(prompts))
        log(f"  cProfile of a separate (untimed) generate over {n} requests ...")
        profiler = cProfile.Profile()
        profiler.enable()
        t = time.perf_counter()
        llm.generate(prompts[:n], params[:n], use_tqdm=False)
        profiled_s = time.perf_counter() - t
        profiler.disable()
        result["profile"] = dict(requests=n, wall_s=profiled_s, cumulative=_pstats_text(profiler, "cumulative", 25),
                                 tottime=_pstats_text(profiler, "tottime", 20))

    del session["llm"], session["runs"], llm, runner, core, recorded, runs
    gc.collect()
    return result


def timing_summary(runs_s: list[float], useful_tokens: int) -> dict:
    """Wall times of one system's timed runs, their mean and best, and useful tokens/s at each."""
    mean_s, best_s = float(np.mean(runs_s)), min(runs_s)
    return dict(runs_s=list(runs_s), mean_s=mean_s, best_s=best_s, useful_tokens=useful_tokens,
                mean_tok_per_s=useful_tokens / mean_s, best_tok_per_s=useful_tokens / best_s)


def probe_attention(runner, spec, batch, iters: int = 3) -> float:
    """Seconds of the reference paged attention + KV write, for all layers, at one recorded batch's shapes.

    Jits jaxserve's own attention functions (pallas_kernels reference) standalone on the runner's KV
    cache, so this is the attention share of the forward at that bucket (best of `iters`).
    """
    import jax
    import jax.numpy as jnp
    from jaxserve.attention import make_attention

    attention, write_kv = make_attention(spec, "auto", runner.k_cache.sharding.mesh, runner.page_size)
    num_tokens = batch.input_ids.shape[0]
    kv_heads = runner.k_cache.shape[3]

    def all_layers(q, k_new, v_new, k_cache, v_cache, batch):
        # Same structure as the model: a lax.scan over layers with a traced layer index.
        def layer_step(carry, layer):
            k_cache, v_cache, out = carry
            k_cache, v_cache = write_kv(k_cache, v_cache, layer, k_new, v_new, batch)
            return (k_cache, v_cache, out + attention(q, k_cache, v_cache, layer, batch)), None

        layers = jnp.arange(spec.num_layers, dtype=jnp.int32)
        (k_cache, v_cache, out), _ = jax.lax.scan(layer_step, (k_cache, v_cache, jnp.zeros_like(q)), layers)
        return out, k_cache, v_cache

    # Donated scratch caches (same shape as the runner's), so the KV write is in place as in the engine.
    run = jax.jit(all_layers, donate_argnums=(3, 4))
    k_cache = jnp.zeros(runner.k_cache.shape, runner.k_cache.dtype)
    v_cache = jnp.zeros(runner.v_cache.shape, runner.v_cache.dtype)
    key = jax.random.PRNGKey(0)
    q = jax.random.normal(key, (num_tokens, spec.num_heads, spec.head_dim), runner.k_cache.dtype)
    k_new = jax.random.normal(key, (num_tokens, kv_heads, spec.head_dim), runner.k_cache.dtype)
    out, k_cache, v_cache = run(q, k_new, k_new, k_cache, v_cache, batch)  # compile
    out.block_until_ready()
    best = math.inf
    for _ in range(iters):
        t = time.perf_counter()
        out, k_cache, v_cache = run(q, k_new, k_new, k_cache, v_cache, batch)
        out.block_until_ready()
        best = min(best, time.perf_counter() - t)
    del k_cache, v_cache
    return best


def _pstats_text(profiler, sort: str, limit: int) -> str:
    buf = io.StringIO()
    stats = pstats.Stats(profiler, stream=buf)
    stats.strip_dirs().sort_stats(sort).print_stats(limit)
    text = buf.getvalue()
    # Drop the preamble up to the column header.
    start = text.find("   ncalls")
    return text[start:] if start >= 0 else text


# ---- Hugging Face -----------------------------------------------------------------------------

def load_hf(folder: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore EOS: every row runs to max_new_tokens
    model.generation_config.pad_token_id = PAD_ID
    return model


def hf_generate(model, prompts: list[list[int]], new_tokens: int):
    """Greedy static-batch generate of `new_tokens` tokens, left padded; returns (B, new_tokens) ids."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids, attention_mask=mask, do_sample=False, use_cache=True,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=PAD_ID,
        )
    generated = out[:, width:]
    if generated.shape[1] != new_tokens:
        raise RuntimeError(f"HF generated {generated.shape[1]} tokens, expected {new_tokens} (EOS not disabled?)")
    return generated


def pick_hf_threads(args, model, prompts, batch_size: int, log) -> tuple[int, dict]:
    """The torch thread count for this batch size: forced by --hf-threads, or the faster of
    os.cpu_count() and 1 on a short generate of the first chunk (on a shared machine, torch's
    OpenMP threads can be many times slower when a core is busy with another process)."""
    import torch

    candidates = args.hf_threads_list or sorted({os.cpu_count() or 1, 1}, reverse=True)
    if len(candidates) == 1:
        return candidates[0], {}
    chunk = prompts[:batch_size]
    timings = {}
    for threads in candidates:
        torch.set_num_threads(threads)
        hf_generate(model, chunk[:2], 2)  # settle the thread pool
        t = time.perf_counter()
        hf_generate(model, chunk, args.hf_calibration_tokens)
        timings[threads] = time.perf_counter() - t
    best = min(timings, key=timings.get)
    log(f"  HF bs{batch_size} thread calibration ({args.hf_calibration_tokens} new tokens): "
        + ", ".join(f"{t} threads {s:.2f}s" for t, s in timings.items()) + f" -> using {best}")
    return best, timings


def start_hf(args, model, prompts, batch_size: int, log) -> dict:
    """One Hugging Face configuration (static batch size, torch threads calibrated here, untimed);
    returns its session: the model, its settings and its timed runs."""
    threads, calibration = pick_hf_threads(args, model, prompts, batch_size, log)
    return dict(name=f"HF bs{batch_size}", model=model, batch_size=batch_size, threads=threads,
                thread_calibration_s=calibration, runs=[])


def warm_up_hf(session: dict, warm_prompts: list[list[int]], warm_tokens: int) -> None:
    """The untimed warm-up every system gets: greedy-generate `warm_tokens` tokens for each of `warm_prompts`
    (in static batches of this configuration's size)."""
    import torch

    torch.set_num_threads(session["threads"])
    for start in range(0, len(warm_prompts), session["batch_size"]):
        hf_generate(session["model"], warm_prompts[start:start + session["batch_size"]], warm_tokens)


def timed_hf_run(args, session: dict, prompts, out_lens, log) -> float:
    """One timed static-batch run of the whole workload, in request order, each batch generating its
    longest output; appends the run to session["runs"] and returns its seconds."""
    import torch

    batch_size = session["batch_size"]
    torch.set_num_threads(session["threads"])
    generated_tokens = 0
    first_tokens = {}
    gc.collect()
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        ids = hf_generate(session["model"], prompts[start:start + batch_size], max(out_lens[start:start + batch_size]))
        generated_tokens += ids.shape[0] * ids.shape[1]  # ids: (rows, new tokens)
        for row in range(ids.shape[0]):
            first_tokens[start + row] = ids[row, : args.check_tokens].tolist()
    total_s = time.perf_counter() - t0
    session["runs"].append(dict(total_s=total_s, generated_tokens=generated_tokens, first_tokens=first_tokens))
    log(f"  {session['name']} ({session['threads']} threads) timed run {len(session['runs'])}/{args.repeats}: "
        f"{total_s:.2f}s, {sum(out_lens) / total_s:.1f} useful tok/s ({generated_tokens} generated incl. "
        f"static-batch waste)")
    return total_s


def finish_hf(session: dict, out_lens) -> dict:
    """Summarise a Hugging Face session's timed runs (mean and best)."""
    runs = session["runs"]
    return dict(batch_size=session["batch_size"], threads=session["threads"],
                thread_calibration_s=session["thread_calibration_s"],
                **timing_summary([r["total_s"] for r in runs], sum(out_lens)),
                generated_tokens=runs[0]["generated_tokens"], first_tokens=runs[0]["first_tokens"])


# ---- report -----------------------------------------------------------------------------------

def print_report(res: dict, args, out=print):
    out("")
    out("=" * 78)
    out("throughput: jaxserve vs Hugging Face transformers (static batching), same weights/prompts")
    out("=" * 78)
    w = res["workload"]
    out(f"workload: {w['num_requests']} requests, prompt len {w['prompt_min']}..{w['prompt_max']} "
        f"(mean {w['prompt_mean']:.1f}), output len median {w['output_median']:.0f} / mean "
        f"{w['output_mean']:.1f} / max {w['output_max']} (sum {w['useful_tokens']}), EOS ignored")
    out("")
    rows = [(f"jaxserve (max_num_seqs={j['max_num_seqs']})", j) for j in res["jaxserve"]]
    rows += [(f"HF generate bs{h['batch_size']} ({h['threads']} thr)", h) for h in res["hf"]]
    out(f"every system: the same untimed warm-up ({args.warmup_requests} requests x {args.warmup_tokens} tokens), "
        f"then {args.repeats} timed runs of the whole workload in rounds of alternating order")
    out(f"{'system':<34}{'mean tok/s':>12}{'best tok/s':>12}{'mean s':>9}{'best s':>9}  runs s")
    for name, r in rows:
        out(f"{name:<34}{r['mean_tok_per_s']:>12.1f}{r['best_tok_per_s']:>12.1f}{r['mean_s']:>9.2f}{r['best_s']:>9.2f}"
            f"  {', '.join(f'{x:.2f}' for x in r['runs_s'])}")
    out("")
    if res["hf"]:
        best_jm = max(res["jaxserve"], key=lambda j: j["mean_tok_per_s"])
        best_hm = max(res["hf"], key=lambda h: h["mean_tok_per_s"])
        best_jb = max(res["jaxserve"], key=lambda j: j["best_tok_per_s"])
        best_hb = max(res["hf"], key=lambda h: h["best_tok_per_s"])
        out(f"ratio of means: jaxserve (max_num_seqs={best_jm['max_num_seqs']}) / HF (bs{best_hm['batch_size']}): "
            f"{res['ratio_mean']:.2f}x   (goal >= 3x)")
        out(f"ratio of bests: jaxserve (max_num_seqs={best_jb['max_num_seqs']}) / HF (bs{best_hb['batch_size']}): "
            f"{res['ratio_best']:.2f}x")
        out(f"per round (fastest jaxserve / fastest HF within the round): "
            f"{', '.join(f'{x:.2f}x' for x in res['ratio_rounds'])}")
    for j in res["jaxserve"]:
        out(f"engine overhead (max_num_seqs={j['max_num_seqs']}): {100 * j['overhead']:.1f}%   (goal < 10%)  "
            f"= 1 - device-only {j['device_only_s']:.2f}s / end-to-end {j['e2e_s']:.2f}s (fastest of each)")
        out(f"  per run: end to end {', '.join(f'{x:.2f}' for x in j['runs_s'])}s; replay "
            f"{', '.join(f'{x:.2f}' for x in j['replay_runs_s'])}s; overhead "
            f"{', '.join(f'{100 * x:.1f}%' for x in j['overhead_runs'])}")
        out(f"  same-run estimate (no cross-run noise): host time outside runner.step "
            f"{100 * j['host_outside_runner']:.1f}% (runs: "
            f"{', '.join(f'{100 * x:.1f}%' for x in j['host_outside_runner_runs'])}); recording copies "
            f"{1e3 * j['record_copy_s']:.0f} ms of that")
        out(f"  steps {j['steps']}, tokens/step real {j['mean_real_tokens_per_step']:.1f} vs padded "
            f"{j['mean_padded_tokens_per_step']:.1f} "
            f"({100 * j['mean_real_tokens_per_step'] / max(j['mean_padded_tokens_per_step'], 1e-9):.0f}% useful), "
            f"rows/step real {j['mean_real_rows_per_step']:.1f} vs padded {j['mean_padded_rows_per_step']:.1f}, "
            f"preemptions {j['preemptions']}, compilations after warm-up {j['compilations_after_warmup']} "
            f"(lazy {j['lazy_bucket_compilations']})")
        out(f"  per-step floor (runner.step on the smallest bucket, all padding): {1e3 * j['step_floor_s']:.2f} ms"
            f" x {j['steps']} steps = {j['step_floor_s'] * j['steps']:.2f}s "
            f"({100 * j['step_floor_s'] * j['steps'] / j['device_only_s']:.0f}% of device-only time)")
    for h in res["hf"]:
        if h["thread_calibration_s"]:
            out(f"HF bs{h['batch_size']} torch threads: " + ", ".join(
                f"{t}: {sec:.2f}s" for t, sec in h["thread_calibration_s"].items())
                + f" for a {args.hf_calibration_tokens}-token generate of one chunk -> used {h['threads']}")
        out(f"HF bs{h['batch_size']}: generated {h['generated_tokens']} tokens for {h['useful_tokens']} useful "
            f"({100 * h['useful_tokens'] / h['generated_tokens']:.0f}% useful under static batching)")
    c = res.get("check")
    if c:
        status = "OK" if c["all_match"] else "!!! MISMATCH !!!"
        out(f"correctness: first {c['tokens']} greedy tokens of requests {c['requests']} vs HF batch-1: {status}"
            + ("" if c["hf_padded_match"] is None else
               f"; vs HF left-padded bs{c['hf_padded_bs']}: {c['hf_padded_match']}/{len(c['requests'])} match"))
    out("")
    for j in res["jaxserve"]:
        out(f"-- jaxserve host/device breakdown of the timed run (max_num_seqs={j['max_num_seqs']}) --")
        accounted = 0.0
        for label, p in sorted(j["phases"].items(), key=lambda kv: -kv[1]["seconds"]):
            out(f"  {label:<40}{p['seconds']:>8.3f}s {100 * p['seconds'] / j['e2e_s']:>5.1f}%  "
                f"{p['calls']:>6} calls  {1e3 * p['seconds'] / max(p['calls'], 1):>7.3f} ms/call")
            accounted += p["seconds"]
        out(f"  {'(rest: LLM._run loop, finish_requests...)':<40}{j['e2e_s'] - accounted:>8.3f}s "
            f"{100 * (j['e2e_s'] - accounted) / j['e2e_s']:>5.1f}%")
        out(f"  runner.step in situ {j['phases'].get('runner.step (device+transfer)', {}).get('seconds', 0):.3f}s "
            f"vs replayed {j['device_only_s']:.3f}s")
        out("")
        out(f"-- device time per bucket (T tokens, W pages/row), replay, max_num_seqs={j['max_num_seqs']} --")
        split = any(b["forward_s"] for b in j["buckets"])
        header = (f"  {'T':>5}{'W':>4}{'R':>5}{'steps':>7}{'real tok/step':>15}{'rows/step':>10}{'ms/step':>9}"
                  f"{'total s':>9}{'share':>7}")
        if split:
            header += f"{'fwd ms':>8}{'smp ms':>8}"
        header += f"{'attn ms':>9}"
        out(header)
        for b in j["buckets"]:
            line = (f"  {b['T']:>5}{b['W']:>4}{b['R']:>5}{b['steps']:>7}{b['real_tokens'] / b['steps']:>15.1f}"
                    f"{b['real_rows'] / b['steps']:>10.1f}{1e3 * b['device_s'] / b['steps']:>9.2f}"
                    f"{b['device_s']:>9.2f}{100 * b['device_s'] / max(j['device_only_s'], 1e-9):>6.1f}%")
            if split:
                line += f"{1e3 * b['forward_s'] / b['steps']:>8.2f}{1e3 * b['sampler_s'] / b['steps']:>8.2f}"
            line += f"{b['attention_ms']:>9.2f}" if b.get("attention_ms") is not None else f"{'':>9}"
            out(line)
        if any(b.get("attention_ms") is not None for b in j["buckets"]):
            out("  ms/step: replay of runner.step (best per step over the runs); fwd/smp: the two executables "
                "timed apart; attn ms: paged attention + KV write alone, all layers, same shapes")
        out("")
        if "profile" in j:
            p = j["profile"]
            out(f"-- cProfile of a separate generate ({p['requests']} requests, {p['wall_s']:.2f}s under the "
                f"profiler), top 25 by cumulative time --")
            out(p["cumulative"].rstrip())
            out("")
            out("-- same profile, top 20 by own time (tottime) --")
            out(p["tottime"].rstrip())
            out("")
    out(f"command: {res['command']}")


# ---- main -------------------------------------------------------------------------------------

def base_parser(doc: str, quick_help: str) -> argparse.ArgumentParser:
    """The options every benchmark on this model shares: where its folder and XLA cache live, the seed, --quick."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--cache-dir", default="/tmp/jaxserve-bench/", help="model folder and XLA cache live here")
    p.add_argument("--compilation-cache-dir", default=None, help="default: <cache-dir>/xla-cache")
    p.add_argument("--seed", type=int, default=0, help="seeds the model weights and the workload")
    p.add_argument("--quick", action="store_true", help=quick_help)
    return p


def parse_args(argv=None):
    p = base_parser(__doc__, "smaller variant for iteration: 32 requests")
    p.add_argument("--num-requests", type=int, default=None, help="default 128 (32 with --quick)")
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--output-median", type=float, default=64.0, help="median of the lognormal output lengths")
    p.add_argument("--output-sigma", type=float, default=1.0, help="sigma of the lognormal output lengths")
    p.add_argument("--max-output", type=int, default=384, help="output lengths are clipped to [1, this]")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", default="64,128", help="comma list: one jaxserve engine per value, e.g. 64,128")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--min-token-bucket", type=int, default=8)
    p.add_argument("--hf-batch-sizes", default="16,64", help="comma list; empty to skip Hugging Face")
    p.add_argument("--xla-cpu-single-thread", action="store_true",
                   help="run jaxserve's XLA CPU executables on one thread (sets XLA_FLAGS before jax starts); "
                        "on a shared 2-core machine this can be faster, like torch with 1 thread")
    p.add_argument("--hf-threads", default="auto",
                   help="torch threads for HF: 'auto' (the faster of os.cpu_count() and 1, measured per batch "
                        "size), or a number")
    p.add_argument("--hf-calibration-tokens", type=int, default=8, help="new tokens in the thread calibration")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs of every system (jaxserve engines and HF batch sizes alike), in rounds of "
                        "alternating order; each jaxserve run is followed by an untimed replay of its steps")
    p.add_argument("--warmup-requests", type=int, default=8,
                   help="the untimed warm-up every system gets: this many of the first requests ...")
    p.add_argument("--warmup-tokens", type=int, default=16, help="... generating this many tokens each")
    p.add_argument("--attention-probe", type=int, default=4,
                   help="time the paged attention alone at the N costliest buckets (0 to skip)")
    p.add_argument("--no-split", dest="split_forward_sampler", action="store_false",
                   help="skip the extra replay that splits forward vs sampler time per bucket")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the cProfile run")
    p.add_argument("--profile-requests", type=int, default=None, help="requests in the cProfile run (default all)")
    p.add_argument("--check-requests", type=int, default=4, help="requests cross-checked against HF batch-1")
    p.add_argument("--check-tokens", type=int, default=8, help="greedy tokens compared per checked request")
    p.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON here")
    args = p.parse_args(argv)
    if args.num_requests is None:
        args.num_requests = 32 if args.quick else 128
    if args.compilation_cache_dir is None:
        args.compilation_cache_dir = os.path.join(args.cache_dir, "xla-cache")
    args.max_num_seqs_list = [int(x) for x in str(args.max_num_seqs).split(",") if x.strip()]
    args.hf_batch_sizes_list = [int(x) for x in str(args.hf_batch_sizes).split(",") if x.strip()]
    args.hf_threads_list = [] if args.hf_threads == "auto" else [int(args.hf_threads)]
    if args.repeats < 1 or args.warmup_requests < 1 or args.warmup_tokens < 1:
        p.error("--repeats, --warmup-requests and --warmup-tokens must be >= 1")
    if args.max_prompt + args.max_output > args.max_model_len:
        p.error(f"--max-prompt + --max-output ({args.max_prompt + args.max_output}) exceed --max-model-len")
    return args


def timed_rounds(args, jax_sessions, hf_sessions, prompts, out_lens, log) -> list[dict[str, float]]:
    """`args.repeats` rounds, each timing every system once on the whole workload; the order alternates
    (forward, then reversed) so a slow spell of the shared machine does not always hit the same system.
    Returns the seconds of each system in each round."""
    systems = [(s, timed_jaxserve_run) for s in jax_sessions] + [(s, timed_hf_run) for s in hf_sessions]
    rounds = []
    for repeat in range(args.repeats):
        order = systems if repeat % 2 == 0 else systems[::-1]
        log(f"timed round {repeat + 1}/{args.repeats}: {', '.join(session['name'] for session, _ in order)}")
        rounds.append({session["name"]: run(args, session, prompts, out_lens, log) for session, run in order})
    return rounds


def headline_ratios(jax_results: list[dict], hf_results: list[dict], rounds: list[dict[str, float]]) -> dict:
    """Best jaxserve configuration over best HF configuration, by mean run and by best run (same number of
    timed runs each), and per round (the fastest of each side within one round); None without HF."""
    if not hf_results:
        return dict(ratio_mean=None, ratio_best=None, ratio_rounds=[])
    hf_names = {f"HF bs{h['batch_size']}" for h in hf_results}
    ratio_rounds = [min(v for k, v in r.items() if k in hf_names) / min(v for k, v in r.items() if k not in hf_names)
                    for r in rounds]
    return dict(
        ratio_mean=max(j["mean_tok_per_s"] for j in jax_results) / max(h["mean_tok_per_s"] for h in hf_results),
        ratio_best=max(j["best_tok_per_s"] for j in jax_results) / max(h["best_tok_per_s"] for h in hf_results),
        ratio_rounds=ratio_rounds)


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)

    if args.xla_cpu_single_thread:
        flags = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    os.makedirs(args.cache_dir, exist_ok=True)
    folder = ensure_model(args.cache_dir, args.seed, log)
    prompts, out_lens = make_workload(args)
    plens = [len(p) for p in prompts]
    workload = dict(num_requests=len(prompts), prompt_min=min(plens), prompt_max=max(plens),
                    prompt_mean=float(np.mean(plens)), output_median=float(np.median(out_lens)),
                    output_mean=float(np.mean(out_lens)), output_max=max(out_lens), output_min=min(out_lens),
                    useful_tokens=sum(out_lens))
    log(f"workload: {len(prompts)} requests, prompt len mean {workload['prompt_mean']:.1f}; output len "
        f"median {workload['output_median']:.0f}, mean {workload['output_mean']:.1f}, max {workload['output_max']}, "
        f"sum {workload['useful_tokens']}")

    import jax
    import torch
    log(f"jax {jax.__version__} on {jax.devices()} (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}); "
        f"torch {torch.__version__}; cpu_count {os.cpu_count()}")

    jax_sessions = [start_jaxserve(args, folder, m, log) for m in args.max_num_seqs_list]
    model, hf_sessions = None, []
    if args.hf_batch_sizes_list or args.check_requests:
        log("loading the HF model ...")
        model = load_hf(folder)
        hf_sessions = [start_hf(args, model, prompts, bs, log) for bs in args.hf_batch_sizes_list]
    warm_prompts = prompts[: args.warmup_requests]
    log(f"untimed warm-up of every system: {len(warm_prompts)} requests x {args.warmup_tokens} tokens")
    for session in jax_sessions:
        warm_up_jaxserve(session, warm_prompts, args.warmup_tokens)
    for session in hf_sessions:
        warm_up_hf(session, warm_prompts, args.warmup_tokens)
    rounds = timed_rounds(args, jax_sessions, hf_sessions, prompts, out_lens, log)
    jax_results = [finish_jaxserve(args, session, prompts, out_lens, log) for session in jax_sessions]
    hf_results = [finish_hf(session, out_lens) for session in hf_sessions]

    check = None
    if model is not None:
        if args.check_requests:
            picks = sorted(set(np.linspace(0, len(prompts) - 1, args.check_requests).round().astype(int).tolist()))
            tokens = min(args.check_tokens, *(out_lens[i] for i in picks))
            mismatches = []
            for i in picks:
                want = hf_generate(model, [prompts[i]], tokens)[0].tolist()
                for j in jax_results:
                    got = j["first_tokens"][i][:tokens]
                    if got != want:
                        mismatches.append(dict(request=i, max_num_seqs=j["max_num_seqs"], jaxserve=got, hf=want))
            padded = None
            if hf_results:
                h = hf_results[0]
                padded = sum(h["first_tokens"][i][:tokens] == jax_results[0]["first_tokens"][i][:tokens] for i in picks)
            check = dict(requests=picks, tokens=tokens, all_match=not mismatches, mismatches=mismatches,
                         hf_padded_match=padded, hf_padded_bs=hf_results[0]["batch_size"] if hf_results else None)
            for m in mismatches:
                print(f"!!! MISMATCH request {m['request']} (max_num_seqs={m['max_num_seqs']}): "
                      f"jaxserve {m['jaxserve']} vs HF {m['hf']}", flush=True)
        del model
        gc.collect()

    ratios = headline_ratios(jax_results, hf_results, rounds)
    for j in jax_results:
        j.pop("first_tokens", None)
    for h in hf_results:
        h.pop("first_tokens", None)
    res = dict(command=command, args={k: v for k, v in vars(args).items()}, model_folder=folder,
               workload=workload, jaxserve=jax_results, hf=hf_results, rounds=rounds, **ratios, check=check,
               total_wall_s=time.perf_counter() - start)
    print_report(res, args)
    log("done")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return res


if __name__ == "__main__":
    main()
