"""The speculation experiment of `jaxserve bench effects`: speculative decoding off, with n-gram prompt lookup,
and with a draft model.

A repetitive workload, where the answer is in the prompt (code editing): each prompt is a piece of
jaxserve's own Python source (--spec-prompt-chars characters, so the workload is the same for a given
commit) followed by "# the same code again:" and the piece's first third; greedy, --spec-output-len
tokens. At each batch size of --spec-batch-sizes (that many requests at once), the engine without
speculation, the one with `{method: ngram}` (--spec-tokens proposals, prompt lookup 2-4) and the one with
`{method: draft_model}` (--spec-tokens proposals; the draft is --spec-draft-model, or else the target's
first --spec-draft-layers layers with its embeddings, final norm and head: an early-exit copy written next
to the model cache) run the same requests alike: output tokens/s (mean, best), engine steps, the
proposer's milliseconds per step, inter-token latency (p50, p99), TPOT, the mean acceptance length (tokens
emitted per verification) and whether the greedy tokens agree with the engine without speculation. Meant
for a model that can copy (the bundled one, trained on Python); a random-weight model accepts little.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections.abc import Callable, Sequence

import jaxserve
from jaxserve.bench import models
from jaxserve.bench.harness import Engines, Run, System, cell, compare, ms, ratios, same_tokens, spread, timing
from jaxserve.bench.workloads import BenchRequest, Workload
from jaxserve.tokenizer import load_tokenizer

MARKER = "\n# the same code again:\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The experiment's options."""
    group = parser.add_argument_group("speculation")
    group.add_argument("--spec-batch-sizes", type=int, nargs="+", default=[1, 8, 64],
                       help="requests at once (default: 1 8 64)")
    group.add_argument("--spec-tokens", type=int, default=4, help="num_speculative_tokens (default %(default)s)")
    group.add_argument("--spec-prompt-chars", type=int, default=900,
                       help="characters of source per prompt (default %(default)s)")
    group.add_argument("--spec-output-len", type=int, default=128, help="output tokens (default %(default)s)")
    group.add_argument("--spec-draft-model", metavar="PATH",
                       help="the draft model's folder (default: the target's first --spec-draft-layers layers)")
    group.add_argument("--spec-draft-layers", type=int, default=1,
                       help="layers of the early-exit draft made from the target (default %(default)s)")


def code_editing_workload(model: str, num_requests: int, prompt_chars: int, output_len: int) -> Workload:
    """`num_requests` prompts, each a piece of jaxserve's source, the marker and the piece's first third."""
    tokenizer = load_tokenizer(model)
    package = os.path.dirname(jaxserve.__file__)
    text = "".join(open(path).read() for path in sorted(glob.glob(os.path.join(package, "**", "*.py"),
                                                                      recursive=True)))
    requests = []
    for index in range(num_requests):
        start = (index * prompt_chars) % max(1, len(text) - prompt_chars)
        piece = text[start : start + prompt_chars]
        prompt = piece + MARKER + piece[: len(piece) // 3]
        requests.append(BenchRequest(tuple(tokenizer.encode(prompt, add_special_tokens=False)), output_len, prompt))
    mean = sum(len(r.prompt_token_ids) for r in requests) / num_requests
    return Workload("code-editing", tuple(requests),
                    f"{num_requests} code-editing prompts (a {prompt_chars}-character piece of jaxserve's source, "
                    f"then its first third again; {mean:.0f} tokens on average), {output_len} output tokens, greedy")


def speculation(args: argparse.Namespace, engines: Engines, ids: Sequence[int], log: Callable[[str], None]) -> dict:
    """Speculation off, n-gram and draft model at each batch size (see the module docstring)."""
    model = engines.base["model"]
    draft = args.spec_draft_model or models.early_exit_copy(model, args.spec_draft_layers, args.cache_dir, log)
    speculative = {f"ngram, {args.spec_tokens} tokens": {"method": "ngram", "num_speculative_tokens": args.spec_tokens,
                                                         "prompt_lookup_min": 2, "prompt_lookup_max": 4},
                   f"draft {os.path.basename(draft)}, {args.spec_tokens} tokens": {
                       "method": "draft_model", "model": draft, "num_speculative_tokens": args.spec_tokens}}
    sides_engines = [("off", engines.get())] + [(name, engines.get(speculative_config=json.dumps(config)))
                                                for name, config in speculative.items()]
    results = []
    for batch in args.spec_batch_sizes:
        workload = code_editing_workload(model, batch, args.spec_prompt_chars, args.spec_output_len)
        warmup = code_editing_workload(model, min(batch, 4), args.spec_prompt_chars, 8)
        log(f"speculation: {workload.description}")
        systems = [System(name, engine, workload, warmup) for name, engine in sides_engines]
        before = [engine.stats()["spec_decode"] for _, engine in sides_engines]
        runs = compare(systems, args.repeats, log)
        after = [engine.stats()["spec_decode"] for _, engine in sides_engines]
        sides = [speculation_side(system, system_runs) for system, system_runs in zip(systems, runs)]
        for side, system_runs, old, new in zip(sides[1:], runs[1:], before[1:], after[1:]):
            drafts = new["num_drafts"] - old["num_drafts"]
            side["on_over_off"] = ratios(side, sides[0], system_runs, runs[0])
            side["mean_acceptance_length"] = (new["num_accepted_tokens"] - old["num_accepted_tokens"] + drafts) / max(
                drafts, 1)
            side["same_tokens"] = same_tokens(system_runs[0].result.output_token_ids,
                                              runs[0][0].result.output_token_ids)
        results.append({"batch": batch, "workload": workload.description, "systems": sides})
    return {"draft_model": draft, "batches": results}


def speculation_side(system: System, runs: list[Run]) -> dict:
    """One system at one batch size: throughput, engine steps and the proposer's ms per step (mean over runs),
    and ITL and TPOT over all its runs (ms)."""
    traces = [trace for run in runs for trace in run.result.traces]
    return {"system": system.name, **timing(runs),
            "steps": sum(run.timing["steps"] for run in runs) / len(runs),
            "propose_ms": sum(run.timing["propose_ms"] for run in runs) / len(runs),
            "itl_ms": spread(ms([itl for trace in traces for itl in trace.itls])),
            "tpot_ms": spread(ms([trace.tpot for trace in traces if trace.tpot is not None]))}


def speculation_lines(result: dict) -> list[str]:
    """The speculation report: one table row per (batch size, system)."""
    lines = ["### Speculative decoding on a code-editing workload", "",
             f"Draft model: `{result['draft_model']}`.", "",
             "| batch | system | mean tok/s | best tok/s | timed runs (s) | engine steps | propose ms/step "
             "| ITL p50 / p99 (ms) | TPOT mean (ms) | on / off (mean, best) | acceptance length "
             "| greedy tokens equal |",
             "|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for entry in result["batches"]:
        for side in entry["systems"]:
            extra = "| |"
            if "on_over_off" in side:
                ratio = side["on_over_off"]
                extra = (f"{ratio['mean']:.2f}x, {ratio['best']:.2f}x | {side['mean_acceptance_length']:.2f} | "
                         f"{side['same_tokens'][0]}/{side['same_tokens'][1]}")
            lines.append(f"| {entry['batch']} | {side['system']} | {side['output_tokens_per_s']:.0f} | "
                         f"{side['best_output_tokens_per_s']:.0f} | {', '.join(f'{s:.2f}' for s in side['runs_s'])} | "
                         f"{side['steps']:.0f} | {side['propose_ms']:.2f} | "
                         f"{cell(side['itl_ms']['p50'])} / {cell(side['itl_ms']['p99'])} | "
                         f"{cell(side['tpot_ms']['mean'])} | {extra} |")
    return lines
