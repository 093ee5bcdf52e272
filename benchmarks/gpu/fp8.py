"""Step 9: a whole decode step at the Llama-3.1-8B shape (32 layers, random weights) with bf16 weights and KV
cache, with fp8 weights, and with fp8 weights and an fp8 KV cache (issue 16): time per step and its ratio to
bf16's.

A decode step reads every weight once and each row's KV once; fp8 stores both in half the bytes, so at a batch
and context where those reads dominate the step should come close to half of bf16's. The forward is the
engine's own (`make_forward` over the `auto` attention backend, the XLA path in the tiny plan; the cache dtype
the mode's), jitted with the pool donated as the engine does, over B rows at context C with pages of their
own. The weights are dequantized in the matmul's operand (model/quantize.py: the fp8 weight cast to bf16), so
this measures what the engine serves today, not a native fp8 matmul.
"""

from __future__ import annotations

import time
import traceback

import numpy as np

from benchmarks.gpu.common import zero_kv_pool
from benchmarks.gpu.fallback import decode_batch
from benchmarks.gpu.step import Step, error_text

MODES = (("bf16", "none", "auto"), ("fp8 weights", "fp8", "auto"), ("fp8 weights + fp8 KV", "fp8", "fp8"))


def run(step: Step) -> dict:
    """Time each mode's decode step; ok when every mode ran."""
    rows = []
    for label, quantization, kv_cache_dtype in MODES:
        if step.out_of_time():
            rows.append({"mode": label, "skipped": "out of time"})
            print(f"fp8 step {label:<22} skipped: out of time", flush=True)
            continue
        try:
            row = {"mode": label, **measure(step, quantization, kv_cache_dtype)}
        except Exception as exc:  # noqa: BLE001 - one mode failing must not hide the others
            traceback.print_exc(limit=-4)
            row = {"mode": label, "error": error_text(exc)}
        rows.append(row)
        if "ms" in row:
            row["over_bf16"] = row["ms"] / rows[0]["ms"] if "ms" in rows[0] else None
            ratio = "" if row["over_bf16"] is None else f"  {row['over_bf16']:.2f}x bf16's time"
            print(f"fp8 step {label:<22} {row['ms']:8.2f} ms (best {row['ms_best']:.2f})  weights "
                  f"{row['weight_gib']:.2f} GiB  KV read {row['kv_gib']:.2f} GiB  {row['gb_per_s']:.0f} GB/s{ratio}",
                  flush=True)
        else:
            print(f"fp8 step {label:<22} FAILED {row['error']}", flush=True)
    done = [row for row in rows if "ms" in row]
    summary = "; ".join(f"{row['mode']} {row['ms']:.2f} ms" for row in done) or "nothing measured"
    return {"ok": len(done) == len(MODES), "summary": summary, "rows": rows}


def measure(step: Step, quantization: str, kv_cache_dtype: str) -> dict:
    """Mean and best ms of the plan's decode step in one mode, with the bytes it reads."""
    import jax

    from jaxserve.attention import make_attention
    from jaxserve.bench.models import SHAPES, hf_config
    from jaxserve.config import EngineConfig
    from jaxserve.attention import fp8
    from jaxserve.model.checkpoint import load_weights
    from jaxserve.model.quantize import weight_bytes
    from jaxserve.model.registry import model_for
    from jaxserve.sharding import make_mesh
    from jaxserve.model.registry import spec_from_hf_config

    plan, options = step.plan, step.plan.fp8
    page_size, rows, context = plan.page_size, options["batch"], options["context"]
    spec = spec_from_hf_config(hf_config(SHAPES[options["model_shape"]]))
    mesh = make_mesh(1)
    config = EngineConfig(model=options["model_shape"], load_format="dummy", dtype=plan.model.dtype,
                          quantization=quantization, kv_cache_dtype=kv_cache_dtype, seed=step.seed)
    params, dtype = load_weights(config, config.model_config.model, spec, mesh, spec.num_kv_heads)
    cache_dtype = fp8.cache_dtype(kv_cache_dtype, dtype)
    backend = make_attention(spec, "xla" if plan.tiny else "auto", mesh, page_size, cache_dtype=cache_dtype)
    width = -(-context // page_size)
    shapes = backend.cache_shapes(spec.num_layers, 1 + rows * width, page_size, spec.num_kv_heads, spec.head_dim)
    caches = zero_kv_pool(shapes, cache_dtype, mesh)  # each (L, P, S, Hkv, D)
    page_table = 1 + np.arange(rows * width, dtype=np.int32).reshape(rows, width)  # (B, W)
    batch = decode_batch({"page_table": page_table, "seq_lens": np.full(rows, context, np.int32)}, page_size)
    forward = model_for(spec.architecture).make_forward(spec, backend.attention, backend.write_kv, mesh)
    forward = jax.jit(forward, donate_argnums=1)
    samples = []
    for i in range(options["warmup"] + options["repeats"]):
        start = time.perf_counter()
        logits, _, caches = forward(params, caches, batch)
        logits.block_until_ready()
        if i >= options["warmup"]:
            samples.append(time.perf_counter() - start)
    kv_bytes = rows * context * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * cache_dtype.itemsize
    mean = float(np.mean(samples))
    return {"ms": mean * 1e3, "ms_best": min(samples) * 1e3, "weight_gib": weight_bytes(params) / 2**30,
            "kv_gib": kv_bytes / 2**30, "gb_per_s": (weight_bytes(params) + kv_bytes) / mean / 1e9}
