"""cuDNN's fused attention for fresh prompts on a GPU, in front of the tiled XLA path.

A row whose chunk starts at position 0 (a fresh prompt: no cached prefix) with more than one query token
attends only to its own tokens. Laid end to end as the step flattens them, all such rows make one causal
attention over the step's T tokens, restricted to same-row pairs by a (T, T) mask: that is one call of
`jax.nn.dot_product_attention(..., is_causal=True, mask=...)`, which cuDNN runs as flash attention (GQA
heads; a sliding window as its left window), skipping the blocks above the diagonal. The block is square, so
its causal diagonal is the same whether an implementation aligns it top-left or bottom-right: the same glue
is exact through XLA's implementation (the CPU tests) and cuDNN's.

The step's other tokens (decodes, chunks continuing a cached prefix), at most R of them, run through the
tiled path, compacted. A step with no fresh row, or with more than R other tokens, runs the tiled path
whole (`lax.cond`: both are compiled). cuDNN unusable at trace time (no cuDNN, float32, an unsupported head
dim) or a bucket whose mask would exceed `MASK_BYTES` means the tiled path alone, with one warning.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxserve.batch.descriptor import BatchDescriptor
from pallas_kernels.tile_math import from_cache

logger = logging.getLogger("jaxserve")

MASK_BYTES = 512 << 20  # the (T, T) mask as the additive bias cuDNN reads: T <= 16384 tokens

TiledFn = Callable[..., jax.Array]  # (q, k_cache, v_cache, layer, positions, token_rows, page_table) -> out


def prefill_or_tiled(q, k_cache, v_cache, layer, positions, token_rows, batch: BatchDescriptor, *, tiled: TiledFn,
                     sm_scale: float, sliding_window: int | None, implementation: str) -> jax.Array:
    """Fresh prompts through `implementation`'s dense attention and the rest through `tiled`, or the whole
    step through `tiled` (see the module docstring)."""
    # q: (T, Hq, D); k_cache, v_cache: (L, P, S, Hkv, D); positions (-1 for padding), token_rows: (T,) int32
    num_rows = batch.page_table.shape[0]
    whole = functools.partial(tiled, q, k_cache, v_cache, layer, positions, token_rows, batch.page_table)
    dense = functools.partial(jax.nn.dot_product_attention, scale=sm_scale, is_causal=True,
                              local_window_size=None if sliding_window is None else (sliding_window - 1, 0),
                              implementation=implementation)
    problem = _dense_problem(dense, q, k_cache)
    if problem:
        _warn_once(f"prefill attention through {implementation} is unavailable ({problem}); using the tiled XLA path")
        return whole()
    fresh = _fresh_tokens(batch.query_start_loc, positions, token_rows)  # (T,)
    rest = jnp.sum((positions >= 0) & ~fresh)  # () real tokens left to the tiled path
    split = functools.partial(_split_step, q, k_cache, v_cache, layer, positions, token_rows, batch.page_table,
                              fresh, tiled=tiled, dense=dense)
    return jax.lax.cond(jnp.any(fresh) & (rest <= num_rows), split, whole)


def _fresh_tokens(query_start_loc: jax.Array, positions: jax.Array, token_rows: jax.Array) -> jax.Array:
    """The tokens of rows with more than one query token whose first one is at position 0."""
    # query_start_loc: (R + 1,) int32; positions (-1 for padding), token_rows: (T,) int32
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # (R,)
    first = positions[jnp.minimum(query_start_loc[:-1], positions.shape[0] - 1)]  # (R,)
    fresh_rows = (query_lens > 1) & (first == 0)  # (R,)
    return (positions >= 0) & fresh_rows[token_rows]


def _split_step(q, k_cache, v_cache, layer, positions, token_rows, page_table, fresh, *, tiled, dense):
    """The fresh tokens through `dense`, the others (at most R) through `tiled`; padded tokens get zeros."""
    # q: (T, Hq, D); positions, token_rows: (T,) int32; page_table: (R, W) int32; fresh: (T,) bool
    num_tokens, num_rows = q.shape[0], page_table.shape[0]
    out = _fresh_attention(q, k_cache, v_cache, layer, positions, token_rows, page_table, fresh, dense)  # (T, Hq, D)
    out = jnp.where(fresh[:, None, None], out, 0)
    picked = jnp.flatnonzero((positions >= 0) & ~fresh, size=num_rows, fill_value=num_tokens)  # (R,) T: unused
    safe = jnp.minimum(picked, num_tokens - 1)  # (R,)
    rest_positions = jnp.where(picked < num_tokens, positions[safe], -1)  # (R,)
    rest_out = tiled(q[safe], k_cache, v_cache, layer, rest_positions, token_rows[safe], page_table)  # (R, Hq, D)
    return out.at[picked].set(rest_out, mode="drop")


def _fresh_attention(q, k_cache, v_cache, layer, positions, token_rows, page_table, fresh, dense):
    """Causal attention of every fresh token over its own row's tokens, as one masked (T, T) dense call.

    A fresh row's keys are its own query tokens (it starts at position 0), read back from the cache."""
    # q: (T, Hq, D); k_cache, v_cache: (L, P, S, Hkv, D); fresh: (T,) bool
    page_size, width = k_cache.shape[2], page_table.shape[1]
    pages = page_table[token_rows, jnp.clip(positions // page_size, 0, width - 1)]  # (T,)
    slots = positions % page_size  # (T,)
    k = jnp.where(fresh[:, None, None], k_cache[layer, pages, slots], 0)  # (T, Hkv, D): others may hold NaN
    v = jnp.where(fresh[:, None, None], v_cache[layer, pages, slots], 0)  # (T, Hkv, D)
    same_row = (token_rows[:, None] == token_rows[None, :]) & fresh[None, :]  # (T, T) query x key
    k, v = from_cache(k, q.dtype), from_cache(v, q.dtype)  # an fp8 cache's values in the queries' dtype
    return dense(q[None], k[None], v[None], mask=same_row[None, None])[0]  # (T, Hq, D)


def _dense_problem(dense, q, k_cache) -> str | None:
    """Why the dense implementation cannot take the step (a trace-time error, or a mask too large), or None."""
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens * num_tokens * q.dtype.itemsize > MASK_BYTES:
        return f"a {num_tokens} x {num_tokens} mask exceeds {MASK_BYTES >> 20} MiB"
    query = jax.ShapeDtypeStruct((1, num_tokens, num_heads, head_dim), q.dtype)  # (1, T, Hq, D)
    kv = jax.ShapeDtypeStruct((1, num_tokens, k_cache.shape[3], head_dim), q.dtype)  # (1, T, Hkv, D)
    mask = jax.ShapeDtypeStruct((1, 1, num_tokens, num_tokens), jnp.bool_)  # (1, 1, T, T)
    try:
        jax.eval_shape(lambda q, k, v, m: dense(q, k, v, mask=m), query, kv, kv, mask)
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as error:
        return str(error) or type(error).__name__
    return None


@functools.cache
def _warn_once(message: str) -> None:
    """Log `message` the first time only (every layer and bucket traces the same choice)."""
    logger.warning(message)
