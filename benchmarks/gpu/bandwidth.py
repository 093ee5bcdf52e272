"""Step 4: device-to-device copy bandwidth, the ceiling the decode kernel is measured against.

An `add` variant times a jitted `x + 1` over a buffer, `chain` times per dispatch: every call reads the
previous call's output and an optimization barrier keeps XLA from fusing the calls into one, so a
dispatch moves `2 * size * chain` bytes (read + written) and its launch and sync overhead is spread
over `chain` calls. A `copy` variant times a jitted copy (XLA copies the argument into a fresh output
buffer: a device-to-device copy, what `cudaMemcpy` benchmarks measure), `2 * size` bytes a dispatch.
Variants also differ in element type (the same bytes viewed as bfloat16, float32 or uint32) and buffer
size. The best variant is the copy bandwidth; every variant is printed.
"""

from __future__ import annotations

import functools
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu.common import time_dispatches
from benchmarks.gpu.config import CopyVariant
from benchmarks.gpu.step import Step, error_text

ROW = 1024  # buffers are (N, ROW) 32-bit words, so no axis has 2^31 elements


@functools.partial(jax.jit, static_argnums=(0, 1))
def make_buffer(dtype_name: str, mib: int) -> jax.Array:
    """A buffer of `mib` MiB holding distinct 32-bit words, viewed as `dtype_name`."""
    rows = mib * 2**20 // (4 * ROW)
    words = (jnp.arange(rows, dtype=jnp.uint32)[:, None] * ROW
             + jnp.arange(ROW, dtype=jnp.uint32)[None, :])  # (N, ROW) uint32
    if dtype_name == "uint32":
        return words
    view = jax.lax.bitcast_convert_type(words, jnp.dtype(dtype_name))  # (N, ROW) or (N, ROW, 2)
    return view.reshape(rows, -1)  # (N, ROW * 4 / itemsize)


def add_one_chain(chain: int):
    """Jitted `x -> x + 1`, `chain` times in a row, each result materialised (an optimization barrier)."""

    @jax.jit
    def run(x):
        for _ in range(chain):
            x = jax.lax.optimization_barrier(x + jnp.asarray(1, x.dtype))  # (N, M)
        return x

    return run


@jax.jit
def copy(x):
    """A fresh copy of x."""
    return x.copy()  # (N, M)


def measure(variant: CopyVariant, repeats: int) -> dict:
    """Bandwidth of one variant: bytes read + written over the median dispatch."""
    x = make_buffer(variant.dtype, variant.mib)  # (N, M)
    run = add_one_chain(variant.chain) if variant.kind == "add" else copy
    samples, _, first = time_dispatches(run, lambda d: (x,), repeats)
    if first.unsafe_buffer_pointer() == x.unsafe_buffer_pointer():
        raise RuntimeError("the output is the input's buffer: nothing was copied")
    moved = 2 * x.size * x.dtype.itemsize * variant.chain
    median = float(np.median(samples))
    return {"variant": variant.name, "bytes": moved, "seconds": samples, "median_s": median,
            "gb_per_s": moved / median / 1e9}


def run(step: Step) -> dict:
    """Step 4: every variant of the plan; the best is the copy bandwidth."""
    rows = []
    for variant in step.plan.copy_variants:
        if step.out_of_time():
            print(f"bandwidth {variant.name:<28} skipped: out of time")
            continue
        try:
            row = measure(variant, step.plan.copy_repeats)
            print(f"bandwidth {variant.name:<28} {row['gb_per_s']:8.0f} GB/s  ({row['bytes'] / 1e9:.2f} GB read + "
                  f"written per dispatch, median {row['median_s'] * 1e3:.3f} ms of {len(row['seconds'])})", flush=True)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: go on with the other variants
            traceback.print_exc(limit=-4)
            row = {"variant": variant.name, "error": error_text(exc)}
            print(f"bandwidth {variant.name:<28} FAIL {row['error']}", flush=True)
        rows.append(row)
    measured = [row for row in rows if "gb_per_s" in row]
    if not measured:
        return {"ok": False, "summary": "no variant measured", "rows": rows}
    best = max(measured, key=lambda row: row["gb_per_s"])
    return {"ok": True, "summary": f"copy bandwidth {best['gb_per_s']:.0f} GB/s ({best['variant']}, the best of "
                                   f"{len(measured)})", "gb_per_s": best["gb_per_s"], "variant": best["variant"],
            "rows": rows}
