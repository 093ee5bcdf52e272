"""Step 8: bandwidth of the paged KV write kernel for steps of T new tokens.

A call writes T tokens' K and V (each (T, Hkv, D)) into T distinct random slots of one layer of a pool
whose pages are scattered; bytes moved are the new K and V read plus the same written, 4 x T x Hkv x D
x itemsize. One dispatch makes `calls` writes in a row, each into the caches the previous one returned
(donated, so every write is in place), with its own K/V and slots.
"""

from __future__ import annotations

import functools
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu.common import random_pool
from benchmarks.gpu.step import Step, error_text
from pallas_kernels.paged_kv_write.kernel import write_kv

CALLS, INTERPRETED_CALLS = 16, 2  # writes per dispatch (the interpreter compiles each one: few)
WARMUP = 2  # untimed dispatches (the first compiles)


def chained_writes(interpret: bool):
    """Jitted `run(k_cache, v_cache, ks, vs, slots)`: write `ks[i]`, `vs[i]` at `slots[i]` for every i,
    in order, into donated caches; returns the caches."""
    write = functools.partial(write_kv, interpret=interpret)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def run(k_cache, v_cache, ks, vs, slots):
        # k_cache, v_cache: (1, P, S, Hkv, D); ks, vs: (N, T, Hkv, D); slots: (N, T) int32
        for i in range(ks.shape[0]):
            k_cache, v_cache = write(k_cache, v_cache, 0, ks[i], vs[i], slots[i])
        return k_cache, v_cache

    return run


def measure(tokens: int, step: Step) -> dict:
    """Per-write time of T tokens (median over repeats) and the bandwidth it implies."""
    plan = step.plan
    model, page_size = plan.model, plan.page_size
    dtype = jnp.dtype(model.dtype)
    num_pages = max(plan.kv_write_pool_pages, 1 + -(-tokens // page_size))
    key_k, key_v, key_new = jax.random.split(jax.random.key(step.seed + tokens), 3)
    page_shape = (page_size, model.kv_heads, model.head_dim)
    caches = (random_pool(key_k, 1, num_pages, page_shape, dtype),
              random_pool(key_v, 1, num_pages, page_shape, dtype))  # (1, P', S, Hkv, D) each
    calls = INTERPRETED_CALLS if plan.interpret else CALLS
    rng = np.random.default_rng(step.seed + tokens)
    slots = jnp.asarray(np.stack([page_size + rng.choice((num_pages - 1) * page_size, tokens, replace=False)
                                  for _ in range(calls)]), jnp.int32)  # (N, T): distinct per write, not page 0
    new = jax.random.normal(key_new, (2, calls, tokens, model.kv_heads, model.head_dim), dtype)  # K and V
    run = chained_writes(plan.interpret)
    samples = []
    for d in range(WARMUP + plan.decode_repeats):
        start = time.perf_counter()
        caches = jax.block_until_ready(run(*caches, new[0], new[1], slots))
        if d >= WARMUP:
            samples.append(time.perf_counter() - start)
    moved = 4 * tokens * model.kv_heads * model.head_dim * dtype.itemsize
    per_call = float(np.median(samples)) / calls
    return {"tokens": tokens, "bytes": moved, "us": per_call * 1e6, "gb_per_s": moved / per_call / 1e9,
            "calls": calls}


def run(step: Step) -> dict:
    """Step 8: every token count of the plan."""
    rows = []
    for tokens in step.plan.kv_write_tokens:
        if step.out_of_time():
            rows.append({"tokens": tokens, "skipped": "out of time"})
            print(f"kv write T={tokens:<5} skipped: out of time")
            continue
        try:
            row = measure(tokens, step)
            print(f"kv write T={tokens:<5} {row['us']:9.1f} us {row['gb_per_s']:7.0f} GB/s  ({row['bytes'] / 1e6:.2f} "
                  f"MB read + written per write, {row['calls']} writes a dispatch)", flush=True)
        except Exception as exc:  # noqa: BLE001 - record it, go on with the next size
            traceback.print_exc(limit=-4)
            row = {"tokens": tokens, "error": error_text(exc)}
            print(f"kv write T={tokens:<5} FAIL {row['error']}", flush=True)
        rows.append(row)
    measured = [row for row in rows if "us" in row]
    summary = ", ".join(f"T={row['tokens']} {row['gb_per_s']:.0f} GB/s" for row in measured) or "nothing measured"
    return {"ok": len(measured) == len(rows), "summary": summary, "rows": rows}
