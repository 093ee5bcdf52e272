#!/usr/bin/env python
"""Shared KV pages: prefix caching and copy-on-write n > 1 sampling, each measured side by side in one run.

Three comparisons on the seeded random-weight Llama of benchmarks/throughput.py (same weights; its
config allows 2048 positions here, so a 1024-token system prompt plus a question fits). Every system
in a comparison gets the same untimed warm-up and the same number of timed runs, in rounds whose
order alternates (forward, then reversed); each system's mean and best run are reported. Every run
submits its whole workload at once and steps `LLMEngine` until all of it finished, recording when
each request's first token appears and the KV pages in use (kv_pages_total - kv_pages_free) after
every step. The prefix cache is reset before every run (warm-up and timed), so no run inherits
another's pages.

(a) shared system prompt: a 1024-token prefix + short questions (greedy), prefix caching on vs off:
    prefix-cache hit rate against the ideal ((questions - 1) x the prefix's full pages, in tokens:
    the first question must compute the prefix), output tokens/s, mean time to first token.
(b) n = 8 sampling on prompts of 512 tokens (seeded, temperature 1): one request with n = 8 (the
    samples fork the prompt's pages; default engine) vs 8 separate requests with seeds seed + i on
    an engine with prefix caching off (no sharing at all): peak KV pages in use and output tokens/s,
    the samples running at the peak and the pages per running sample (the two sides need not run
    as many samples at once: independent prompts are limited by prefill), and whether both give the
    same tokens.
(c) a workload with no shared prefixes (random prompts of 16-256 tokens, long-tailed outputs, as in
    throughput.py), prefix caching on vs off: output tokens/s, per-round on/off ratios, and the host
    time spent in the cache's hashing and lookups in one further, untimed, instrumented run.

Greedy outputs with caching on and off are compared token for token in (a) and (c).

Example:
    python benchmarks/sharing.py --json /tmp/sharing.json     # full run (sized for a 2-core CPU)
    python benchmarks/sharing.py --quick                      # small, for iteration
"""

from __future__ import annotations

import gc
import os
import shlex
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import throughput as tp  # noqa: E402  (sets the offline Hugging Face environment variables)

PAGE_SIZE = 16


# ---- model ------------------------------------------------------------------------------------

def ensure_long_model(cache_dir: str, seed: int, max_positions: int, log) -> str:
    """throughput.py's model folder with `max_position_embeddings = max_positions` (same seed, same
    parameter shapes, so the same weights; default RoPE does not depend on that field)."""
    saved = tp.MODEL_SPEC
    tp.MODEL_SPEC = {**saved, "max_position_embeddings": max_positions}
    try:
        return tp.ensure_model(cache_dir, seed, log)
    finally:
        tp.MODEL_SPEC = saved


def start_engine(args, folder: str, prefix_caching: bool, log):
    from jaxserve import LLM

    t0 = time.perf_counter()
    llm = LLM(model=folder, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, page_size=PAGE_SIZE,
              compilation_cache_dir=args.compilation_cache_dir, enable_prefix_caching=prefix_caching,
              show_progress=False)
    log(f"engine prefix caching {'on' if prefix_caching else 'off'} ready in {time.perf_counter() - t0:.1f}s "
        f"({llm.stats()['kv_pages_total']} KV pages, page widths {llm.engine.core.ladders.page_widths})")
    return llm


# ---- one run: submit everything, step LLMEngine to the end --------------------------------------

def drive(llm, items: list[tuple[list[int], object]]) -> dict:
    """Submit every (prompt token ids, SamplingParams) at once, then step `LLMEngine` until all finished.

    Returns wall seconds, per-request time to first token (from its own submission to the end of the
    step that produced its first token), peak KV pages in use after any step, the prefix-cache
    counters of this run and every request's output token ids (one list per sample). Memory per sample in
    flight: the engine requests (samples) running when the peak was reached, the most running after any
    step, and pages in use per running sample over the run (summed pages / summed running, after each step)."""
    engine = llm.engine
    engine.core.reset_prefix_cache()
    base = engine.stats()
    gc.collect()
    t0 = time.perf_counter()
    submitted, ttft, outputs = {}, {}, {}
    for prompt, params in items:
        request_id = f"r{drive.counter}"
        drive.counter += 1
        submitted[request_id] = time.perf_counter()
        engine.submit(request_id, engine.make_requests(request_id, prompt, params))
    pending = set(submitted)
    peak, peak_running, max_running, steps, page_steps, sample_steps = 0, 0, 0, 0, 0, 0
    while pending:
        step_outputs = engine.step()
        now = time.perf_counter()
        stats = engine.stats()
        in_use, running = stats["kv_pages_total"] - stats["kv_pages_free"], stats["num_requests_running"]
        if in_use > peak:
            peak, peak_running = in_use, running
        max_running = max(max_running, running)
        page_steps += in_use
        sample_steps += running
        steps += 1
        for out in step_outputs:
            rid = out.request_id
            if rid not in ttft and any(c.token_ids for c in out.outputs):
                ttft[rid] = now - submitted[rid]
            if out.finished and rid in pending:
                outputs[rid] = [list(c.token_ids) for c in out.outputs]
                pending.discard(rid)
    wall = time.perf_counter() - t0
    after = engine.stats()
    order = list(submitted)
    return dict(wall_s=wall, steps=steps, peak_pages=peak, running_at_peak=peak_running, max_running=max_running,
                pages_per_running=page_steps / max(sample_steps, 1),
                ttft_s=[ttft[r] for r in order],
                queries=after["prefix_cache_queries"] - base["prefix_cache_queries"],
                hits=after["prefix_cache_hits"] - base["prefix_cache_hits"],
                preemptions=after["preemptions"] - base["preemptions"],
                output_tokens=sum(len(t) for r in order for t in outputs[r]),
                tokens=[outputs[r] for r in order])


drive.counter = 0


def compare(systems: list[dict], repeats: int, log) -> list[dict]:
    """The same untimed warm-up for every system, then `repeats` rounds, each running every system once,
    the order alternating between rounds. Each system: name, llm, items, warmup_items."""
    for s in systems:
        drive(s["llm"], s["warmup_items"])
        s["runs"] = []
    for r in range(repeats):
        order = systems if r % 2 == 0 else systems[::-1]
        for s in order:
            run = drive(s["llm"], s["items"])
            run["round"] = r
            s["runs"].append(run)
            log(f"  round {r + 1}/{repeats} {s['name']}: {run['wall_s']:.2f}s, {run['output_tokens']} output tokens "
                f"({run['output_tokens'] / run['wall_s']:.0f} tok/s), {run['steps']} steps, peak {run['peak_pages']} "
                f"pages, mean TTFT {np.mean(run['ttft_s']):.2f}s, prefix hits {run['hits']}/{run['queries']}")
    return systems


def summarise(s: dict) -> dict:
    """Mean and best of a system's timed runs (throughput via throughput.timing_summary)."""
    runs = s["runs"]
    tokens = {r["output_tokens"] for r in runs}
    assert len(tokens) == 1, f"{s['name']}: output token counts differ between runs: {tokens}"
    out = dict(name=s["name"], **tp.timing_summary([r["wall_s"] for r in runs], tokens.pop()))
    mean_ttfts = [float(np.mean(r["ttft_s"])) for r in runs]
    out.update(ttft_mean_s=float(np.mean(mean_ttfts)), ttft_best_s=min(mean_ttfts), ttft_runs_s=mean_ttfts,
               peak_pages_runs=[r["peak_pages"] for r in runs], steps_runs=[r["steps"] for r in runs],
               running_at_peak_runs=[r["running_at_peak"] for r in runs],
               max_running_runs=[r["max_running"] for r in runs],
               pages_per_running_runs=[r["pages_per_running"] for r in runs],
               hits_runs=[r["hits"] for r in runs], queries_runs=[r["queries"] for r in runs],
               preemptions_runs=[r["preemptions"] for r in runs])
    return out


def same_tokens(a: dict, b: dict) -> tuple[int, int]:
    """(requests with identical tokens in every sample, requests) between the first runs of a and b."""
    x, y = a["runs"][0]["tokens"], b["runs"][0]["tokens"]
    return sum(p == q for p, q in zip(x, y)), len(x)


# ---- workloads ----------------------------------------------------------------------------------

def random_ids(rng, n: int) -> list[int]:
    return rng.integers(len(tp.SPECIAL_TOKENS), tp.MODEL_SPEC["vocab_size"], size=n).tolist()


def shared_prefix_workload(args, SamplingParams):
    rng = np.random.default_rng(args.seed + 1)
    prefix = random_ids(rng, args.prefix_len)
    lens = rng.integers(args.min_question, args.max_question + 1, size=args.num_questions)
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
    items = [(prefix + random_ids(rng, int(n)), params) for n in lens]
    # The warm-up: another prefix (nothing of it can be hit by the timed runs), 4 questions, 8 tokens.
    warm_prefix = random_ids(rng, args.prefix_len)
    warm = [(warm_prefix + random_ids(rng, args.max_question), SamplingParams(temperature=0.0, max_tokens=8,
                                                                              ignore_eos=True)) for _ in range(4)]
    return items, warm


def parallel_workload(args, SamplingParams, n: int):
    """(shared items, independent items, their warm-ups): each prompt once with n samples, or n times."""
    rng = np.random.default_rng(args.seed + 2)
    prompts = [random_ids(rng, args.parallel_prompt_len) for _ in range(args.parallel_prompts + 1)]
    warm_prompt, prompts = prompts[0], prompts[1:]

    def both(prompt_list, seed0, max_tokens):
        shared, independent = [], []
        for p, prompt in enumerate(prompt_list):
            seed = seed0 + 1000 * p
            shared.append((prompt, SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens,
                                                  ignore_eos=True)))
            independent += [(prompt, SamplingParams(temperature=1.0, seed=seed + i, max_tokens=max_tokens,
                                                    ignore_eos=True)) for i in range(n)]
        return shared, independent

    shared, independent = both(prompts, args.seed, args.parallel_tokens)
    warm_shared, warm_independent = both([warm_prompt], args.seed + 777, 8)
    return shared, independent, warm_shared, warm_independent


def unshared_workload(args, SamplingParams):
    ns = types.SimpleNamespace(seed=args.seed + 3, min_prompt=16, max_prompt=256,
                               num_requests=args.overhead_requests + 8, output_median=args.overhead_output_median,
                               output_sigma=1.0, max_output=128)
    prompts, out_lens = tp.make_workload(ns)
    items = [(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, out_lens)]
    warm = [(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)) for p, _ in items[-8:]]
    return items[:-8], warm


def cache_host_seconds(llm, items) -> dict:
    """One more (untimed) run with the cache manager's hashing and lookups timed: the host work that
    caching adds to a run (allocation and eviction bookkeeping in the pool is not counted)."""
    timers = tp.PhaseTimers()
    kv = llm.engine.core.kv
    timers.wrap(kv, "find_cached_prefix", "find_cached_prefix")
    timers.wrap(kv, "cache_full_pages", "cache_full_pages")
    try:
        run = drive(llm, items)
    finally:
        timers.restore()
    cache_s = sum(timers.seconds.values())
    return dict(wall_s=run["wall_s"], cache_s=cache_s, share=cache_s / run["wall_s"],
                calls={k: timers.calls[k] for k in timers.calls},
                seconds={k: timers.seconds[k] for k in timers.seconds})


# ---- report -------------------------------------------------------------------------------------

def table(rows: list[dict], extra: list[tuple[str, str]]) -> list[str]:
    head = "| system | mean tok/s | best tok/s | timed runs (s) | " + " | ".join(h for h, _ in extra) + " |"
    lines = [head, "|" + "---|" * (4 + len(extra))]
    for r in rows:
        lines.append(f"| {r['name']} | {r['mean_tok_per_s']:.0f} | {r['best_tok_per_s']:.0f} | "
                     + ", ".join(f"{x:.2f}" for x in r["runs_s"]) + " | "
                     + " | ".join(fmt(r) for _, fmt in extra) + " |")
    return lines


def print_report(res: dict, out=print) -> None:
    out("")
    out(f"== shared KV pages ({res['elapsed_s']:.0f}s in all; load average before {res['load_before']}, "
        f"after {res['load_after']}) ==")
    a = res.get("prefix")
    if a:
        out("")
        out(f"(a) shared system prompt: {a['workload']}")
        out("\n".join(table([a["on"], a["off"]], [
            ("mean TTFT (s), mean / best", lambda r: f"{r['ttft_mean_s']:.2f} / {r['ttft_best_s']:.2f}"),
            ("prefix hits / queries", lambda r: f"{r['hits_runs'][0]} / {r['queries_runs'][0]}"),
            ("peak KV pages", lambda r: ", ".join(map(str, sorted(set(r["peak_pages_runs"])))))])))
        out(f"hit rate: {a['hits']} hit tokens / {a['ideal']} ideal = {100 * a['hit_rate']:.1f}% "
            f"(goal >= 95%: {'met' if a['hit_rate'] >= 0.95 else 'MISSED'})")
        out(f"throughput on / off: {a['ratio_mean']:.2f}x mean, {a['ratio_best']:.2f}x best, per round "
            + ", ".join(f"{x:.2f}x" for x in a["ratio_rounds"])
            + f" (goal >= 2x: {'met' if a['ratio_mean'] >= 2 else 'MISSED'}); mean TTFT off / on "
            f"{a['ttft_ratio_mean']:.1f}x; greedy tokens on == off for {a['same'][0]}/{a['same'][1]} requests")
    b = res.get("parallel")
    if b:
        out("")
        out(f"(b) n = {b['n']} sampling: {b['workload']}")
        out("\n".join(table([b["shared"], b["independent"]], [
            ("peak KV pages", lambda r: ", ".join(map(str, sorted(set(r["peak_pages_runs"]))))),
            ("samples running at the peak (most)", lambda r: f"{r['running_at_peak_runs'][0]} "
                                                             f"({r['max_running_runs'][0]})"),
            ("pages per running sample", lambda r: f"{r['pages_per_running_runs'][0]:.1f}")])))
        out(f"peak pages shared / independent: {b['shared_peak']} / {b['independent_peak']} = "
            f"{b['page_ratio']:.3f} (goal <= 0.25: {'met' if b['page_ratio'] <= 0.25 else 'MISSED'}); "
            f"throughput shared / independent {b['ratio_mean']:.2f}x mean, {b['ratio_best']:.2f}x best, per round "
            + ", ".join(f"{x:.2f}x" for x in b["ratio_rounds"])
            + f"; same tokens as independent seeded requests for {b['same'][0]}/{b['same'][1]} prompts")
        out(f"pages per running sample (summed over steps), shared / independent: {b['per_sample_ratio']:.3f}; "
            f"pages per sample at the peak: {b['shared_peak'] / max(b['shared']['running_at_peak_runs'][0], 1):.1f} / "
            f"{b['independent_peak'] / max(b['independent']['running_at_peak_runs'][0], 1):.1f}")
    c = res.get("overhead")
    if c:
        out("")
        out(f"(c) no shared prefixes: {c['workload']}")
        out("\n".join(table([c["on"], c["off"]], [
            ("prefix hits / queries", lambda r: f"{r['hits_runs'][0]} / {r['queries_runs'][0]}")])))
        out(f"throughput on / off: {c['ratio_mean']:.3f} mean, {c['ratio_best']:.3f} best, per round "
            + ", ".join(f"{x:.3f}" for x in c["ratio_rounds"])
            + f" (median {c['ratio_median']:.3f}); slowdown by mean {100 * (1 - c['ratio_mean']):.1f}%, by best "
            f"{100 * (1 - c['ratio_best']):.1f}% (goal < 2%)")
        h = c["host"]
        out(f"host time in the cache's hashing and lookups (instrumented run with caching on): {h['cache_s']:.3f}s "
            f"of {h['wall_s']:.2f}s = {100 * h['share']:.2f}% ({h['calls']}); greedy tokens on == off for "
            f"{c['same'][0]}/{c['same'][1]} requests")
    out("")
    out(f"command: {res['command']}")


# ---- main ---------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = tp.base_parser(__doc__, "small sizes for iteration (defaults in brackets below)")
    p.add_argument("--only", default="abc", help="which comparisons to run, e.g. 'a' or 'bc'")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per system in (a) and (b) [3, quick 2]")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=1152)
    p.add_argument("--prefix-len", type=int, default=1024, help="(a) shared prefix tokens")
    p.add_argument("--num-questions", type=int, default=None, help="(a) questions [256, quick 16]")
    p.add_argument("--min-question", type=int, default=8, help="(a) shortest question, tokens")
    p.add_argument("--max-question", type=int, default=40, help="(a) longest question, tokens")
    p.add_argument("--answer-tokens", type=int, default=32, help="(a) greedy tokens per answer")
    p.add_argument("--n", type=int, default=8, help="(b) samples per prompt")
    p.add_argument("--parallel-prompts", type=int, default=None, help="(b) prompts [64, quick 4]")
    p.add_argument("--parallel-prompt-len", type=int, default=512, help="(b) tokens per prompt")
    p.add_argument("--parallel-tokens", type=int, default=32, help="(b) tokens per sample")
    p.add_argument("--overhead-requests", type=int, default=None, help="(c) requests [128, quick 16]")
    p.add_argument("--overhead-output-median", type=float, default=32.0, help="(c) median output length")
    p.add_argument("--overhead-repeats", type=int, default=None,
                   help="(c) timed runs per system [6, quick 2]: it measures a small difference")
    p.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON here")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = dict(repeats=(3, 2), num_questions=(256, 16), parallel_prompts=(64, 4), overhead_requests=(128, 16),
                    overhead_repeats=(6, 2))
    for name, (full, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    if args.compilation_cache_dir is None:
        args.compilation_cache_dir = os.path.join(args.cache_dir, "xla-cache")
    if args.prefix_len + args.max_question + args.answer_tokens > args.max_model_len:
        p.error("--prefix-len + --max-question + --answer-tokens exceed --max-model-len")
    if args.parallel_prompt_len + args.parallel_tokens > args.max_model_len:
        p.error("--parallel-prompt-len + --parallel-tokens exceed --max-model-len")
    if args.repeats < 1 or args.overhead_repeats < 1 or args.num_questions < 2:
        p.error("--repeats and --overhead-repeats must be >= 1, --num-questions >= 2")
    return args


def round_ratios(x: dict, y: dict) -> list[float]:
    """Per round, x's throughput over y's (y's seconds / x's seconds)."""
    return [ry["wall_s"] / rx["wall_s"] for rx, ry in zip(x["runs"], y["runs"])]


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)

    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    os.makedirs(args.cache_dir, exist_ok=True)
    max_positions = max(tp.MODEL_SPEC["max_position_embeddings"], 1 << (args.max_model_len - 1).bit_length())
    folder = ensure_long_model(args.cache_dir, args.seed, max_positions, log)
    import jax

    from jaxserve.sampling_params import SamplingParams
    log(f"jax {jax.__version__} on {jax.devices()}; cpu_count {os.cpu_count()}; model {folder}")
    on = start_engine(args, folder, True, log)
    off = start_engine(args, folder, False, log)
    res = dict(command=command, args=vars(args), model_folder=folder, load_before=load_before)

    if "a" in args.only:
        items, warm = shared_prefix_workload(args, SamplingParams)
        qlens = [len(p) - args.prefix_len for p, _ in items]
        workload = (f"{len(items)} questions of {min(qlens)}-{max(qlens)} tokens (mean {np.mean(qlens):.1f}) after "
                    f"one {args.prefix_len}-token prefix, {args.answer_tokens} greedy tokens each")
        log(f"(a) {workload}")
        sys_on = dict(name="prefix caching on", llm=on, items=items, warmup_items=warm)
        sys_off = dict(name="prefix caching off", llm=off, items=items, warmup_items=warm)
        compare([sys_on, sys_off], args.repeats, log)
        s_on, s_off = summarise(sys_on), summarise(sys_off)
        ideal = (len(items) - 1) * (args.prefix_len // PAGE_SIZE) * PAGE_SIZE
        hits = sys_on["runs"][0]["hits"]
        res["prefix"] = dict(workload=workload, on=s_on, off=s_off, ideal=ideal, hits=hits, hit_rate=hits / ideal,
                             hit_rates_runs=[r["hits"] / ideal for r in sys_on["runs"]],
                             ratio_mean=s_on["mean_tok_per_s"] / s_off["mean_tok_per_s"],
                             ratio_best=s_on["best_tok_per_s"] / s_off["best_tok_per_s"],
                             ratio_rounds=round_ratios(sys_on, sys_off),
                             ttft_ratio_mean=s_off["ttft_mean_s"] / s_on["ttft_mean_s"],
                             same=same_tokens(sys_on, sys_off))

    if "b" in args.only:
        shared, independent, warm_shared, warm_independent = parallel_workload(args, SamplingParams, args.n)
        workload = (f"{len(shared)} prompts of {args.parallel_prompt_len} tokens, n = {args.n}, {args.parallel_tokens} "
                    f"tokens per sample (temperature 1, seeded, EOS ignored); max_num_seqs {args.max_num_seqs}")
        log(f"(b) {workload}")
        sys_shared = dict(name=f"shared (n={args.n} in one request, default engine)", llm=on, items=shared,
                          warmup_items=warm_shared)
        sys_indep = dict(name=f"independent ({args.n} requests, prefix caching off)", llm=off, items=independent,
                         warmup_items=warm_independent)
        compare([sys_shared, sys_indep], args.repeats, log)
        s_sh, s_in = summarise(sys_shared), summarise(sys_indep)
        ind_tokens = sys_indep["runs"][0]["tokens"]
        regrouped = [[t[0] for t in ind_tokens[i * args.n:(i + 1) * args.n]] for i in range(len(shared))]
        same = sum(a == b for a, b in zip(sys_shared["runs"][0]["tokens"], regrouped))
        shared_peak, independent_peak = max(s_sh["peak_pages_runs"]), max(s_in["peak_pages_runs"])
        res["parallel"] = dict(workload=workload, n=args.n, shared=s_sh, independent=s_in,
                               shared_peak=shared_peak, independent_peak=independent_peak,
                               page_ratio=shared_peak / independent_peak,
                               per_sample_ratio=s_sh["pages_per_running_runs"][0] / s_in["pages_per_running_runs"][0],
                               ratio_mean=s_sh["mean_tok_per_s"] / s_in["mean_tok_per_s"],
                               ratio_best=s_sh["best_tok_per_s"] / s_in["best_tok_per_s"],
                               ratio_rounds=round_ratios(sys_shared, sys_indep), same=(same, len(shared)))

    if "c" in args.only:
        items, warm = unshared_workload(args, SamplingParams)
        plens = [len(p) for p, _ in items]
        olens = [sp.max_tokens for _, sp in items]
        workload = (f"{len(items)} requests, random prompts of {min(plens)}-{max(plens)} tokens (mean "
                    f"{np.mean(plens):.1f}), greedy outputs of {min(olens)}-{max(olens)} tokens (mean "
                    f"{np.mean(olens):.1f}, sum {sum(olens)})")
        log(f"(c) {workload}")
        sys_on = dict(name="prefix caching on", llm=on, items=items, warmup_items=warm)
        sys_off = dict(name="prefix caching off", llm=off, items=items, warmup_items=warm)
        compare([sys_on, sys_off], args.overhead_repeats, log)
        s_on, s_off = summarise(sys_on), summarise(sys_off)
        rounds = round_ratios(sys_on, sys_off)
        host = cache_host_seconds(on, items)
        log(f"  instrumented run: {host['cache_s']:.3f}s of {host['wall_s']:.2f}s in the cache's hashing and lookups")
        res["overhead"] = dict(workload=workload, on=s_on, off=s_off,
                               ratio_mean=s_on["mean_tok_per_s"] / s_off["mean_tok_per_s"],
                               ratio_best=s_on["best_tok_per_s"] / s_off["best_tok_per_s"],
                               ratio_rounds=rounds, ratio_median=float(np.median(rounds)), host=host,
                               same=same_tokens(sys_on, sys_off))

    res["load_after"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    res["elapsed_s"] = time.perf_counter() - start
    print_report(res)
    log("done")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        import json
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return res


if __name__ == "__main__":
    main()
