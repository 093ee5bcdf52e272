"""What one step program costs to lower and compile on this machine: the bundled model's buckets and the sampler's
parts, each compiled once, in this process (persistent compilation cache off).

    python -m benchmarks.program_compile
    XLA_FLAGS=--xla_backend_optimization_level=0 python -m benchmarks.program_compile   # the test suite's level

Prints seconds for tracing and lowering, then XLA's compile, per program: the smallest and largest forward buckets,
sampler buckets (no aux tokens at the smallest and largest rows; the most aux tokens with the structured-output
bitmask), a prompt-logprob bucket, and the sampler's parts alone at 8 rows of the bundled model's vocabulary. Then
what the flags cost at run time: 16 prompts x 64 greedy tokens in one 64-token bucket, after one warm-up run,
3 timed runs (mean and best).
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.batch.builder import padded_sampling_arrays
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling import sampler


def timed(label: str, function, args: tuple) -> None:
    """Lower and compile `function(*args)` once; print both times."""
    start = time.perf_counter()
    lowered = function.lower(*args)
    middle = time.perf_counter()
    lowered.compile()
    print(f"| {label} | {middle - start:.3f} | {time.perf_counter() - middle:.3f} |", flush=True)


def main() -> None:
    """Time the bundled model's programs, then the sampler's parts."""
    engine = LLMEngine(EngineConfig.for_model(None, compilation_cache_dir=None, skip_precompile=True),
                       show_progress=False)
    runner = engine.core.runner
    ladders, rows = runner.ladders, max(runner.ladders.row_buckets())
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, vocabulary {runner.spec.vocab_size}")
    print("| program | trace + lower s | compile s |\n|---|---|---|")
    programs = [
        (f"forward T={ladders.tokens[0]} W={ladders.page_widths[0]}",
         runner.forward_call(ladders.tokens[0], ladders.page_widths[0])),
        (f"forward T={ladders.tokens[-1]} W={ladders.page_widths[-1]}",
         runner.forward_call(ladders.tokens[-1], ladders.page_widths[-1])),
        *((f"sampler R={r}", runner.sampler_call(r, 0, 0)) for r in sorted({min(ladders.row_buckets()), rows})),
        (f"sampler R={rows} P={ladders.aux_widths[-1]} bitmask",
         runner.sampler_call(rows, ladders.aux_widths[-1], runner.mask_widths[-1])),
        (f"prompt logprobs T={ladders.tokens[0]}", runner.prompt_logprobs_call(ladders.tokens[0])),
    ]
    for label, (function, args) in programs:
        timed(label, function, args)
    vocab = runner.spec.vocab_size
    batch = sampler.SamplingBatch(**padded_sampling_arrays(8, 0))
    logits = np.zeros((8, vocab), np.float32)  # (R, V)
    parts = [
        ("sampler part: whole sample()", lambda x, b: sampler.sample(x, b)),
        ("sampler part: greedy argmax", lambda x, b: sampler.first_argmax(x)),
        ("sampler part: Gumbel noise", lambda x, b: sampler.gumbel_noise(b.seeds, b.sample_index, vocab)),
        ("sampler part: temperature, min-p, top-k, top-p", lambda x, b: sampler.filtered_logits(x, b)),
        ("sampler part: logprobs and ranks", lambda x, b: sampler.raw_logprobs(x, b.sample_index)),
    ]
    for label, part in parts:
        timed(f"{label} (R=8, V={vocab})", jax.jit(part), (logits, batch))
    generation_seconds()


def generation_seconds(repeats: int = 3) -> None:
    """Time 16 prompts x 64 greedy tokens, every step in one 64-token bucket, after a warm-up run."""
    llm = LLM(max_num_batched_tokens=64, min_token_bucket=64, max_model_len=256, num_pages=64, max_num_seqs=16,
              compilation_cache_dir=None, show_progress=False)
    prompts = [f"def f{i}(n):" for i in range(16)]
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
    llm.generate(prompts, params, use_tqdm=False)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    print(f"generation, 16 x 64 greedy tokens: mean {sum(seconds) / repeats:.3f} s, best {min(seconds):.3f} s")


if __name__ == "__main__":
    main()
