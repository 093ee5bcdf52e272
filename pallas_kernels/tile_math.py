"""Arithmetic on kernel tiles shared by the attention kernels, kept within what the GPU Triton lowering takes."""

from __future__ import annotations

import jax
import jax.numpy as jnp

MIN_DOT_SIZE = 16  # a Triton dot needs every dimension >= 16; smaller tiles multiply and sum


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
