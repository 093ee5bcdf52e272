"""The engine's XLA attention path on the CPU: query tiles of different sizes, side by side in one run.

    python benchmarks/attention_tiles.py

Two step shapes of the throughput benchmark's model (8 query heads, 2 KV heads, head dim 32,
pages of 16): a mixed prefill step (T=512, 55 decodes plus prefill chunks, W=32) and a decode
step (T=64, 64 decodes, W=32). Prints the median time of one layer's attention
(`jaxserve.attention.xla.tiled_attention`, pages per chunk as the engine picks them on the CPU) per tile size.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention import xla
from pallas_kernels.ragged_paged_attention import reference

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, LAYERS, PAGES, WIDTH = 8, 2, 32, 16, 4, 2000, 32


def make_step(query_lens: list[int], num_tokens: int, num_rows: int, rng: np.random.Generator) -> tuple:
    """Random q, KV pool and metadata for one step with the given per-row query lengths."""
    k_cache = jnp.asarray(rng.standard_normal((LAYERS, PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM), np.float32))
    v_cache = jnp.asarray(rng.standard_normal(k_cache.shape, np.float32))
    q = jnp.asarray(rng.standard_normal((num_tokens, HEADS, HEAD_DIM), np.float32))  # (T, Hq, D)
    starts = np.cumsum([0] + query_lens)
    query_start_loc = np.full(num_rows + 1, starts[-1], np.int32)  # (R + 1,)
    query_start_loc[: len(query_lens)] = starts[:-1]
    seq_lens = rng.integers(200, 500, num_rows)  # (R,)
    positions = np.zeros(num_tokens, np.int32)  # (T,)
    for row, length in enumerate(query_lens):
        positions[starts[row] : starts[row] + length] = seq_lens[row] - length + np.arange(length)
    page_table = rng.integers(1, PAGES, (num_rows, WIDTH)).astype(np.int32)  # (R, W)
    token_rows = reference.token_request_index(jnp.asarray(query_start_loc), num_tokens)  # (T,)
    positions[starts[-1]:] = -1  # padded tokens see nothing
    return q, k_cache, v_cache, 1, jnp.asarray(positions), token_rows, jnp.asarray(page_table)


def median_ms(fn, args, repeats: int) -> float:
    """Median wall time of a jitted call, after one warm-up call."""
    jitted = jax.jit(fn)
    jitted(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jitted(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def main() -> None:
    """Time each tile size on both step shapes and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", default="none,4,8,16,32", help="comma list; 'none' = untiled")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    steps = {
        "mixed T=512": make_step([1] * 55 + [100, 150, 92, 60, 30, 20, 1, 1, 1], 512, 64, rng),
        "decode T=64": make_step([1] * 64, 64, 64, rng),
    }
    print(f"{'query tile':>10}  " + "  ".join(f"{name:>14}" for name in steps) + "   (ms per layer, median)")
    for tile_name in args.tiles.split(","):
        row = []
        for step in steps.values():
            num_tokens = step[0].shape[0]
            queries = num_tokens if tile_name == "none" else min(int(tile_name), num_tokens)
            # keys in one chunk of W pages, narrowed per tile, as the engine's CPU tiles take them at these shapes
            attend = functools.partial(xla.tiled_attention, sm_scale=HEAD_DIM**-0.5, sliding_window=None,
                                       tiles=xla.Tiles(queries=queries, pages=WIDTH))
            row.append(median_ms(attend, step, args.repeats))
        print(f"{tile_name:>10}  " + "  ".join(f"{ms:14.2f}" for ms in row))
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")


if __name__ == "__main__":
    main()
