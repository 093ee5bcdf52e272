"""What the measuring steps share: timing by dispatch, random pools, relative errors.

Timing: one jitted function makes `calls` calls per dispatch (each on its own query and its own
copy of the pool, so no call can be merged with another or find its pages in the L2), timed with a
host clock around `jax.block_until_ready`; a call's time is the median dispatch over `calls`, so
launch and sync overhead are spread over the calls.
"""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

ROTATE_BYTES = 200e6  # one pass over a step's pool copies reads at least this (4x the H200's 50 MB L2)
MAX_SETS = 128  # at most this many pool copies
DISPATCH_BYTES = 4e9  # a timed dispatch makes calls that move at least this (~1 ms at 4 TB/s) ...
MAX_CALLS = 32  # ... but at most this many calls (each is inlined into the dispatch's program)
CHUNK_PAGES = 4096  # random pools are drawn this many pages at a time (each draw < 2^31 elements)
BF16_TOLERANCE = 1e-2  # relative error a bfloat16 kernel output may have against a float32 reference


def relative_error(out, ref) -> float:
    """‖out - ref‖ / ‖ref‖ in float64; NaN when out has a non-finite value."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("nan")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def rotation(bytes_per_call: float, interpret: bool, max_calls: int = MAX_CALLS) -> tuple[int, int]:
    """(pool copies, calls per dispatch) for calls that each read `bytes_per_call` of pool, at most
    `max_calls` calls a dispatch."""
    if interpret:
        return 2, 2
    # at least 2 copies, so no two calls in a row read the same pages
    num_sets = max(2, min(MAX_SETS, math.ceil(ROTATE_BYTES / bytes_per_call)))
    num_calls = min(max_calls, max(2, math.ceil(DISPATCH_BYTES / bytes_per_call)))
    return num_sets, num_calls


def time_dispatches(fn, args_for, repeats: int, warmup: int = 2) -> tuple[list[float], float, object]:
    """Host-clock seconds of `repeats` dispatches `fn(*args_for(d))` (each synced), after `warmup`
    untimed ones; `d` counts all dispatches from 0.

    Returns (samples, seconds of the first dispatch incl. compile, the first dispatch's outputs)."""
    start = time.perf_counter()
    first = jax.block_until_ready(fn(*args_for(0)))
    first_s = time.perf_counter() - start
    for d in range(1, warmup):
        jax.block_until_ready(fn(*args_for(d)))
    samples = []
    for d in range(warmup, warmup + repeats):
        fn_args = args_for(d)
        start = time.perf_counter()
        jax.block_until_ready(fn(*fn_args))
        samples.append(time.perf_counter() - start)
    return samples, first_s, first


def repeated_calls(call, num_calls: int, num_sets: int):
    """One jitted `run(qs, operands, first)` making `num_calls` calls `call(qs[i], layer, operands)`, call
    i on pool layer `(first + i) % num_sets` (`first` is traced, so dispatches go on where the last
    stopped). Every output is returned, so none is dropped; each call has its own query, so none is merged."""
    inner = jax.jit(call)

    @jax.jit
    def run(qs, operands, first):
        return tuple(inner(qs[i], (first + i) % num_sets, operands) for i in range(num_calls))  # N outputs

    return run


def time_calls(call, qs: jax.Array, operands, num_sets: int, repeats: int) -> dict:
    """Per-call time of `call(q, layer, operands)` over `qs.shape[0]` calls a dispatch (see the module
    docstring). Returns us (median), us_min, us_max, first_dispatch_s and `output` (call 0's)."""
    num_calls = qs.shape[0]
    run = repeated_calls(call, num_calls, num_sets)
    samples, first_s, outputs = time_dispatches(
        run, lambda d: (qs, operands, jnp.int32(d * num_calls % num_sets)), repeats)
    return per_call(samples, first_s, outputs[0], num_calls)


def per_call(samples: list[float], first_s: float, output, num_calls: int) -> dict:
    """A call's time from timed dispatches of `num_calls` calls each: us (median), us_min, us_max, first_dispatch_s,
    calls, and `output` (the first call's)."""
    return {"us": float(np.median(samples)) / num_calls * 1e6, "us_min": min(samples) / num_calls * 1e6,
            "us_max": max(samples) / num_calls * 1e6, "first_dispatch_s": first_s, "calls": num_calls,
            "output": output}


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def random_pool(key: jax.Array, num_layers: int, num_pages: int, page_shape: tuple, dtype) -> jax.Array:
    """Random normal `(L, P', S, Hkv, D)` pool with P' >= num_pages (rounded up to CHUNK_PAGES),
    drawn CHUNK_PAGES pages at a time so no single draw has more than 2^31 elements."""
    chunk = min(num_pages, CHUNK_PAGES)
    num_chunks = -(-num_pages // chunk)
    keys = jax.random.split(key, num_layers * num_chunks)  # (L * C,)
    pool = jax.lax.map(lambda k: jax.random.normal(k, (chunk, *page_shape), dtype), keys)  # (L * C, chunk, S, Hkv, D)
    return pool.reshape(num_layers, num_chunks * chunk, *page_shape)


def zero_kv_pool(shapes, dtype, mesh) -> tuple[jax.Array, ...]:
    """The KV pool's arrays (each (L, P, S, Hkv, D) of `shapes`), zeros made on the devices in the engine's KV
    sharding: a forward returns its caches in that sharding, so caches made otherwise (plain jnp.zeros) would make
    its second call trace and compile again (and a device_put of a pool this size could need it twice in memory)."""
    from jax.sharding import NamedSharding

    from jaxserve.sharding import KV_CACHE_SPEC

    sharding = NamedSharding(mesh, KV_CACHE_SPEC)
    return tuple(jax.jit(lambda shape=shape: jnp.zeros(shape, dtype), out_shardings=sharding)() for shape in shapes)
