"""Pallas attention kernels on one GPU: correctness against the references, then decode bandwidth.

    PYTHONPATH=. python benchmarks/kernels.py --check          # correctness only; exit 1 on a failure
    PYTHONPATH=. python benchmarks/kernels.py                  # microbenchmark (default grid, H200-sized)
    PYTHONPATH=. python benchmarks/kernels.py --interpret --check   # both on the CPU, Pallas interpreter,
    PYTHONPATH=. python benchmarks/kernels.py --interpret --batch-sizes 1 2 --context-lens 32 64

`--check` compiles the kernels (ragged paged attention, paged decode attention, the KV write) and
compares them with the plain-jnp references on small random inputs, a fresh draw for every check,
never zeros. Pool pages that no row owns, and every page of the layer not asked for, are NaN (page
0, the null page, stays finite), so a read of a wrong page or layer shows up as NaN. The reference
runs in float32 on the CPU from the same (dtype-rounded) inputs; the metric is
‖out - ref‖ / ‖ref‖ over the real rows, which passes under 1e-5 for float32 inputs (up to 1e-3 on
a GPU, where a float32 `dot` in a Triton kernel with no precision given runs in tf32: 2^-11 unit
roundoff, about 4e-4 measured on emulated tf32 attention) and under 1e-2 for bfloat16; NaN never
passes. The KV write is checked on caches poisoned with NaN: the written slots must match the
reference's, every other slot must still be NaN (page 0 excepted: padded tokens write there).

The microbenchmark times one decode step of one layer of Llama-3.1-8B's attention (32 query heads,
8 KV heads, head dim 128, bfloat16, pages of 16 tokens) for every batch size x context length,
all rows at that length, their pages drawn at random from the pool so reads are scattered: the
decode kernel (auto num_splits), the ragged kernel on the same decode batch, and the XLA
reference (while the caches are at most 8 GB). How it times: one jitted function per shape and
kernel makes `calls` kernel calls in one dispatch (each with its own query, so no call can be
merged with another; up to 32, enough to move ~4 GB) and is timed with a host clock around
`jax.block_until_ready`; a call's time is the median over `--repeats` timed dispatches (after two
warm-up dispatches) divided by `calls`, so launch and sync overhead are spread over the calls.
Every shape rotates through copies of the pool, stored as layers of one cache (the kernels take
the layer as an operand; each dispatch carries on the rotation where the last stopped): at least
2, so no two calls in a row read the same pages, and enough that one pass over them is at least
200 MB (up to 128 copies), 4x the H200's 50 MB L2, so no call finds its pages in the L2. Bytes
moved per call are the K and V pages read, rows x ceil(ctx / page) x page x Hkv x D x 2 bytes x 2,
plus Q read and O written (page tables ignored); GB/s is that over the time, and its share is
against the device-to-device copy bandwidth measured first (a jitted `x + 1` on a 2 GiB bfloat16 array, bytes read plus
written, median of 10). Each kernel's output on the first call is also compared with a float32
reference on two rows (`spot err` column). The table is printed last and written, with every sample,
as JSON and markdown under `$OUT` when set, else `--out-dir`.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_kv_write.kernel import write_kv
from pallas_kernels.paged_kv_write.reference import write_kv as write_kv_reference
from pallas_kernels.ragged_paged_attention import reference as ragged_reference
from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention

try:  # the decode kernel is newer; its rows are skipped, with the reason, when it does not import
    from pallas_kernels.paged_decode_attention.kernel import paged_decode_attention
    from pallas_kernels.paged_decode_attention.reference import paged_decode_attention_reference
    from pallas_kernels.paged_decode_attention.tuning import choose_num_splits

    DECODE_IMPORT_ERROR = None
except Exception as error:  # noqa: BLE001 - any failure to import only disables the decode rows
    DECODE_IMPORT_ERROR = f"{type(error).__name__}: {error}"

F32, BF16 = jnp.float32, jnp.bfloat16

# --- correctness checks ---
CHECK_LAYERS, CHECK_LAYER = 2, 1  # the checks read layer 1 of 2; layer 0 is NaN except page 0
CHECK_HEADS, CHECK_KV_HEADS, CHECK_HEAD_DIM, CHECK_PAGE = 8, 2, 64, 16  # GQA group 4, as Llama-3.1-8B
SPARE_PAGES = 3  # pool pages no row owns (NaN)
F32_TOLERANCE, TF32_TOLERANCE, BF16_TOLERANCE = 1e-5, 1e-3, 1e-2

# --- microbenchmark ---
MODEL = dict(heads=32, kv_heads=8, head_dim=128, page_size=16, dtype=BF16)  # Llama-3.1-8B attention
TINY_MODEL = dict(heads=4, kv_heads=2, head_dim=64, page_size=16, dtype=BF16)  # --interpret
ROTATE_BYTES = 200e6  # a pass over the rotated pool copies is at least this (4x the H200's 50 MB L2)
MAX_SETS = 128  # at most this many pool copies
DISPATCH_BYTES = 4e9  # one timed dispatch makes calls that move at least this (~1 ms at 4 TB/s) ...
MAX_CALLS = 32  # ... but at most this many calls (each is inlined into the dispatch's program)
REFERENCE_MAX_CACHE_BYTES = 8e9  # the XLA reference gathers every page it reads: skip it above this
SPOT_ROWS = 2  # rows of each kernel's first output compared with a float32 reference
SPOT_TOLERANCE = BF16_TOLERANCE  # the benchmark runs in bfloat16
GOAL_CONTEXT, GOAL_SHARE = 8192, 0.80  # decode at contexts >= 8192 should reach 80% of copy bandwidth
CHUNK_PAGES = 4096  # random pools are drawn this many pages at a time (keeps each draw < 2^31 elements)


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """‖out - ref‖ / ‖ref‖ in float64; NaN when out has a non-finite value."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("nan")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def verdict(error: float, dtype, interpret: bool) -> tuple[bool, str]:
    """Pass/fail of a relative error for inputs of `dtype`, with a note when tf32 explains it."""
    if not math.isfinite(error):
        return False, "non-finite output"
    if dtype == BF16:
        return error < BF16_TOLERANCE, f"tol {BF16_TOLERANCE:g}"
    if error < F32_TOLERANCE:
        return True, f"tol {F32_TOLERANCE:g}"
    if not interpret and error < TF32_TOLERANCE:
        return True, f"tol {TF32_TOLERANCE:g}: tf32 band (Triton's float32 dot with no precision given)"
    return False, f"tol {F32_TOLERANCE:g}" + ("" if interpret else f" ({TF32_TOLERANCE:g} with tf32)")


def cpu_reference(fn, *args, **kwargs):
    """Run a reference function in float32 on the CPU at full matmul precision; numpy result."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu), jax.default_matmul_precision("highest"):
        args = [jax.device_put(np.asarray(a), cpu) if isinstance(a, (np.ndarray, jax.Array)) else a for a in args]
        return jax.tree.map(np.asarray, fn(*args, **kwargs))


def make_check_pool(rng: np.random.Generator, row_lens: list[int], width: int, dtype) -> dict:
    """Random K/V pool and a page table for rows of `row_lens` tokens (pages shuffled over the pool).

    Pages a row owns hold random values in layer CHECK_LAYER; pages no row owns and every page of
    the other layer are NaN, except page 0 (the null page, where unused page-table slots point),
    which is random and finite in every layer. Values are rounded to `dtype` once, so kernel and
    reference see the same numbers.
    """
    row_pages = [-(-n // CHECK_PAGE) for n in row_lens]
    num_pages = 1 + sum(row_pages) + SPARE_PAGES
    shape = (CHECK_LAYERS, num_pages, CHECK_PAGE, CHECK_KV_HEADS, CHECK_HEAD_DIM)
    owned = np.zeros((CHECK_LAYERS, num_pages), bool)  # (L, P)
    owned[:, 0] = True
    order = 1 + rng.permutation(num_pages - 1)  # (P - 1,)
    page_table = np.zeros((len(row_lens), width), np.int32)  # (R, W); unused slots -> page 0
    used = 0
    for row, count in enumerate(row_pages):
        page_table[row, :count] = order[used:used + count]
        owned[CHECK_LAYER, order[used:used + count]] = True
        used += count
    caches = []
    for _ in range(2):
        values = rng.standard_normal(shape).astype(np.float32)  # (L, P, S, Hkv, D)
        values = np.where(owned[:, :, None, None, None], values, np.nan)
        caches.append(np.asarray(jnp.asarray(values, dtype).astype(F32)))  # rounded to dtype, held as f32
    return {"k": caches[0], "v": caches[1], "page_table": page_table}


def check_ragged(rng: np.random.Generator, dtype, interpret: bool, sliding_window=None, soft_cap=None) -> float:
    """Ragged kernel on a mixed batch (prefill chunks, a whole prefill, decodes, an empty row, padding)."""
    # (cached tokens before this step, new query tokens) per row; row 3 is empty (padding)
    rows = [
        (int(rng.integers(20, 60)), int(rng.integers(9, 30))),  # prefill chunk after a cached prefix
        (0, int(rng.integers(10, 35))),  # whole prompt in one chunk
        (int(rng.integers(30, 70)), 1),  # decode
        (0, 0),  # empty row
        (int(rng.integers(1, 3)) * CHECK_PAGE - 1, 1),  # decode whose token is the last of a page
        (CHECK_PAGE, int(rng.integers(2, 18))),  # chunk starting on a page boundary
    ]
    seq_lens = np.array([c + n for c, n in rows], np.int32)  # (R,)
    query_lens = np.array([n for _, n in rows], np.int32)  # (R,)
    real_tokens = int(query_lens.sum())
    num_tokens = real_tokens + 3  # 3 padded tokens after the real ones
    width = max(-(-int(s) // CHECK_PAGE) for s in seq_lens) + 1
    pool = make_check_pool(rng, list(seq_lens), width, dtype)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)  # (R + 1,)
    positions = np.zeros(num_tokens, np.int32)  # (T,) absolute position of every query token
    for row, (cached, new) in enumerate(rows):
        positions[query_start_loc[row]:query_start_loc[row + 1]] = cached + np.arange(new)
    q = np.asarray(jnp.asarray(rng.standard_normal((num_tokens, CHECK_HEADS, CHECK_HEAD_DIM)), dtype).astype(F32))
    sm_scale = CHECK_HEAD_DIM ** -0.5

    kernel = jax.jit(functools.partial(
        ragged_paged_attention, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        interpret=interpret,
    ))
    out = kernel(
        jnp.asarray(q, dtype), jnp.asarray(pool["k"], dtype), jnp.asarray(pool["v"], dtype), CHECK_LAYER,
        jnp.asarray(query_start_loc), jnp.asarray(seq_lens), jnp.asarray(pool["page_table"]),
    )  # (T, Hq, D)
    out = np.asarray(out.astype(F32))
    ref = cpu_reference(
        ragged_reference.ragged_paged_attention, q, pool["k"], pool["v"], CHECK_LAYER, positions,
        query_start_loc, pool["page_table"], sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
    )  # (T, Hq, D)
    if not np.all(np.isfinite(out[real_tokens:])):
        print("  note: padded tokens' outputs are not finite (the kernel promises zeros)")
    return relative_error(out[:real_tokens], ref[:real_tokens])


def check_decode(rng: np.random.Generator, dtype, interpret: bool, num_splits, sliding_window=None,
                 soft_cap=None) -> float:
    """Decode kernel: rows of many lengths (1, a page boundary, long, a padded row of length 0)."""
    seq_lens = np.array([
        int(rng.integers(150, 260)), 1, CHECK_PAGE, 2 * CHECK_PAGE + 1, 0, int(rng.integers(40, 100)),
    ], np.int32)  # (R,)
    width = -(-int(seq_lens.max()) // CHECK_PAGE) + 1
    pool = make_check_pool(rng, list(seq_lens), width, dtype)
    q = np.asarray(jnp.asarray(rng.standard_normal((len(seq_lens), CHECK_HEADS, CHECK_HEAD_DIM)), dtype).astype(F32))
    sm_scale = CHECK_HEAD_DIM ** -0.5
    kernel = jax.jit(functools.partial(
        paged_decode_attention, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        num_splits=num_splits, interpret=interpret,
    ))
    out = kernel(
        jnp.asarray(q, dtype), jnp.asarray(pool["k"], dtype), jnp.asarray(pool["v"], dtype), CHECK_LAYER,
        jnp.asarray(seq_lens), jnp.asarray(pool["page_table"]),
    )  # (R, Hq, D)
    out = np.asarray(out.astype(F32))
    ref = cpu_reference(
        paged_decode_attention_reference, q, pool["k"], pool["v"], CHECK_LAYER, seq_lens, pool["page_table"],
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
    )  # (R, Hq, D)
    real = seq_lens > 0
    if not np.all(out[~real] == 0):
        print("  note: the padded row's output is not zeros")
    return relative_error(out[real], ref[real])


def check_kv_write(rng: np.random.Generator, dtype, interpret: bool) -> float:
    """KV write into NaN-poisoned caches: written slots equal the reference's, all others stay NaN."""
    num_pages, real_tokens, padded_tokens = 12, 20, 2
    shape = (CHECK_LAYERS, num_pages, CHECK_PAGE, CHECK_KV_HEADS, CHECK_HEAD_DIM)
    poisoned = np.full(shape, np.nan, np.float32)  # (L, P, S, Hkv, D)
    slots = CHECK_PAGE + rng.choice((num_pages - 1) * CHECK_PAGE, real_tokens, replace=False)  # distinct, not page 0
    slot_mapping = np.concatenate([slots, np.zeros(padded_tokens, np.int64)]).astype(np.int32)  # (T,)
    num_tokens = real_tokens + padded_tokens
    k = np.asarray(jnp.asarray(rng.standard_normal((num_tokens, CHECK_KV_HEADS, CHECK_HEAD_DIM)), dtype).astype(F32))
    v = np.asarray(jnp.asarray(rng.standard_normal((num_tokens, CHECK_KV_HEADS, CHECK_HEAD_DIM)), dtype).astype(F32))

    kernel = jax.jit(functools.partial(write_kv, interpret=interpret), donate_argnums=(0, 1))
    k_out, v_out = kernel(
        jnp.asarray(poisoned, dtype), jnp.asarray(poisoned, dtype), CHECK_LAYER, jnp.asarray(k, dtype),
        jnp.asarray(v, dtype), jnp.asarray(slot_mapping),
    )  # (L, P, S, Hkv, D) each
    k_ref, v_ref = cpu_reference(write_kv_reference, poisoned, poisoned, CHECK_LAYER, k, v, slot_mapping)

    written = np.zeros(shape[:3], bool)  # (L, P, S)
    written[CHECK_LAYER, slots // CHECK_PAGE, slots % CHECK_PAGE] = True
    others = ~written
    others[:, 0] = False  # page 0: padded tokens write there in no defined order
    errors = []
    for out, ref in ((k_out, k_ref), (v_out, v_ref)):
        out = np.asarray(out.astype(F32))
        stray = int(np.sum(~np.isnan(out[others])))
        if stray:
            print(f"  {stray} values written outside the slots asked for")
            return float("nan")
        errors.append(relative_error(out[written], ref[written]))
    return max(errors)


def run_checks(args) -> int:
    """Run every correctness check, print PASS/FAIL per check; returns the number of failures."""
    rng = np.random.default_rng(args.seed)
    checks = [
        ("ragged float32 mixed batch", F32, lambda: check_ragged(rng, F32, args.interpret)),
        ("ragged bfloat16 mixed batch", BF16, lambda: check_ragged(rng, BF16, args.interpret)),
        ("ragged float32 window 20, soft cap 5", F32,
         lambda: check_ragged(rng, F32, args.interpret, sliding_window=20, soft_cap=5.0)),
    ]
    if DECODE_IMPORT_ERROR is None:
        for splits in (1, 3, 8, None):
            checks.append((f"decode float32 num_splits={splits or 'auto'}", F32,
                           lambda s=splits: check_decode(rng, F32, args.interpret, s)))
        checks.append(("decode bfloat16 num_splits=auto", BF16, lambda: check_decode(rng, BF16, args.interpret, None)))
        checks.append(("decode bfloat16 num_splits=4", BF16, lambda: check_decode(rng, BF16, args.interpret, 4)))
        checks.append(("decode float32 window 40, soft cap 5, num_splits=4", F32,
                       lambda: check_decode(rng, F32, args.interpret, 4, sliding_window=40, soft_cap=5.0)))
    else:
        print(f"SKIP decode checks: pallas_kernels.paged_decode_attention does not import ({DECODE_IMPORT_ERROR})")
    checks.append(("kv write float32", F32, lambda: check_kv_write(rng, F32, args.interpret)))
    checks.append(("kv write bfloat16", BF16, lambda: check_kv_write(rng, BF16, args.interpret)))

    failures = 0
    for name, dtype, check in checks:
        start = time.perf_counter()
        try:
            error = check()
            ok, note = verdict(error, dtype, args.interpret)
        except Exception as exc:  # noqa: BLE001 - a check that raises is a failure; go on with the rest
            error, ok, note = float("nan"), False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            traceback.print_exc(limit=-6)
        failures += not ok
        seconds = time.perf_counter() - start
        print(f"{'PASS' if ok else 'FAIL'}  {name:<52} rel err {error:.2e}  ({note}; {seconds:.1f} s)", flush=True)
    print(f"checks: {len(checks) - failures} passed, {failures} failed")
    return failures


def time_dispatches(fn, args_for, repeats: int, warmup: int = 2) -> tuple[list[float], float, object]:
    """Host-clock seconds of `repeats` dispatches `fn(*args_for(d))` (each synced), after `warmup`
    untimed ones; `d` counts all dispatches from 0.

    Returns (samples, seconds of the first dispatch incl. compile, the first dispatch's outputs)."""
    start = time.perf_counter()
    first = jax.block_until_ready(fn(*args_for(0)))
    compile_s = time.perf_counter() - start
    for d in range(1, warmup):
        jax.block_until_ready(fn(*args_for(d)))
    samples = []
    for d in range(warmup, warmup + repeats):
        fn_args = args_for(d)
        start = time.perf_counter()
        jax.block_until_ready(fn(*fn_args))
        samples.append(time.perf_counter() - start)
    return samples, compile_s, first


def copy_bandwidth(num_bytes: int, repeats: int) -> dict:
    """Device-to-device copy bandwidth: a jitted `x + 1` over a bfloat16 array, bytes read + written."""
    x = jax.random.normal(jax.random.key(1), (num_bytes // 2,), BF16)  # (N,) bfloat16, random
    add_one = jax.jit(lambda x: x + jnp.asarray(1, x.dtype))
    samples, _, _ = time_dispatches(add_one, lambda d: (x,), repeats)
    moved = 2 * x.size * x.dtype.itemsize
    median = float(np.median(samples))
    del x
    return {"bytes": moved, "seconds": samples, "median_s": median, "gb_per_s": moved / median / 1e9}


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def random_pool(key: jax.Array, num_layers: int, num_pages: int, page_shape: tuple, dtype) -> jax.Array:
    """Random normal `(L, P', S, Hkv, D)` pool with P' >= num_pages (rounded up to CHUNK_PAGES),
    drawn CHUNK_PAGES pages at a time so no single draw has more than 2^31 elements."""
    chunk = min(num_pages, CHUNK_PAGES)
    num_chunks = -(-num_pages // chunk)
    keys = jax.random.split(key, num_layers * num_chunks)  # (L * C,)
    pool = jax.lax.map(lambda k: jax.random.normal(k, (chunk, *page_shape), dtype), keys)  # (L * C, chunk, S, Hkv, D)
    return pool.reshape(num_layers, num_chunks * chunk, *page_shape)


def make_step(batch: int, context: int, model: dict, num_sets: int, calls: int, seed: int) -> dict:
    """Device inputs of one decode step: `calls` queries, a pool with `num_sets` layers, metadata."""
    page_size = model["page_size"]
    width = -(-context // page_size)  # pages per row
    num_pages = 1 + batch * width  # page 0 is the null page
    page_shape = (page_size, model["kv_heads"], model["head_dim"])
    key_q, key_k, key_v = jax.random.split(jax.random.key(seed), 3)
    page_table = 1 + np.random.default_rng(seed).permutation(batch * width).reshape(batch, width)  # (B, W)
    return {
        # (N, B, Hq, D): one query batch per call of a dispatch
        "qs": jax.random.normal(key_q, (calls, batch, model["heads"], model["head_dim"]), model["dtype"]),
        "k": random_pool(key_k, num_sets, num_pages, page_shape, model["dtype"]),  # (sets, P', S, Hkv, D)
        "v": random_pool(key_v, num_sets, num_pages, page_shape, model["dtype"]),  # (sets, P', S, Hkv, D)
        "seq_lens": jnp.full((batch,), context, jnp.int32),  # (B,)
        "page_table": jnp.asarray(page_table, jnp.int32),  # (B, W)
        "query_start_loc": jnp.arange(batch + 1, dtype=jnp.int32),  # (B + 1,) one token per row
        "positions": jnp.full((batch,), context - 1, jnp.int32),  # (B,)
    }


def kernel_calls(model: dict, interpret: bool) -> dict:
    """Per kernel name, a function `(q, k, v, layer, step) -> (B, Hq, D)` on one decode batch."""
    sm_scale = model["head_dim"] ** -0.5
    calls = {}
    if DECODE_IMPORT_ERROR is None:
        calls["decode"] = lambda q, k, v, layer, s: paged_decode_attention(
            q, k, v, layer, s["seq_lens"], s["page_table"], sm_scale=sm_scale, interpret=interpret)
    calls["ragged"] = lambda q, k, v, layer, s: ragged_paged_attention(
        q, k, v, layer, s["query_start_loc"], s["seq_lens"], s["page_table"], sm_scale=sm_scale, interpret=interpret)
    calls["xla-reference"] = lambda q, k, v, layer, s: ragged_reference.ragged_paged_attention(
        q, k, v, layer, s["positions"], s["query_start_loc"], s["page_table"], sm_scale=sm_scale)
    return calls


META_KEYS = ("seq_lens", "page_table", "query_start_loc", "positions")


def repeated_calls(call, num_calls: int, num_sets: int):
    """One jitted `run(step, first)` making `num_calls` calls of `call`: call i on query i and pool
    layer `(first + i) % num_sets` (`first` is traced, so dispatches can go on where the last stopped).

    The inner jit is lowered once (one Pallas->Triton lowering) and called `num_calls` times; every
    call's output is returned, so none is dropped, and each has its own query, so none is merged."""
    inner = jax.jit(call)

    @jax.jit
    def run(step, first):
        meta = {key: step[key] for key in META_KEYS}
        return tuple(
            inner(step["qs"][i], step["k"], step["v"], (first + i) % num_sets, meta) for i in range(num_calls)
        )  # num_calls x (B, Hq, D)

    return run


@jax.jit
def spot_error_parts(out, step, rows):
    """Float32 reference for a few rows (their pages copied into a small dense pool), and the kernel's rows."""
    # out: (B, Hq, D) the kernel's output for qs[0] on layer 0; rows: (r,) int32
    table = step["page_table"][rows]  # (r, W)
    num_rows, width = table.shape
    small = []
    for cache in (step["k"], step["v"]):
        pages = cache[0, table.reshape(-1)]  # (r * W, S, Hkv, D): one gather, no copy of layer 0
        small.append(jnp.concatenate([cache[0, :1], pages])[None].astype(F32))  # (1, 1 + r * W, S, Hkv, D)
    small_table = 1 + jnp.arange(num_rows * width, dtype=jnp.int32).reshape(num_rows, width)  # (r, W)
    with jax.default_matmul_precision("highest"):
        ref = ragged_reference.ragged_paged_attention(
            step["qs"][0][rows].astype(F32), small[0], small[1], 0, step["positions"][rows],
            jnp.arange(num_rows + 1, dtype=jnp.int32), small_table, sm_scale=out.shape[-1] ** -0.5,
        )  # (r, Hq, D)
    return out[rows].astype(F32), ref


def bytes_moved(batch: int, context: int, model: dict) -> int:
    """K and V pages read plus Q read and O written by one decode call (page tables ignored)."""
    itemsize = jnp.dtype(model["dtype"]).itemsize
    page_size = model["page_size"]
    kv = batch * (-(-context // page_size)) * page_size * model["kv_heads"] * model["head_dim"] * itemsize * 2
    q_and_o = 2 * batch * model["heads"] * model["head_dim"] * itemsize
    return kv + q_and_o


def benchmark_shape(batch: int, context: int, model: dict, args, copy_gbps: float) -> list[dict]:
    """Time every kernel on one (batch, context) decode step; one result dict per kernel."""
    moved = bytes_moved(batch, context, model)
    kv_bytes = moved - 2 * batch * model["heads"] * model["head_dim"] * jnp.dtype(model["dtype"]).itemsize
    if args.interpret:
        num_sets, num_calls = 2, 2
    else:
        # at least 2, so no two calls of a dispatch in a row read the same layer (nothing to share)
        num_sets = max(2, min(MAX_SETS, math.ceil(ROTATE_BYTES / kv_bytes)))
        num_calls = min(MAX_CALLS, max(2, math.ceil(DISPATCH_BYTES / kv_bytes)))
    step = make_step(batch, context, model, num_sets, num_calls, seed=args.seed + batch * 100003 + context)
    cache_bytes = 2 * step["k"].size * step["k"].dtype.itemsize // num_sets  # K + V of one layer (one set)
    splits = None
    if DECODE_IMPORT_ERROR is None:
        splits = choose_num_splits(batch, model["kv_heads"], step["page_table"].shape[1])
    spot_rows = jnp.asarray(sorted({0, batch - 1})[:SPOT_ROWS], jnp.int32)
    results = []
    for name, call in kernel_calls(model, args.interpret).items():
        row = {"kernel": name, "batch": batch, "context": context, "num_splits": splits if name == "decode" else None,
               "bytes": moved, "sets": num_sets, "calls": num_calls, "cache_bytes": cache_bytes}
        if name == "xla-reference" and (args.skip_reference or cache_bytes > REFERENCE_MAX_CACHE_BYTES):
            row["skipped"] = "--skip-reference" if args.skip_reference else f"caches {cache_bytes / 1e9:.1f} GB > 8 GB"
            results.append(row)
            continue
        try:
            run = repeated_calls(call, num_calls, num_sets)
            samples, compile_s, outputs = time_dispatches(
                run, lambda d: (step, jnp.int32(d * num_calls % num_sets)), args.repeats)
            got, ref = spot_error_parts(outputs[0], step, spot_rows)
            per_call = float(np.median(samples)) / num_calls
            row.update(
                seconds_per_dispatch=samples, first_dispatch_s=compile_s, us=per_call * 1e6,
                us_min=min(samples) / num_calls * 1e6, us_max=max(samples) / num_calls * 1e6,
                gb_per_s=moved / per_call / 1e9, copy_share=moved / per_call / 1e9 / copy_gbps,
                spot_error=relative_error(np.asarray(got), np.asarray(ref)),
            )
            del outputs
        except Exception as exc:  # noqa: BLE001 - record it and go on with the other kernels and shapes
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            traceback.print_exc(limit=-6)
        results.append(row)
        print(describe(row), flush=True)
    del step
    return results


def describe(row: dict) -> str:
    """One log line for a result."""
    head = f"{row['kernel']:<14} B={row['batch']:<4} ctx={row['context']:<6}"
    if "us" in row:
        return (f"{head} {row['us']:10.1f} us  {row['gb_per_s']:8.1f} GB/s  {100 * row['copy_share']:5.1f}% of copy  "
                f"spot err {row['spot_error']:.1e}  ({row['sets']} sets, {row['calls']} calls/dispatch, "
                f"first dispatch {row['first_dispatch_s']:.1f} s)")
    return f"{head} {row.get('skipped') or row.get('error')}"


def markdown_table(rows: list[dict], copy: dict) -> str:
    """The results as a markdown table, sorted by kernel, batch, context."""
    lines = [
        f"copy bandwidth {copy['gb_per_s']:.0f} GB/s; times are per call (median); bytes = K/V pages read + Q + O",
        "",
        "| kernel | B | ctx | splits | µs | MB moved | GB/s | % copy | spot err |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    order = {"decode": 0, "ragged": 1, "xla-reference": 2}
    for row in sorted(rows, key=lambda r: (order.get(r["kernel"], 9), r["batch"], r["context"])):
        splits = "" if row.get("num_splits") is None else str(row["num_splits"])
        head = f"| {row['kernel']} | {row['batch']} | {row['context']} | {splits} |"
        if "us" in row:
            flag = "" if row["spot_error"] < SPOT_TOLERANCE else " WRONG"
            lines.append(f"{head} {row['us']:.1f} | {row['bytes'] / 1e6:.3g} | {row['gb_per_s']:.0f} | "
                         f"{100 * row['copy_share']:.0f}% | {row['spot_error']:.0e}{flag} |")
        else:
            lines.append(f"{head} {(row.get('skipped') or row.get('error', ''))[:80]} | | | | |")
    return "\n".join(lines)


def goal_line(rows: list[dict]) -> str:
    """Whether decode at contexts >= GOAL_CONTEXT reached GOAL_SHARE of the copy bandwidth."""
    measured = [r for r in rows if r["kernel"] == "decode" and r["context"] >= GOAL_CONTEXT and "us" in r]
    if not measured:
        return f"GOAL decode ctx >= {GOAL_CONTEXT} at >= {GOAL_SHARE:.0%} of copy bandwidth: NOT MEASURED"
    hits = [r for r in measured if r["copy_share"] >= GOAL_SHARE]
    worst = min(measured, key=lambda r: r["copy_share"])
    state = "MET" if len(hits) == len(measured) else "NOT MET"
    return (f"GOAL decode ctx >= {GOAL_CONTEXT} at >= {GOAL_SHARE:.0%} of copy bandwidth: {state} "
            f"({len(hits)}/{len(measured)} shapes; lowest {worst['copy_share']:.0%} at B={worst['batch']} "
            f"ctx={worst['context']}; best {max(r['copy_share'] for r in measured):.0%})")


def run_benchmark(args, started: float) -> int:
    """Measure the copy bandwidth, then every shape of the grid; print and save the table."""
    model = TINY_MODEL if args.interpret else MODEL
    if DECODE_IMPORT_ERROR is not None:
        print(f"SKIP decode rows: pallas_kernels.paged_decode_attention does not import ({DECODE_IMPORT_ERROR})")
    copy = copy_bandwidth(args.copy_mib * 2**20, repeats=10)
    print(f"copy bandwidth: {copy['gb_per_s']:.0f} GB/s ({copy['bytes'] / 1e9:.2f} GB read + written in "
          f"{copy['median_s'] * 1e3:.3f} ms, median of {len(copy['seconds'])})", flush=True)
    rows, skipped = [], []
    # longest contexts first: if the time budget runs out, the shapes the goal is about are done
    shapes = [(b, c) for c in sorted(args.context_lens, reverse=True) for b in sorted(args.batch_sizes)]
    for batch, context in shapes:
        if time.perf_counter() - started > args.time_budget_s:
            skipped.append((batch, context))
            continue
        try:
            rows.extend(benchmark_shape(batch, context, model, args, copy["gb_per_s"]))
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory making the inputs
            traceback.print_exc(limit=-6)
            rows.append({"kernel": "all", "batch": batch, "context": context, "bytes": 0,
                         "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"})
    if skipped:
        print(f"time budget of {args.time_budget_s:.0f} s exceeded: skipped {len(skipped)} shapes (B, ctx): {skipped}")

    out_dir = os.environ.get("OUT") or args.out_dir
    table = markdown_table(rows, copy)
    goal = goal_line(rows)
    report = {
        "jax": jax.__version__, "devices": [str(d) for d in jax.devices()], "interpret": args.interpret,
        "model": {k: (str(v) if k == "dtype" else v) for k, v in model.items()}, "args": vars(args),
        "copy": copy, "rows": rows, "skipped_shapes": skipped, "goal": goal,
        "elapsed_s": time.perf_counter() - started,
    }
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "kernels_bench.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
        with open(os.path.join(out_dir, "kernels_bench.md"), "w") as f:
            f.write(goal + "\n\n" + table + "\n")
        print(f"wrote {out_dir}/kernels_bench.json and kernels_bench.md")
    except OSError as exc:
        print(f"could not write results under {out_dir}: {exc}")
    wrong = [f"{r['kernel']} B={r['batch']} ctx={r['context']}" for r in rows
             if "us" in r and not r["spot_error"] < SPOT_TOLERANCE]
    if wrong:
        print(f"WRONG RESULTS (spot error >= {SPOT_TOLERANCE:g} or NaN; their times mean little): {', '.join(wrong)}")
    if args.interpret:
        print("interpret mode: Pallas interpreter on the CPU; the times are meaningless, "
              "this only shows the script runs")
    print(goal)
    print()
    print(table, flush=True)
    return 0


def main() -> None:
    """Parse the options and run the checks (`--check`) or the microbenchmark."""
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="correctness checks only; exit 1 on any failure")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default 1 8 32 128 (1 2 interpreted)")
    parser.add_argument("--context-lens", type=int, nargs="+", default=None,
                        help="default 512 2048 8192 32768 (32 64 interpreted)")
    parser.add_argument("--repeats", type=int, default=20, help="timed dispatches per kernel and shape")
    parser.add_argument("--interpret", action="store_true", help="Pallas interpreter on the CPU, tiny shapes")
    parser.add_argument("--skip-reference", action="store_true", help="do not time the XLA reference")
    parser.add_argument("--time-budget-s", type=float, default=float("inf"),
                        help="start no new shape once this many seconds have passed since start-up")
    parser.add_argument("--copy-mib", type=int, default=None,
                        help="copy-bandwidth array size in MiB (default 2048; 16 interpreted)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="/tmp", help="where results go when $OUT is not set")
    args = parser.parse_args()
    args.batch_sizes = args.batch_sizes or ([1, 2] if args.interpret else [1, 8, 32, 128])
    args.context_lens = args.context_lens or ([32, 64] if args.interpret else [512, 2048, 8192, 32768])
    args.copy_mib = args.copy_mib or (16 if args.interpret else 2048)

    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}", flush=True)
    if jax.default_backend() == "cpu" and not args.interpret:
        print("no GPU here: the compiled (Triton) kernels need one; use --interpret on the CPU")
        sys.exit(2)
    if args.check:
        sys.exit(1 if run_checks(args) else 0)
    sys.exit(run_benchmark(args, started))


if __name__ == "__main__":
    main()
