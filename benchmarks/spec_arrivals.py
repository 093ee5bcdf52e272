"""Speculative decoding while requests keep arriving: this tree against a git revision, side by side.

    python benchmarks/spec_arrivals.py --baseline 68a272a --repeats 3

The bundled model with configs/tiny-cpu.yaml (a 256-token step budget), without speculation and with n-gram
prompt lookup (4 tokens, n from 2 to 4), on `jaxserve bench effects`' code-editing prompts (the answer is in
the prompt; --prompt-chars characters of jaxserve's source and its first third again: ~320 tokens for 600, so
each prompt takes two steps of prefill and fits the config's max_model_len of 512 with its output), greedy, 64
output tokens each. Request i arrives before engine step i x --every (step
counted, not timed, so both trees see the same arrivals; an idle engine takes the next request at once): new
prompts keep landing in steps where others decode, which is where a step that verifies only when every row
decodes (the baseline, before 29825cb) loses its speculation.

Each round runs each tree in a fresh process (`git worktree` for the baseline), trees alternating from round to
round, so a slow spell of a shared machine hits both; a process builds both engines (from the persistent
compilation cache after the first round), warms each up once and times one run of each, off and ngram in the
round's order. Reported per
tree and system: engine steps and verifications (rows that verified proposals) per run, the mean acceptance
length, wall seconds (mean and best), TPOT (mean over requests of (last token - first token) / (tokens - 1)),
and whether the greedy tokens equal the same tree's engine without speculation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def run_workload(engine, prompts: list[list[int]], params, every: int) -> dict:
    """Drive `engine` through `prompts` arriving one per `every` steps; steps, seconds, TPOT and tokens."""
    before = engine.stats()["spec_decode"]
    arrived, steps, tokens, first, last = 0, 0, {}, {}, {}
    start = time.perf_counter()
    while arrived < len(prompts) or engine.has_unfinished_requests():
        while arrived < len(prompts) and (arrived * every <= steps or not engine.has_unfinished_requests()):
            engine.add_request(str(arrived), prompts[arrived], params)
            arrived += 1
        outputs = engine.step()
        steps += 1
        now = time.perf_counter()
        for output in outputs:
            tokens[output.request_id] = list(output.outputs[0].token_ids)
            first.setdefault(output.request_id, now)
            last[output.request_id] = now
    seconds = time.perf_counter() - start
    after = engine.stats()["spec_decode"]
    drafts = after["num_drafts"] - before["num_drafts"]
    tpots = [(last[i] - first[i]) / (len(tokens[i]) - 1) for i in tokens if len(tokens[i]) > 1]
    return {"steps": steps, "seconds": seconds, "tpot_ms": 1e3 * statistics.mean(tpots), "verifications": drafts,
            "accepted": after["num_accepted_tokens"] - before["num_accepted_tokens"],
            "tokens": [tokens[str(i)] for i in range(len(prompts))]}


def measure(args: argparse.Namespace) -> dict:
    """This process's tree: both engines, a warm-up each, then the timed rounds."""
    from jaxserve.bench.speculation import code_editing_workload
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.sampling_params import SamplingParams

    engines = {"off": LLMEngine(EngineConfig.for_model(None), show_progress=False),
               "ngram": LLMEngine(EngineConfig.for_model(None, speculative_config=SPECULATIVE), show_progress=False)}
    model = engines["off"].model_path
    workload = code_editing_workload(model, args.requests, args.prompt_chars, args.output_len)
    prompts = [list(r.prompt_token_ids) for r in workload.requests]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for engine in engines.values():
        run_workload(engine, prompts[:4], params, args.every)
    runs = {}
    for name in list(engines)[:: -1 if args.reverse else 1]:
        runs[name] = run_workload(engines[name], prompts, params, args.every)
        print(f"  {name}: {runs[name]['seconds']:.2f} s, {runs[name]['steps']} steps", file=sys.stderr, flush=True)
    return runs


def run_tree(tree: str, args: argparse.Namespace, reverse: bool) -> dict:
    """`measure` in a fresh process running the code of `tree`: {system: one run}."""
    env = {**os.environ, "PYTHONPATH": tree, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    command = [sys.executable, os.path.abspath(__file__), "--measure", "--requests", str(args.requests),
               "--every", str(args.every), "--output-len", str(args.output_len),
               "--prompt-chars", str(args.prompt_chars)] + (["--reverse"] if reverse else [])
    done = subprocess.run(command, cwd=tree, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict[str, dict], baseline: str) -> list[str]:
    """One markdown row per (tree, system)."""
    lines = ["| tree | system | engine steps | verifications | acceptance length | wall s mean (best) | tok/s mean "
             "| TPOT ms mean | tokens equal to off |", "|---|---|---:|---:|---:|---|---:|---:|---|"]
    for tree, runs in results.items():
        label = f"baseline ({baseline})" if tree == "baseline" else "current (working tree)"
        for name, system_runs in runs.items():
            seconds = [run["seconds"] for run in system_runs]
            output_tokens = sum(len(t) for t in system_runs[0]["tokens"])
            verifications = statistics.mean(run["verifications"] for run in system_runs)
            accepted = statistics.mean(run["accepted"] for run in system_runs)
            acceptance = f"{(accepted + verifications) / verifications:.2f}" if verifications else "-"
            equal = sum(a == b for a, b in zip(system_runs[0]["tokens"], runs["off"][0]["tokens"]))
            lines.append(f"| {label} | {name} | {statistics.mean(r['steps'] for r in system_runs):.0f} "
                         f"| {verifications:.0f} | {acceptance} | {statistics.mean(seconds):.2f} ({min(seconds):.2f}) "
                         f"| {output_tokens / statistics.mean(seconds):.0f} "
                         f"| {statistics.mean(r['tpot_ms'] for r in system_runs):.1f} "
                         f"| {equal}/{len(system_runs[0]['tokens'])} |")
    return lines


def main() -> None:
    """Run the baseline's tree, then this one, and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git revision to compare with (e.g. 68a272a)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--every", type=int, default=4, help="engine steps between arrivals (default %(default)s)")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompt-chars", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--reverse", action="store_true", help=argparse.SUPPRESS)  # its systems' order
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args)))
        return
    if not args.baseline:
        parser.error("--baseline is required")
    current = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = {"baseline": {"off": [], "ngram": []}, "current": {"off": [], "ngram": []}}
    with tempfile.TemporaryDirectory() as scratch:
        baseline = os.path.join(scratch, "baseline")
        subprocess.run(["git", "worktree", "add", "--detach", baseline, args.baseline], cwd=current, check=True,
                       capture_output=True)
        try:
            for round_index in range(args.repeats):
                trees = [("baseline", baseline), ("current", current)][:: -1 if round_index % 2 else 1]
                for name, tree in trees:
                    print(f"round {round_index + 1}: {name}", file=sys.stderr, flush=True)
                    for system, run in run_tree(tree, args, reverse=bool(round_index % 2)).items():
                        results[name][system].append(run)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", baseline], cwd=current, check=True)
    print("\n".join(table(results, args.baseline)))


if __name__ == "__main__":
    main()
