"""Step 2: compile the three kernels (ragged paged attention, paged decode attention, the paged KV write)
at the plan's model shape, for each page size, from abstract shapes (nothing is allocated or run)."""

from __future__ import annotations

import functools
import time
import traceback

import jax
import jax.numpy as jnp

from benchmarks.gpu.config import Model
from benchmarks.gpu.step import Step, error_text
from pallas_kernels.paged_decode_attention.kernel import paged_decode_attention
from pallas_kernels.paged_kv_write.kernel import write_kv
from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention

ROWS, TOKENS, WIDTH, POOL_PAGES = 8, 256, 128, 2048  # a step of 8 rows, 256 tokens, up to 128 pages a row


def abstract_calls(model: Model, page_size: int, interpret: bool) -> dict:
    """Per kernel name, (function, abstract arguments) of one call at `model`'s shape."""
    dtype = jnp.dtype(model.dtype)
    cache = jax.ShapeDtypeStruct((2, POOL_PAGES, page_size, model.kv_heads, model.head_dim), dtype)  # (L, P, S, Hkv, D)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    rows = jax.ShapeDtypeStruct((ROWS,), jnp.int32)  # (R,)
    table = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.int32)  # (R, W)
    starts = jax.ShapeDtypeStruct((ROWS + 1,), jnp.int32)  # (R + 1,)
    tokens_q = jax.ShapeDtypeStruct((TOKENS, model.heads, model.head_dim), dtype)  # (T, Hq, D)
    rows_q = jax.ShapeDtypeStruct((ROWS, model.heads, model.head_dim), dtype)  # (R, Hq, D)
    new_kv = jax.ShapeDtypeStruct((TOKENS, model.kv_heads, model.head_dim), dtype)  # (T, Hkv, D)
    slots = jax.ShapeDtypeStruct((TOKENS,), jnp.int32)  # (T,)
    sm_scale = model.head_dim ** -0.5
    return {
        "ragged_paged_attention": (
            functools.partial(ragged_paged_attention, sm_scale=sm_scale, interpret=interpret),
            (tokens_q, cache, cache, layer, starts, rows, table)),
        "paged_decode_attention": (
            functools.partial(paged_decode_attention, sm_scale=sm_scale, interpret=interpret),
            (rows_q, cache, cache, layer, rows, table)),
        "paged_kv_write": (
            functools.partial(write_kv, interpret=interpret), (cache, cache, layer, new_kv, new_kv, slots)),
    }


def run(step: Step) -> dict:
    """Step 2: lower and compile every kernel for every page size; OK/FAIL and seconds for each."""
    rows = []
    for page_size in step.plan.page_sizes:
        for name, (function, args) in abstract_calls(step.plan.model, page_size, step.plan.interpret).items():
            start = time.perf_counter()
            try:
                jax.jit(function).lower(*args).compile()
                row = {"kernel": name, "page_size": page_size, "ok": True}
            except Exception as exc:  # noqa: BLE001 - record it and go on with the others
                traceback.print_exc(limit=-4)
                row = {"kernel": name, "page_size": page_size, "ok": False, "error": error_text(exc)}
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
            print(f"compile {name:<24} pages of {page_size:<3} {'OK  ' if row['ok'] else 'FAIL'} "
                  f"{row['seconds']:6.2f} s  {row.get('error', '')}", flush=True)
    failed = [f"{r['kernel']} (pages of {r['page_size']})" for r in rows if not r["ok"]]
    summary = f"{len(rows) - len(failed)}/{len(rows)} compiled" + (f"; FAILED: {', '.join(failed)}" if failed else "")
    return {"ok": not failed, "summary": summary, "rows": rows}
