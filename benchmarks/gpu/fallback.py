"""Step 6: the fallback chain: the engine's attention backends (`jaxserve.attention.make_attention`) on decode
steps, the `xla` path (the fallback) against the Pallas one, through the same API the model calls.

Inputs, timing and bytes are those of step 5 (decode.py), with at most FALLBACK_CALLS calls a dispatch:
with step 5's 32 the first dispatches (compiles of 32 inlined calls) took 12-31 s each on the H200
(2026-12-04) and used up the step's limit before its fourth shape. Each backend's first output is
compared with a float32 reference on two rows. The decode kernel's own time from step 5 (its automatic
settings) is printed next to them where step 5 measured the shape.
"""

from __future__ import annotations

import dataclasses
import traceback

import jax.numpy as jnp
import numpy as np

from benchmarks.gpu.common import rotation, time_calls
from benchmarks.gpu.config import Model
from benchmarks.gpu.decode import bytes_moved, decode_inputs, is_right, kv_bytes, spot_error
from benchmarks.gpu.step import Step, error_text

FALLBACK_CALLS = 8  # calls a dispatch; 8 of the Pallas backend's >= 84 us still make a dispatch of >= 0.7 ms


def model_spec(model: Model):
    """Llama-3.1-8B's ModelSpec with the plan's heads and head dim (the backends read head_dim and the window)."""
    from jaxserve.bench.models import SHAPES, hf_config
    from jaxserve.model.registry import spec_from_hf_config

    spec = spec_from_hf_config(hf_config(SHAPES["llama-3.1-8b"]))
    return dataclasses.replace(spec, num_heads=model.heads, num_kv_heads=model.kv_heads, head_dim=model.head_dim,
                               hidden_size=model.heads * model.head_dim)


def decode_batch(inputs: dict, page_size: int):
    """The BatchDescriptor of a decode step: one token per row at position `seq_len - 1`."""
    from jaxserve.batch.builder import padded_batch_arrays
    from jaxserve.batch.descriptor import BatchDescriptor

    page_table = np.asarray(inputs["page_table"])  # (B, W)
    seq_lens = np.asarray(inputs["seq_lens"])  # (B,)
    batch, width = page_table.shape
    arrays = padded_batch_arrays(batch, batch, width, page_size)
    last = seq_lens - 1  # (B,) position of each row's token
    arrays["positions"][:] = last
    arrays["slot_mapping"][:] = page_table[np.arange(batch), last // page_size] * page_size + last % page_size
    arrays["query_start_loc"][:] = np.arange(batch + 1)
    arrays["seq_lens"][:] = seq_lens
    arrays["page_table"][:] = page_table
    arrays["logits_indices"][:] = np.arange(batch)
    arrays["num_seqs"] = np.asarray(batch, np.int32)
    return BatchDescriptor(**{name: jnp.asarray(value) for name, value in arrays.items()})


def backend_names(interpret: bool) -> tuple[str, str]:
    """The fallback and the Pallas backend, as `attention_backend` names."""
    return "xla", "pallas-interpret" if interpret else "pallas"


def measure_backend(name: str, inputs: dict, batch, num_sets: int, step: Step) -> dict:
    """Per-call time and spot error of one backend's attention on a decode step."""
    from jaxserve.attention import make_attention
    from jaxserve.attention.base import LayerAttention
    from jaxserve.sharding import make_mesh

    spec = model_spec(step.plan.model)
    backend = make_attention(spec, name, make_mesh(1), step.plan.page_size)
    how = LayerAttention(spec.head_dim**-0.5)
    if backend.layout != "split":
        raise ValueError(f"backend {backend.name} stores the {backend.layout} layout; this step builds split K/V")

    def call(q, layer, ops):
        return backend.attention(q, (ops["k"], ops["v"]), layer, ops["batch"], how)  # (B, Hq, D)

    timing = time_calls(call, inputs["qs"], {"k": inputs["k"], "v": inputs["v"], "batch": batch}, num_sets,
                        step.plan.decode_repeats)
    timing["spot_error"] = spot_error(timing.pop("output"), inputs)
    return timing


def kernel_us(step: Step, batch: int, context: int) -> float | None:
    """Step 5's time of the decode kernel at its default settings (auto splits) on this shape, or None."""
    for row in (step.load("decode") or {}).get("rows", []):
        if (row["batch"], row["context"]) == (batch, context) and step.plan.is_default(row) and "us" in row:
            return row["us"]
    return None


def measure_shape(batch_size: int, context: int, step: Step) -> list[dict]:
    """Both backends on one decode shape; one row each, printed as measured."""
    plan, page_size = step.plan, step.plan.page_size
    num_sets, num_calls = rotation(kv_bytes(batch_size, context, plan.model, page_size), plan.interpret,
                                   FALLBACK_CALLS)
    inputs = decode_inputs(batch_size, context, plan.model, page_size, num_sets, num_calls,
                           seed=step.seed + batch_size * 100003 + context)
    batch = decode_batch(inputs, page_size)
    moved = bytes_moved(batch_size, context, plan.model, page_size)
    rows = []
    for name in backend_names(plan.interpret):
        row = {"backend": name, "batch": batch_size, "context": context, "bytes": moved}
        if step.out_of_time():
            row["skipped"] = "out of time"
        else:
            try:
                row.update(measure_backend(name, inputs, batch, num_sets, step))
                row["gb_per_s"] = moved / (row["us"] * 1e-6) / 1e9
            except Exception as exc:  # noqa: BLE001 - the fallback must not stop the script
                traceback.print_exc(limit=-4)
                row["error"] = error_text(exc)
        rows.append(row)
        head = f"attention backend {name:<16} B={batch_size:<3} ctx={context:<6}"
        if "us" in row:
            print(f"{head} {row['us']:9.1f} us {row['gb_per_s']:7.0f} GB/s  spot err {row['spot_error']:.1e}  "
                  f"(first dispatch {row['first_dispatch_s']:.1f} s)", flush=True)
        else:
            print(f"{head} {row.get('skipped') or 'FAIL ' + row.get('error', '')}", flush=True)
    return rows


def us_text(us: float | None) -> str:
    """A time in microseconds, or '-' when not measured."""
    return "-" if us is None else f"{us:.1f} us"


def comparison(rows: list[dict], step: Step) -> list[dict]:
    """Per shape: the xla backend's time against the Pallas backend's and the bare kernel's (step 5)."""
    fallback, pallas = backend_names(step.plan.interpret)
    shapes = sorted({(row["batch"], row["context"]) for row in rows})
    lines = []
    for batch, context in shapes:
        times = {row["backend"]: row.get("us") for row in rows if (row["batch"], row["context"]) == (batch, context)}
        line = {"batch": batch, "context": context, "xla_us": times.get(fallback), "pallas_us": times.get(pallas),
                "kernel_us": kernel_us(step, batch, context)}
        if line["xla_us"] and line["pallas_us"]:
            line["xla_over_pallas"] = line["xla_us"] / line["pallas_us"]
        lines.append(line)
        ratio = f"; xla / pallas = {line['xla_over_pallas']:.2f}" if "xla_over_pallas" in line else ""
        print(f"B={batch} ctx={context}: xla {us_text(line['xla_us'])}, {pallas} backend {us_text(line['pallas_us'])}, "
              f"decode kernel alone (step 5, defaults) {us_text(line['kernel_us'])}{ratio}")
    return lines


def run(step: Step) -> dict:
    """Step 6: both backends on every fallback shape; ok when the xla path ran and was right everywhere."""
    rows = []
    for context in step.plan.fallback_contexts:
        for batch in step.plan.fallback_batches:
            try:
                rows += measure_shape(batch, context, step)
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory making the inputs
                traceback.print_exc(limit=-4)
                rows.append({"backend": "inputs", "batch": batch, "context": context, "error": error_text(exc)})
                print(f"fallback B={batch} ctx={context}: FAIL {rows[-1]['error']}", flush=True)
    compared = comparison(rows, step)
    xla_rows = [row for row in rows if row["backend"] == "xla"]
    right = [row for row in xla_rows if is_right(row)]
    ratios = [line["xla_over_pallas"] for line in compared if "xla_over_pallas" in line]
    summary = (f"xla path right on {len(right)}/{len(xla_rows)} shapes"
               + (f"; xla / pallas time {min(ratios):.2f}-{max(ratios):.2f}x" if ratios else ""))
    return {"ok": bool(xla_rows) and len(right) == len(xla_rows), "summary": summary, "rows": rows,
            "comparison": compared}
