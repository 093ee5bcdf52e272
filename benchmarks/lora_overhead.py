"""What serving LoRA adapters costs: the same workload on an engine without LoRA and on one with two adapter slots.

    python benchmarks/lora_overhead.py --repeats 5

The bundled model with configs/tiny-cpu.yaml, --requests prompts of --prompt-len tokens (pieces of jaxserve's
source), --output-len greedy tokens each (EOS ignored). Settings, each a whole `LLM.generate` of the workload:
- `no LoRA`: an engine with enable_lora off;
- `LoRA engine, base requests`: an engine with enable_lora (max_loras 2, max_lora_rank 8), every request on the
  base model (the slots' masked work is done all the same);
- `LoRA engine, mixed`: the same engine, the requests a third each on the base model, tests/fixtures/lora/alpha
  (rank 8, every projection) and beta (rank 4, two projections of two layers);
- `LoRA engine, all alpha`: every request on alpha.
Both engines live in the process from the start; one warm-up round, then --repeats rounds, each running every
setting once in an order that alternates between rounds. Reported: wall seconds (mean, best), output tokens per
second of the mean, and each setting's mean and best against `no LoRA`'s.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import time

import jaxserve
from jaxserve import LLM, LoRARequest, SamplingParams

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "lora")
ALPHA = LoRARequest("alpha", 1, os.path.join(FIXTURES, "alpha"))
BETA = LoRARequest("beta", 2, os.path.join(FIXTURES, "beta"))


def prompts(llm: LLM, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` token ids: pieces of jaxserve's source."""
    package = os.path.dirname(jaxserve.__file__)
    text = "".join(open(path).read() for path in sorted(glob.glob(os.path.join(package, "**", "*.py"),
                                                                  recursive=True)))
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    return [ids[i * 7919 % (len(ids) - length):][:length] for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    plain = LLM(None, show_progress=False)
    lora = LLM(None, show_progress=False, enable_lora=True, max_loras=2, max_lora_rank=8,
               lora_modules={"alpha": ALPHA.lora_path, "beta": BETA.lora_path})
    work = prompts(plain, args.requests, args.prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    mixed = [(None, ALPHA, BETA)[i % 3] for i in range(args.requests)]
    settings = {
        "no LoRA": lambda: plain.generate(work, params, use_tqdm=False),
        "LoRA engine, base requests": lambda: lora.generate(work, params, use_tqdm=False),
        "LoRA engine, mixed": lambda: lora.generate(work, params, use_tqdm=False, lora_request=mixed),
        "LoRA engine, all alpha": lambda: lora.generate(work, params, use_tqdm=False, lora_request=ALPHA),
    }
    times: dict[str, list[float]] = {name: [] for name in settings}
    order = list(settings)
    for round_index in range(args.repeats + 1):
        for name in order if round_index % 2 else order[::-1]:
            started = time.perf_counter()
            outputs = settings[name]()
            elapsed = time.perf_counter() - started
            assert all(len(output.outputs[0].token_ids) == args.output_len for output in outputs)
            if round_index:  # round 0 warms up
                times[name].append(elapsed)
    tokens = args.requests * args.output_len
    base_mean, base_best = statistics.mean(times["no LoRA"]), min(times["no LoRA"])
    print(f"{args.requests} requests x {args.prompt_len} prompt + {args.output_len} output tokens, "
          f"{args.repeats} rounds")
    print("| setting | wall s mean (best) | output tok/s (mean) | time vs no LoRA, mean (best) |")
    print("|---|---|---:|---|")
    for name, runs in times.items():
        mean, best = statistics.mean(runs), min(runs)
        print(f"| {name} | {mean:.2f} ({best:.2f}) | {tokens / mean:.0f} | {mean / base_mean:.2f}x "
              f"({best / base_best:.2f}x) |")


if __name__ == "__main__":
    main()
