"""Arithmetic on kernel tiles shared by the attention kernels, kept within what the GPU Triton lowering takes.

An fp8 KV cache may be stored as the uint8 bits of its e4m3 values: integer pages are scattered and gathered in
place by every XLA backend, while XLA's CPU scatter converts a whole float8 operand to a wider type and back
(the whole pool, for every layer of every step). `to_cache` and `from_cache` convert at the edges: what is
written, and each tile where it is loaded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MIN_DOT_SIZE = 16  # a Triton dot needs every dimension >= 16; smaller tiles multiply and sum
FP8_BITS = jnp.dtype(jnp.uint8)  # a cache of this dtype holds float8_e4m3fn values as their bits


def to_cache(x: jax.Array, cache_dtype) -> jax.Array:
    """Values to store in a cache of `cache_dtype`: cast to it, or for FP8_BITS cast to e4m3 and bitcast."""
    if jnp.dtype(cache_dtype) == FP8_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.float8_e4m3fn), FP8_BITS)
    return x.astype(cache_dtype)


def from_cache(x: jax.Array, dtype) -> jax.Array:
    """Values loaded from a cache, in `dtype` (FP8_BITS read as the e4m3 values they hold)."""
    if x.dtype == FP8_BITS:
        x = jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn)
    return x.astype(dtype)


def dot_fits(page_size: int, head_dim: int) -> bool:
    """True when page-by-head-dim tiles are large enough for a Triton dot."""
    return page_size >= MIN_DOT_SIZE and head_dim >= MIN_DOT_SIZE


def matmul_f32(a: jax.Array, b: jax.Array, use_dot: bool) -> jax.Array:
    """a @ b in float32: a dot, or for tiles under 16 (which a Triton dot rejects) a broadcast
    multiply and sum."""
    # a: (M, K); b: (K, N)
    if use_dot:
        return jnp.dot(a, b, preferred_element_type=jnp.float32)  # (M, N)
    return jnp.sum(a.astype(jnp.float32)[:, :, None] * b.astype(jnp.float32)[None, :, :], axis=1)  # (M, N)
