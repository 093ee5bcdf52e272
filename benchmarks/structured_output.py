"""Throughput with half the requests constrained to a JSON schema against none constrained, side by side on one
engine, and the host time the constraints cost per step.

    python benchmarks/structured_output.py
    python benchmarks/structured_output.py --num-requests 64 --output-len 128 --repeats 3

One engine on the bundled model (structured output on, as served); two systems run the same random-token prompts
with `bench effects`' protocol (jaxserve/bench/harness.py: each system's warm-up, then rounds alternating the
order): "none" greedy and unconstrained, "half" with every other request constrained to an array of records whose
`minItems` no request reaches, so every request generates exactly --output-len tokens on both sides. Reports
output tokens/s (mean and best) and half / none, the engine's host phases per step (build: the batch and the
sampling arrays, masks included; update: the samples, the matchers' advance included), and the grammar engine's
own time per step: filling the masks (`Matcher.fill`) and advancing the matchers (`Matcher.accept`), timed on one
more run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from jaxserve.bench.effects import timed_methods
from jaxserve.bench.harness import System, compare, ratios, run_once, timing
from jaxserve.bench.workloads import BenchRequest, random_workload, vocab_ids
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured.grammar import Matcher

RECORDS = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "tags", "score"],
    "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12},
                   "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                   "score": {"type": "number", "minimum": 0, "maximum": 1}}}}


def constrained_every_other(workload) -> Callable[[BenchRequest], SamplingParams]:
    """Sampling parameters that constrain every other request of `workload` (greedy, exact lengths)."""
    constrained = {request.prompt_token_ids for request in workload.requests[::2]}

    def params(request: BenchRequest) -> SamplingParams:
        structured = {"json": RECORDS} if request.prompt_token_ids in constrained else None
        return SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True,
                              structured_outputs=structured)
    return params


def per_step(runs, phase: str) -> float:
    """Mean ms of an engine host phase per step over `runs` (each run's mean weighted by its steps)."""
    steps = sum(run.timing["steps"] for run in runs)
    return sum(run.timing[f"{phase}_ms"] * run.timing["steps"] for run in runs) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig.for_model(None, max_model_len=512, max_num_seqs=args.max_num_seqs,
                                              max_num_batched_tokens=256), show_progress=False)
    workload = random_workload(args.num_requests, vocab_ids(engine.tokenizer), "uniform", 64, 16, 128, "fixed",
                               args.output_len, args.output_len, args.output_len, seed=0)
    warmup = random_workload(8, vocab_ids(engine.tokenizer), "uniform", 64, 16, 128, "fixed", 16, 16, 16, seed=1)
    half = constrained_every_other(workload)
    systems = [System("none", engine, workload, warmup),
               System("half", engine, workload, warmup, params=half)]
    runs = compare(systems, args.repeats, print)
    sides = [timing(side) for side in runs]
    ratio = ratios(sides[1], sides[0], runs[1], runs[0])
    with timed_methods(Matcher, ("fill", "accept")) as matcher:
        extra = run_once(engine, workload, half)
    steps = len(extra.result.steps)
    print(f"\n{args.num_requests} requests, prompts 16-128 random tokens, {args.output_len} output tokens each, "
          f"max_num_seqs {args.max_num_seqs}, {args.repeats} timed rounds\n")
    print("| constrained | output tok/s mean | best | build ms / step | update ms / step |")
    print("|---|---|---|---|---|")
    for system, side, side_runs in zip(systems, sides, runs):
        print(f"| {system.name} | {side['output_tokens_per_s']:.0f} | {side['best_output_tokens_per_s']:.0f} | "
              f"{per_step(side_runs, 'build'):.2f} | {per_step(side_runs, 'update'):.2f} |")
    print(f"\nhalf / none: {ratio['mean']:.3f} mean, {ratio['best']:.3f} best, per round "
          f"{', '.join(f'{r:.3f}' for r in ratio['rounds'])}")
    print(f"grammar engine per step (one more run of 'half', {steps} steps): masks "
          f"{1000 * matcher['fill']['seconds'] / steps:.2f} ms, matcher advance "
          f"{1000 * matcher['accept']['seconds'] / steps:.2f} ms, of a {1000 * extra.result.seconds / steps:.2f}"
          f" ms step")


if __name__ == "__main__":
    main()
