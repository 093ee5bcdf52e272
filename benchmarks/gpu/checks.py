"""Step 3: the Pallas kernels against their plain-jnp references, on NaN-poisoned pools.

Every check compiles a kernel and compares it with its reference on small random inputs, a fresh
draw for every check, never zeros. Pool pages that no row owns, and every page of the layer not
asked for, are NaN (page 0, the null page, stays finite), so a read of a wrong page or layer shows
up as NaN. The reference runs in float32 on the CPU from the same (dtype-rounded) inputs; the metric
is ‖out - ref‖ / ‖ref‖ over the real rows, which passes under 1e-5 for float32 inputs (up to 1e-3
on a GPU, where a float32 `dot` in a Triton kernel with no precision given runs in tf32: 2^-11 unit
roundoff, about 4e-4 measured on emulated tf32 attention) and under 1e-2 for bfloat16; NaN never
passes. The KV write is checked on caches poisoned with NaN: the written slots must match the
reference's, every other slot must still be NaN (page 0 excepted: padded tokens write there).
"""

from __future__ import annotations

import functools
import math
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu.common import BF16_TOLERANCE, relative_error
from benchmarks.gpu.step import Step, error_text
from pallas_kernels.paged_decode_attention.kernel import paged_decode_attention
from pallas_kernels.paged_decode_attention.reference import paged_decode_attention_reference
from pallas_kernels.paged_kv_write.kernel import write_kv
from pallas_kernels.paged_kv_write.reference import write_kv as write_kv_reference
from pallas_kernels.ragged_paged_attention import reference as ragged_reference
from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention

F32, BF16 = jnp.float32, jnp.bfloat16
LAYERS, LAYER = 2, 1  # the checks read layer 1 of 2; layer 0 is NaN except page 0
HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 2, 64, 16  # GQA group 4, as Llama-3.1-8B
SPARE_PAGES = 3  # pool pages no row owns (NaN)
F32_TOLERANCE, TF32_TOLERANCE = 1e-5, 1e-3


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


def rounded(rng: np.random.Generator, shape: tuple, dtype) -> np.ndarray:
    """Standard normal values rounded to `dtype`, held as float32."""
    return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype).astype(F32))


def make_pool(rng: np.random.Generator, row_lens: list[int], width: int, dtype) -> dict:
    """Random K/V pool and a page table for rows of `row_lens` tokens (pages shuffled over the pool).

    Pages a row owns hold random values in layer LAYER; pages no row owns and every page of the
    other layer are NaN, except page 0 (the null page, where unused page-table slots point), which
    is random and finite in every layer. Values are rounded to `dtype` once, so kernel and
    reference see the same numbers.
    """
    row_pages = [-(-n // PAGE) for n in row_lens]
    num_pages = 1 + sum(row_pages) + SPARE_PAGES
    shape = (LAYERS, num_pages, PAGE, KV_HEADS, HEAD_DIM)
    owned = np.zeros((LAYERS, num_pages), bool)  # (L, P)
    owned[:, 0] = True
    order = 1 + rng.permutation(num_pages - 1)  # (P - 1,)
    page_table = np.zeros((len(row_lens), width), np.int32)  # (R, W); unused slots -> page 0
    used = 0
    for row, count in enumerate(row_pages):
        page_table[row, :count] = order[used:used + count]
        owned[LAYER, order[used:used + count]] = True
        used += count
    caches = []
    for _ in range(2):
        values = rounded(rng, shape, dtype)  # (L, P, S, Hkv, D)
        caches.append(np.where(owned[:, :, None, None, None], values, np.nan))
    return {"k": caches[0], "v": caches[1], "page_table": page_table}


def check_ragged(rng: np.random.Generator, dtype, interpret: bool, sliding_window=None, soft_cap=None) -> float:
    """Ragged kernel on a mixed batch (prefill chunks, a whole prefill, decodes, an empty row, padding)."""
    # (cached tokens before this step, new query tokens) per row; row 3 is empty (padding)
    rows = [
        (int(rng.integers(20, 60)), int(rng.integers(9, 30))),  # prefill chunk after a cached prefix
        (0, int(rng.integers(10, 35))),  # whole prompt in one chunk
        (int(rng.integers(30, 70)), 1),  # decode
        (0, 0),  # empty row
        (int(rng.integers(1, 3)) * PAGE - 1, 1),  # decode whose token is the last of a page
        (PAGE, int(rng.integers(2, 18))),  # chunk starting on a page boundary
    ]
    seq_lens = np.array([c + n for c, n in rows], np.int32)  # (R,)
    query_lens = np.array([n for _, n in rows], np.int32)  # (R,)
    real_tokens = int(query_lens.sum())
    num_tokens = real_tokens + 3  # 3 padded tokens after the real ones
    width = max(-(-int(s) // PAGE) for s in seq_lens) + 1
    pool = make_pool(rng, list(seq_lens), width, dtype)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)  # (R + 1,)
    positions = np.zeros(num_tokens, np.int32)  # (T,) absolute position of every query token
    for row, (cached, new) in enumerate(rows):
        positions[query_start_loc[row]:query_start_loc[row + 1]] = cached + np.arange(new)
    q = rounded(rng, (num_tokens, HEADS, HEAD_DIM), dtype)  # (T, Hq, D)
    sm_scale = HEAD_DIM ** -0.5

    kernel = jax.jit(functools.partial(
        ragged_paged_attention, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        interpret=interpret,
    ))
    out = kernel(
        jnp.asarray(q, dtype), jnp.asarray(pool["k"], dtype), jnp.asarray(pool["v"], dtype), LAYER,
        jnp.asarray(query_start_loc), jnp.asarray(seq_lens), jnp.asarray(pool["page_table"]),
    )  # (T, Hq, D)
    out = np.asarray(out.astype(F32))
    ref = cpu_reference(
        ragged_reference.ragged_paged_attention, q, pool["k"], pool["v"], LAYER, positions,
        query_start_loc, pool["page_table"], sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
    )  # (T, Hq, D)
    if not np.all(np.isfinite(out[real_tokens:])):
        print("  note: padded tokens' outputs are not finite (the kernel promises zeros)")
    return relative_error(out[:real_tokens], ref[:real_tokens])


def check_decode(rng: np.random.Generator, dtype, interpret: bool, num_splits, sliding_window=None,
                 soft_cap=None, pages_per_step: int = 1) -> float:
    """Decode kernel: rows of many lengths (1, a page boundary, long, a padded row of length 0)."""
    seq_lens = np.array([
        int(rng.integers(150, 260)), 1, PAGE, 2 * PAGE + 1, 0, int(rng.integers(40, 100)),
    ], np.int32)  # (R,)
    width = -(-int(seq_lens.max()) // PAGE) + 1
    pool = make_pool(rng, list(seq_lens), width, dtype)
    q = rounded(rng, (len(seq_lens), HEADS, HEAD_DIM), dtype)  # (R, Hq, D)
    sm_scale = HEAD_DIM ** -0.5
    kernel = jax.jit(functools.partial(
        paged_decode_attention, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        num_splits=num_splits, pages_per_step=pages_per_step, interpret=interpret,
    ))
    out = kernel(
        jnp.asarray(q, dtype), jnp.asarray(pool["k"], dtype), jnp.asarray(pool["v"], dtype), LAYER,
        jnp.asarray(seq_lens), jnp.asarray(pool["page_table"]),
    )  # (R, Hq, D)
    out = np.asarray(out.astype(F32))
    ref = cpu_reference(
        paged_decode_attention_reference, q, pool["k"], pool["v"], LAYER, seq_lens, pool["page_table"],
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
    )  # (R, Hq, D)
    real = seq_lens > 0
    if not np.all(out[~real] == 0):
        print("  note: the padded row's output is not zeros")
    return relative_error(out[real], ref[real])


def check_kv_write(rng: np.random.Generator, dtype, interpret: bool) -> float:
    """KV write into NaN-poisoned caches: written slots equal the reference's, all others stay NaN."""
    num_pages, real_tokens, padded_tokens = 12, 20, 2
    shape = (LAYERS, num_pages, PAGE, KV_HEADS, HEAD_DIM)
    poisoned = np.full(shape, np.nan, np.float32)  # (L, P, S, Hkv, D)
    slots = PAGE + rng.choice((num_pages - 1) * PAGE, real_tokens, replace=False)  # distinct, not page 0
    slot_mapping = np.concatenate([slots, np.zeros(padded_tokens, np.int64)]).astype(np.int32)  # (T,)
    num_tokens = real_tokens + padded_tokens
    k = rounded(rng, (num_tokens, KV_HEADS, HEAD_DIM), dtype)  # (T, Hkv, D)
    v = rounded(rng, (num_tokens, KV_HEADS, HEAD_DIM), dtype)  # (T, Hkv, D)

    kernel = jax.jit(functools.partial(write_kv, interpret=interpret), donate_argnums=(0, 1))
    k_out, v_out = kernel(
        jnp.asarray(poisoned, dtype), jnp.asarray(poisoned, dtype), LAYER, jnp.asarray(k, dtype),
        jnp.asarray(v, dtype), jnp.asarray(slot_mapping),
    )  # (L, P, S, Hkv, D) each
    k_ref, v_ref = cpu_reference(write_kv_reference, poisoned, poisoned, LAYER, k, v, slot_mapping)

    written = np.zeros(shape[:3], bool)  # (L, P, S)
    written[LAYER, slots // PAGE, slots % PAGE] = True
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


def all_checks(rng: np.random.Generator, interpret: bool) -> list[tuple[str, object, object]]:
    """(name, input dtype, zero-argument check returning a relative error) for every check."""
    checks = [
        ("ragged float32 mixed batch", F32, lambda: check_ragged(rng, F32, interpret)),
        ("ragged bfloat16 mixed batch", BF16, lambda: check_ragged(rng, BF16, interpret)),
        ("ragged float32 window 20, soft cap 5", F32,
         lambda: check_ragged(rng, F32, interpret, sliding_window=20, soft_cap=5.0)),
    ]
    for splits in (1, 3, 8, None):
        checks.append((f"decode float32 num_splits={splits or 'auto'}", F32,
                       lambda s=splits: check_decode(rng, F32, interpret, s)))
    checks += [
        ("decode bfloat16 num_splits=auto", BF16, lambda: check_decode(rng, BF16, interpret, None)),
        ("decode bfloat16 num_splits=4", BF16, lambda: check_decode(rng, BF16, interpret, 4)),
        ("decode float32 window 40, soft cap 5, num_splits=4", F32,
         lambda: check_decode(rng, F32, interpret, 4, sliding_window=40, soft_cap=5.0)),
        ("decode float32 num_splits=3, 2 pages a step", F32,
         lambda: check_decode(rng, F32, interpret, 3, pages_per_step=2)),
        ("decode bfloat16 num_splits=auto, 4 pages a step", BF16,
         lambda: check_decode(rng, BF16, interpret, None, pages_per_step=4)),
        ("decode float32 window 40, num_splits=4, 4 pages a step", F32,
         lambda: check_decode(rng, F32, interpret, 4, sliding_window=40, pages_per_step=4)),
        ("kv write float32", F32, lambda: check_kv_write(rng, F32, interpret)),
        ("kv write bfloat16", BF16, lambda: check_kv_write(rng, BF16, interpret)),
    ]
    return checks


def check_names() -> list[str]:
    """The name of every check, in the order they run."""
    return [name for name, _, _ in all_checks(np.random.default_rng(0), interpret=True)]


def run_checks(seed: int, interpret: bool, names: tuple[str, ...] | None = None) -> list[dict]:
    """Run the checks (those named, or all), printing PASS/FAIL for each as it finishes."""
    checks = all_checks(np.random.default_rng(seed), interpret)
    if names is not None:
        checks = [check for check in checks if check[0] in names]
    rows = []
    for name, dtype, check in checks:
        start = time.perf_counter()
        try:
            error = check()
            ok, note = verdict(error, dtype, interpret)
        except Exception as exc:  # noqa: BLE001 - a check that raises is a failure; go on with the rest
            error, ok, note = float("nan"), False, error_text(exc)
            traceback.print_exc(limit=-6)
        seconds = time.perf_counter() - start
        print(f"{'PASS' if ok else 'FAIL'}  {name:<55} rel err {error:.2e}  ({note}; {seconds:.1f} s)", flush=True)
        rows.append({"name": name, "ok": ok, "error": error, "note": note, "seconds": seconds})
    return rows


def run(step: Step) -> dict:
    """Step 3: the checks of the plan; ok when every one passed."""
    rows = run_checks(step.seed, step.plan.interpret, step.plan.check_names)
    failed = [row["name"] for row in rows if not row["ok"]]
    summary = f"{len(rows) - len(failed)}/{len(rows)} passed" + (f"; FAILED: {', '.join(failed)}" if failed else "")
    return {"ok": not failed, "summary": summary, "rows": rows}
