"""The draft model's prefix cache: one engine with it on and off, side by side.

    python benchmarks/draft_prefix_cache.py --repeats 5
    python benchmarks/draft_prefix_cache.py --repeats 5 --prefix-chars 2400 --max-model-len 1024

The bundled model with configs/tiny-cpu.yaml (a 256-token step budget, pages of 16) and a draft made of its first
layer (`bench.models.early_exit_copy`: its embeddings, first layer, final norm and head), 4 proposals per step.
Two workloads, greedy unless said:
- shared prefix: --requests prompts of one --prefix-chars piece of jaxserve's source (the same for all, a system
  prompt) followed by a --tail-chars piece of their own, --output-len tokens each;
- parallel sampling: --requests // 4 prompts of --prefix-chars + --tail-chars characters of their own, n = 4,
  temperature 0.8, top_k 20, a seed.

The engine's own (target) prefix cache is on in both settings, so the target's prefill is the same; only the
draft's cache switches (`draft.kv.enable_prefix_caching`). Each round runs every (workload, setting) pair once,
the settings in alternating order, after `reset_prefix_cache` (the target's and the draft's), one warm-up pair
first. Reported per workload and setting: wall seconds (mean, best), engine steps, tokens the draft computed to
catch up and tokens it took from its cache (per run), the proposer's milliseconds per step (the step timing's
"propose" phase: the draft's device call included), verifications (rows that verified proposals: a request gets
none until the draft has caught up with its prompt), the mean acceptance length, and whether the tokens equal the
other setting's (seeded sampling gives the same tokens whatever is proposed).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

import jaxserve
from jaxserve import LLM, SamplingParams
from jaxserve.bench.models import early_exit_copy
from jaxserve.engine.llm_engine import ASSETS_DIR, DEFAULT_MODEL_NAME


def source_text() -> str:
    """jaxserve's Python source, in a fixed order (the same prompts for a given commit)."""
    package = os.path.dirname(jaxserve.__file__)
    return "".join(open(path).read() for path in sorted(glob.glob(os.path.join(package, "**", "*.py"),
                                                                  recursive=True)))


def workloads(llm: LLM, args: argparse.Namespace) -> dict[str, tuple[list[list[int]], SamplingParams]]:
    """The two workloads: name -> (prompts as token ids, sampling params)."""
    tokenizer = llm.get_tokenizer()
    text = source_text()

    def piece(index: int, chars: int) -> list[int]:
        start = (index * 997 * chars) % (len(text) - chars)
        return tokenizer.encode(text[start : start + chars], add_special_tokens=False)

    prefix = piece(0, args.prefix_chars)
    shared = [prefix + piece(i + 1, args.tail_chars) for i in range(args.requests)]
    separate = [piece(i + 100, args.prefix_chars + args.tail_chars) for i in range(args.requests // 4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    sampled = SamplingParams(n=4, temperature=0.8, top_k=20, seed=1, max_tokens=args.output_len, ignore_eos=True)
    return {"shared prefix": (shared, greedy), "parallel sampling (n = 4)": (separate, sampled)}


def run_once(llm: LLM, prompts: list[list[int]], params: SamplingParams, draft_cache: bool) -> dict:
    """One run with the draft's prefix cache on or off: seconds, counters' increase, tokens."""
    core = llm.engine.core
    core.draft.kv.enable_prefix_caching = draft_cache
    llm.reset_prefix_cache()
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.stats()
    moved = {key: after[key] - before[key] for key in ("steps", "draft_fed_tokens", "draft_prefix_cache_hits")}
    spec = {key: after["spec_decode"][key] - before["spec_decode"][key]
            for key in ("num_drafts", "num_accepted_tokens")}
    timing = after["timing"]
    propose_ms = timing["propose_ms"] * timing["steps"] - before["timing"]["propose_ms"] * before["timing"]["steps"]
    return {"seconds": seconds, **moved, "propose_ms_per_step": propose_ms / max(moved["steps"], 1),
            "verifications": spec["num_drafts"],
            "acceptance_length": (spec["num_accepted_tokens"] + spec["num_drafts"]) / max(spec["num_drafts"], 1),
            "tokens": [[tuple(c.token_ids) for c in o.outputs] for o in outputs]}


def main() -> int:
    """Build the engine, run the rounds, print the markdown table (and --json)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default %(default)s)")
    parser.add_argument("--requests", type=int, default=16, help="prompts of the shared-prefix workload")
    parser.add_argument("--prefix-chars", type=int, default=900, help="characters of the shared piece")
    parser.add_argument("--tail-chars", type=int, default=100, help="characters of each prompt's own piece")
    parser.add_argument("--output-len", type=int, default=48, help="tokens generated per sample")
    parser.add_argument("--draft-layers", type=int, default=1, help="layers of the early-exit draft")
    parser.add_argument("--max-model-len", type=int, default=512,
                        help="the engine's (default: tiny-cpu's %(default)s; the bundled model takes up to 1024)")
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "jaxserve-bench-models"))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    draft = early_exit_copy(os.path.join(ASSETS_DIR, DEFAULT_MODEL_NAME), args.draft_layers, args.cache_dir)
    speculative = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4}
    llm = LLM(speculative_config=speculative, max_model_len=args.max_model_len, show_progress=False)
    loads = workloads(llm, args)
    for prompts, params in loads.values():  # warm-up: every bucket these runs meet
        for draft_cache in (True, False):
            run_once(llm, prompts[:4], params, draft_cache)
    runs: dict[tuple[str, bool], list[dict]] = {(name, on): [] for name in loads for on in (True, False)}
    for round_index in range(args.repeats):
        for name, (prompts, params) in loads.items():
            for on in (True, False)[:: -1 if round_index % 2 else 1]:
                runs[name, on].append(run_once(llm, prompts, params, on))
                print(f"  round {round_index}: {name}, draft cache {'on' if on else 'off'}: "
                      f"{runs[name, on][-1]['seconds']:.2f} s", file=sys.stderr, flush=True)
    print(table(loads, runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{name} / {'on' if on else 'off'}": [{k: v for k, v in r.items() if k != "tokens"}
                                                            for r in rs] for (name, on), rs in runs.items()}, f,
                      indent=1)
    return 0


def table(loads: dict, runs: dict[tuple[str, bool], list[dict]]) -> str:
    """The markdown table: one row per (workload, setting), and the on/off ratio of wall seconds."""
    lines = ["| workload | draft prefix cache | prompt tokens x samples | wall s mean (best) | on / off mean (best) "
             "| steps | draft computed | draft cache hits | propose ms / step | verifications | acceptance length "
             "| same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, (prompts, params) in loads.items():
        off = runs[name, False]
        for on in (True, False):
            rs = runs[name, on]
            seconds = [r["seconds"] for r in rs]
            ratio = "-"
            if on:
                off_seconds = [r["seconds"] for r in off]
                ratio = f"{statistics.mean(seconds) / statistics.mean(off_seconds):.2f}x " \
                        f"({min(seconds) / min(off_seconds):.2f}x)"
            same = all(r["tokens"] == o["tokens"] for r, o in zip(rs, off))
            cells = [name, "on" if on else "off", f"{sum(map(len, prompts)) * params.n:,}",
                     f"{statistics.mean(seconds):.2f} ({min(seconds):.2f})", ratio,
                     f"{statistics.mean(r['steps'] for r in rs):.0f}",
                     f"{statistics.mean(r['draft_fed_tokens'] for r in rs):,.0f}",
                     f"{statistics.mean(r['draft_prefix_cache_hits'] for r in rs):,.0f}",
                     f"{statistics.mean(r['propose_ms_per_step'] for r in rs):.1f}",
                     f"{statistics.mean(r['verifications'] for r in rs):.0f}",
                     f"{statistics.mean(r['acceptance_length'] for r in rs):.2f}", "yes" if same else "no"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
