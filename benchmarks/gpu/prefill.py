"""Step 7: a prefill mix: the ragged kernel on a step of prefill chunks, in TFLOP/s, against cuDNN's causal
attention (`jax.nn.dot_product_attention(..., implementation="cudnn", is_causal=True)`) as the ceiling,
and the engine's `xla` attention backend (the fallback) on the same step.

A step is `chunks` rows of `n` new tokens each after `p` cached tokens, their pages scattered over the
pool. A chunk's token i sees p + i + 1 keys, so the step does 4 x Hq x D x rows x (n p + n (n + 1) / 2)
FLOPs (2 for QK^T and 2 for PV per query head, key and channel). cuDNN's causal mask starts at the first
key, so its ceiling runs each row's whole prompt (p + n queries, causal) on contiguous q/k/v made from
the same pages: 4 x Hq x D x rows x L (L + 1) / 2 FLOPs for L = p + n. Its last n queries are the chunk's,
so they also check the ragged kernel's output (`err vs cudnn`). In the tiny plan (no GPU) the ceiling
runs implementation="xla" instead.
"""

from __future__ import annotations

import functools
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu.common import BF16_TOLERANCE, random_pool, relative_error, time_calls
from benchmarks.gpu.config import Plan
from benchmarks.gpu.step import Step, error_text
from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention

CALLS, SETS = 8, 2  # calls per dispatch; pool copies (prefill is compute-bound: few are enough)


def prefill_inputs(plan: Plan, prefix: int, seed: int) -> dict:
    """Pool, page table and queries of one prefill step, and the contiguous q/k/v of each row's whole prompt."""
    model, page_size = plan.model, plan.page_size
    dtype = jnp.dtype(model.dtype)
    rows, new = plan.prefill_chunks, plan.prefill_chunk_len
    total = prefix + new  # tokens of each row after the step
    width = -(-total // page_size)
    key_q, key_k, key_v = jax.random.split(jax.random.key(seed), 3)
    page_shape = (page_size, model.kv_heads, model.head_dim)
    page_table = jnp.asarray(1 + np.random.default_rng(seed).permutation(rows * width).reshape(rows, width),
                             jnp.int32)  # (R, W)
    k = random_pool(key_k, SETS, 1 + rows * width, page_shape, dtype)  # (sets, P', S, Hkv, D)
    v = random_pool(key_v, SETS, 1 + rows * width, page_shape, dtype)  # (sets, P', S, Hkv, D)
    # whole prompts: (N, R, L, Hq, D) queries; a call's chunk queries are the last n of each row
    prompts_q = jax.random.normal(key_q, (CALLS, rows, total, model.heads, model.head_dim), dtype)
    dense = [cache[0, page_table].reshape(rows, width * page_size, *page_shape[1:])[:, :total]
             for cache in (k, v)]  # (R, L, Hkv, D) each: layer 0's pages, in order
    return {
        "k": k, "v": v, "page_table": page_table,
        "qs": prompts_q[:, :, prefix:].reshape(CALLS, rows * new, model.heads, model.head_dim),  # (N, T, Hq, D)
        "query_start_loc": jnp.arange(rows + 1, dtype=jnp.int32) * new,  # (R + 1,)
        "seq_lens": jnp.full((rows,), total, jnp.int32),  # (R,)
        "positions": jnp.tile(prefix + jnp.arange(new, dtype=jnp.int32), rows),  # (T,)
        "prompts_q": prompts_q, "dense_k": dense[0], "dense_v": dense[1],
    }


def flops(plan: Plan, queries_per_row: int, keys_before: int) -> float:
    """FLOPs of causal attention where query i of a row sees keys_before + i + 1 keys."""
    model, n = plan.model, queries_per_row
    return 4.0 * model.heads * model.head_dim * plan.prefill_chunks * (n * keys_before + n * (n + 1) / 2)


def ragged_call(plan: Plan):
    """`call(q, layer, ops)` running the ragged kernel on the step's pages."""
    kernel = functools.partial(ragged_paged_attention, sm_scale=plan.model.head_dim ** -0.5,
                               interpret=plan.interpret)

    def call(q, layer, ops):
        return kernel(q, ops["k"], ops["v"], layer, ops["query_start_loc"], ops["seq_lens"], ops["page_table"])

    return call  # (T, Hq, D)


def dense_call(plan: Plan):
    """`call(q, layer, ops)` running dot_product_attention (cuDNN on a GPU) on whole prompts, causal."""
    implementation = "xla" if plan.interpret else "cudnn"

    def call(q, layer, ops):
        del layer  # contiguous k/v: one copy (compute-bound; a 42 MB copy fits the L2 anyway)
        return jax.nn.dot_product_attention(q, ops["dense_k"], ops["dense_v"], is_causal=True,
                                            implementation=implementation)  # (R, L, Hq, D)

    return call


def xla_backend_call(plan: Plan, inputs: dict):
    """`call(q, layer, ops)` through the engine's `xla` attention backend (the fallback)."""
    from benchmarks.gpu.fallback import model_spec
    from jaxserve.attention import make_attention
    from jaxserve.attention.base import LayerAttention
    from jaxserve.batch.builder import padded_batch_arrays
    from jaxserve.batch.descriptor import BatchDescriptor
    from jaxserve.sharding import make_mesh

    page_size = plan.page_size
    spec = model_spec(plan.model)
    backend = make_attention(spec, "xla", make_mesh(1), page_size)
    how = LayerAttention(spec.head_dim**-0.5)
    rows, width = inputs["page_table"].shape
    tokens = rows * plan.prefill_chunk_len
    arrays = padded_batch_arrays(tokens, rows, width, page_size)
    arrays.update(positions=np.asarray(inputs["positions"]), query_start_loc=np.asarray(inputs["query_start_loc"]),
                  seq_lens=np.asarray(inputs["seq_lens"]), page_table=np.asarray(inputs["page_table"]),
                  logits_indices=np.asarray(inputs["query_start_loc"][1:] - 1), num_seqs=np.asarray(rows, np.int32))
    row_of_token = np.repeat(np.arange(rows), plan.prefill_chunk_len)  # (T,)
    positions = arrays["positions"]
    arrays["slot_mapping"] = (arrays["page_table"][row_of_token, positions // page_size] * page_size
                              + positions % page_size).astype(np.int32)  # (T,)
    batch = BatchDescriptor(**{name: jnp.asarray(value) for name, value in arrays.items()})

    def call(q, layer, ops):
        return backend.attention(q, (ops["k"], ops["v"]), layer, batch, how)  # (T, Hq, D)

    return call


def measure_prefix(prefix: int, step: Step) -> list[dict]:
    """The dense ceiling, the ragged kernel and the xla backend on one prefill step; one row each, printed as
    measured. The last two are checked against the dense output of the chunks' queries."""
    plan = step.plan
    inputs = prefill_inputs(plan, prefix, seed=step.seed + prefix)
    new, total = plan.prefill_chunk_len, prefix + plan.prefill_chunk_len
    dense_name = "dot_product_attention " + ("xla (no GPU)" if plan.interpret else "cudnn")
    candidates = [  # the dense one first: the others are checked against it
        (dense_name, lambda: dense_call(plan), inputs["prompts_q"], flops(plan, total, 0)),
        ("ragged kernel", lambda: ragged_call(plan), inputs["qs"], flops(plan, new, prefix)),
        ("xla backend (fallback)", lambda: xla_backend_call(plan, inputs), inputs["qs"], flops(plan, new, prefix)),
    ]
    dense = None  # (R, n, Hq, D) float32: the dense attention's output for the chunks' queries
    results = []
    for name, make_call, qs, work in candidates:
        row = {"name": name, "prefix": prefix, "chunks": plan.prefill_chunks, "chunk_len": new, "flops": work}
        if step.out_of_time():
            row["skipped"] = "out of time"
        else:
            try:
                row.update(time_calls(make_call(), qs, inputs, SETS, plan.decode_repeats))
                out = np.asarray(row.pop("output"), np.float32)  # (R, L, Hq, D) dense, else (T, Hq, D)
                row["tflop_per_s"] = work / (row["us"] * 1e-6) / 1e12
                if name == dense_name:
                    dense = out[:, prefix:]
                elif dense is not None:
                    row["error_vs_dense"] = relative_error(out.reshape(dense.shape), dense)
            except Exception as exc:  # noqa: BLE001 - e.g. cuDNN not taking the shape: record, go on
                traceback.print_exc(limit=-4)
                row["error"] = error_text(exc)
        results.append(row)
        print(describe(row), flush=True)
    return results


def describe(row: dict) -> str:
    """One log line of a prefill measurement."""
    head = f"prefill {row['chunks']} x {row['chunk_len']} tokens after {row['prefix']:<5} {row['name']:<32}"
    if "us" not in row:
        return f"{head} {row.get('skipped') or 'FAIL ' + row.get('error', '')}"
    check = f"  err vs dense {row['error_vs_dense']:.1e}" if "error_vs_dense" in row else ""
    return (f"{head} {row['us']:9.1f} us {row['tflop_per_s']:7.1f} TFLOP/s{check}  "
            f"(first dispatch {row['first_dispatch_s']:.1f} s)")


def run(step: Step) -> dict:
    """Step 7: every prefix of the plan; ok when the ragged kernel ran and matched the dense attention."""
    rows = []
    for prefix in step.plan.prefill_prefixes:
        try:
            rows += measure_prefix(prefix, step)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory making the inputs
            traceback.print_exc(limit=-4)
            rows.append({"name": "inputs", "prefix": prefix, "error": error_text(exc)})
            print(f"prefill after {prefix}: FAIL {rows[-1]['error']}", flush=True)
    ragged = [row for row in rows if row["name"] == "ragged kernel"]
    right = [row for row in ragged if row.get("error_vs_dense", float("nan")) < BF16_TOLERANCE]
    longest = max(step.plan.prefill_prefixes)
    rates = ", ".join(f"{row['name']} {row['tflop_per_s']:.1f}" for row in rows
                      if row["prefix"] == longest and "tflop_per_s" in row)
    summary = f"ragged kernel right on {len(right)}/{len(ragged)}; TFLOP/s after {longest}: {rates or 'none'}"
    return {"ok": bool(ragged) and len(right) == len(ragged), "summary": summary, "rows": rows}
