"""Embedding throughput: jaxserve's pooling runner (`LLM.embed`, continuous batching of ragged prompts) against
Hugging Face transformers' `AutoModel` on the same weights, batched and padded as a plain embedding server would.

    PYTHONPATH=. python benchmarks/embeddings.py [--model-shape llama-small] [--num-prompts 256] [--repeats 3]

The workload: --num-prompts seeded random token prompts of 16 to --max-len tokens. Both systems pool the last
prompt token's final hidden state and L2-normalize it (vLLM's default for a decoder):
- jaxserve: `LLM(runner="pooling")`, every prompt queued at once, steps of --max-num-batched-tokens tokens, prefix
  caching off (every run computes every token, as the other systems do); with --enable-prefix-caching, the timed
  runs find the full pages of the earlier runs' prompts cached (what a repeated corpus gets);
- transformers: float32, SDPA attention, the prompts in batches of --hf-batch-size, right-padded with an attention
  mask, each row's state at its last real token (torch's own thread count): in input order, and sorted by length
  (what embedding servers do to pad less; the vectors put back in input order).
Each system embeds the whole workload once to warm up, then --repeats timed times (interleaved, the order
alternating). Reported: mean and best seconds, prompt tokens per second, and the ratio to transformers; and the
largest difference between the two systems' vectors.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import numpy as np  # noqa: E402

from jaxserve import LLM  # noqa: E402
from jaxserve.bench.models import SHAPE_NAMES, ensure_model  # noqa: E402


def workload(num_prompts: int, max_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Seeded random prompts of 16 to `max_len` tokens (ids past the 4 special ones)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab_size, int(length)).tolist() for length in rng.integers(16, max_len + 1, num_prompts)]


class HFEmbedder:
    """transformers' AutoModel: padded batches, the last real token's final state, L2-normalized."""

    def __init__(self, folder: str, batch_size: int):
        import torch
        from transformers import AutoModel

        self.torch = torch
        self.model = AutoModel.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
        self.batch_size = batch_size

    def embed_sorted(self, prompts: list[list[int]]) -> np.ndarray:
        """`embed` over the prompts sorted by length (less padding), the vectors in the prompts' order."""
        order = sorted(range(len(prompts)), key=lambda index: len(prompts[index]))
        vectors = self.embed([prompts[index] for index in order])
        return vectors[np.argsort(order)]

    def embed(self, prompts: list[list[int]]) -> np.ndarray:
        """(N, H) float32 unit vectors, one per prompt."""
        torch, vectors = self.torch, []
        for start in range(0, len(prompts), self.batch_size):
            batch = prompts[start : start + self.batch_size]
            width = max(map(len, batch))
            ids = torch.zeros((len(batch), width), dtype=torch.long)  # (B, W) right-padded
            mask = torch.zeros((len(batch), width), dtype=torch.long)  # (B, W)
            for row, tokens in enumerate(batch):
                ids[row, : len(tokens)] = torch.tensor(tokens)
                mask[row, : len(tokens)] = 1
            with torch.no_grad():
                states = self.model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, W, H)
            last = states[torch.arange(len(batch)), mask.sum(dim=1) - 1]  # (B, H)
            vectors.append(torch.nn.functional.normalize(last, dim=-1).numpy())
        return np.concatenate(vectors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", choices=SHAPE_NAMES, default="llama-small")
    parser.add_argument("--cache-dir", default="/tmp/jaxserve-bench")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--enable-prefix-caching", action="store_true")
    args = parser.parse_args()
    folder = ensure_model(args.model_shape, args.cache_dir)
    llm = LLM(folder, runner="pooling", max_model_len=args.max_len, max_num_seqs=64,
              enable_prefix_caching=args.enable_prefix_caching, max_num_batched_tokens=args.max_num_batched_tokens,
              show_progress=False, compilation_cache_dir=os.path.join(args.cache_dir, "xla-cache"))
    prompts = workload(args.num_prompts, args.max_len, llm.engine.core.spec.vocab_size)
    hf = HFEmbedder(folder, args.hf_batch_size)
    systems = {
        "jaxserve": lambda: np.asarray([o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]),
        "transformers": lambda: hf.embed(prompts),
        "transformers, length-sorted": lambda: hf.embed_sorted(prompts),
    }
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    vectors = {}
    order = list(systems)
    for round_index in range(args.repeats + 1):
        for name in order if round_index % 2 else order[::-1]:
            started = time.perf_counter()
            vectors[name] = systems[name]()
            if round_index:  # round 0 warms up
                seconds[name].append(time.perf_counter() - started)
    difference = max(float(np.abs(vectors["jaxserve"] - vectors[name]).max()) for name in systems)
    num_tokens = sum(map(len, prompts))
    hf_mean, hf_best = statistics.mean(seconds["transformers"]), min(seconds["transformers"])
    print(f"{args.model_shape}: {args.num_prompts} prompts of 16 to {args.max_len} tokens ({num_tokens} tokens), "
          f"{args.repeats} timed runs after one warm-up; largest difference between the systems' unit vectors "
          f"{difference:.1e}; jaxserve's prefix cache hits {llm.stats()['prefix_cache_hits']}, compilations after "
          f"warm-up {llm.stats()['compilations_after_warmup']}")
    print("| system | mean s | best s | prompt tokens/s (mean) | speed against transformers, mean (best) |")
    print("|---|---:|---:|---:|---|")
    for name, runs in seconds.items():
        mean, best = statistics.mean(runs), min(runs)
        print(f"| {name} | {mean:.3f} | {best:.3f} | {num_tokens / mean:,.0f} | {hf_mean / mean:.2f}x "
              f"({hf_best / best:.2f}x) |")


if __name__ == "__main__":
    main()
