"""The output processor alone: its time per engine step at R rows, after L tokens of output, for each output kind.

    python -m benchmarks.output_processing                                   # 512 rows, after 0 and 1500 tokens
    python -m benchmarks.output_processing --rows 256 --after 0 800 --kinds final_only --json out.json

`OutputProcessor.process` (engine/output_processor.py: the incremental detokenizer, stop strings, the
RequestOutputs) on R one-sample requests of the bundled model's tokenizer, each given one token a step as the engine
would (tokens of Python standard library source, host_step.py's corpus, so the detokenizer sees text), temperature
0.8 / top_p 0.95, no stop strings, under the engine's garbage-collector threshold (engine/host_gc.py). For each
(kind, L): the requests are run to L output tokens untimed, then `--steps` steps are timed; the run is repeated
`--repeats` times and the best run's mean is reported, in ms per step (the processor is pure Python: the best run is
the one the machine disturbed least). What `benchmarks/host_step.py` shows inside a whole engine step, without the
rest of the step's noise.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

from benchmarks.host_step import corpus_token_ids
from jaxserve.bench.results import write_json
from jaxserve.engine.host_gc import tune_garbage_collector
from jaxserve.engine.llm_engine import default_model_path
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.request import Request
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.tokenizer import load_tokenizer

PROMPT_LEN = 100


def time_steps(tokenizer, ids: list[int], rows: int, kind: RequestOutputKind, after: int, steps: int) -> float:
    """Mean ms per `process` call over `steps` steps of `rows` requests that have `after` output tokens already."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=after + steps, output_kind=kind)
    processor, requests = OutputProcessor(tokenizer), []
    for row in range(rows):
        request = Request(f"sample-{row}", ids[row : row + PROMPT_LEN], params, eos_token_ids=(), seed=row,
                          max_tokens=after + steps)
        processor.add_request(f"request-{row}", None, [request])
        requests.append(request)
    seconds = 0.0
    for step in range(after + steps):
        for row, request in enumerate(requests):
            request.output_token_ids.append(ids[(row * 7 + step) % len(ids)])
        started = time.perf_counter()
        outputs = processor.process(requests)
        if step >= after:
            seconds += time.perf_counter() - started
        del outputs
    return 1e3 * seconds / steps


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; prints one line per (kind, after) and returns them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--after", type=int, nargs="+", default=[0, 1500], help="output tokens before the timed steps")
    parser.add_argument("--kinds", nargs="+", default=[kind.name.lower() for kind in RequestOutputKind],
                        choices=[kind.name.lower() for kind in RequestOutputKind])
    parser.add_argument("--steps", type=int, default=60, help="timed steps")
    parser.add_argument("--repeats", type=int, default=5, help="runs per measurement; the best is reported")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    args = parser.parse_args(argv)
    tune_garbage_collector()
    tokenizer = load_tokenizer(default_model_path())
    ids = corpus_token_ids(tokenizer, 20_000).tolist()
    results = []
    for kind in args.kinds:
        for after in args.after:
            runs = [time_steps(tokenizer, ids, args.rows, RequestOutputKind[kind.upper()], after, args.steps)
                    for _ in range(args.repeats)]
            gc.collect()
            results.append({"kind": kind, "rows": args.rows, "after": after, "best_ms": min(runs), "runs_ms": runs})
            print(f"{kind:>10} rows {args.rows} after {after:>5} tokens: {min(runs):.3f} ms per step (best of "
                  f"{args.repeats}: {', '.join(f'{run:.2f}' for run in runs)})", flush=True)
    if args.json:
        write_json(args.json, results)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
