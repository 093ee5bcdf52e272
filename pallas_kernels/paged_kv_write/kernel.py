"""KV write as a Pallas kernel: each program copies one token's K and V into its slot, in place.

The caches are aliased to the outputs (`input_output_aliases`), so with the caches donated to the
step the pool is updated without a copy. Padded tokens carry slot 0 (the null page) and all write
there; nothing reads it. Slot numbers are read from an int32 operand inside the kernel (GPU Pallas
lowerings have no scalar prefetch).

Status: verified against the reference in Pallas interpret mode on the CPU; not yet compiled for
a GPU (the Triton lowering needs Hkv * D to be a power of two for the (Hkv, D) stores).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton

from pallas_kernels.tile_math import to_cache


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Put token `t`'s K/V at slot `slot_mapping[t]` (= page * page_size + offset) of layer `layer`."""
    # k_cache, v_cache: (L, P, S, Hkv, D); k, v: (T, Hkv, D); slot_mapping: (T,) int32
    num_tokens, num_kv_heads, head_dim = k.shape
    token = pl.BlockSpec((None, num_kv_heads, head_dim), lambda t: (t, 0, 0))
    whole = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        _write_kernel,
        out_shape=(jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
        grid=(num_tokens,),
        in_specs=[whole, whole, token, token, whole, whole],
        out_specs=(whole, whole),
        input_output_aliases={4: 0, 5: 1},
        interpret=interpret,
        compiler_params=None if interpret else triton.CompilerParams(num_warps=1),
        name="paged_kv_write",
    )(jnp.asarray(layer, jnp.int32).reshape(1), slot_mapping.astype(jnp.int32), to_cache(k, k_cache.dtype),
      to_cache(v, v_cache.dtype), k_cache, v_cache)


def _write_kernel(layer_ref, slot_ref, k_ref, v_ref, _k_cache_in, _v_cache_in, k_cache_ref, v_cache_ref):
    """One program: one token's (Hkv, D) K and V into its page and offset."""
    page_size = k_cache_ref.shape[2]
    slot = slot_ref[pl.program_id(0)]
    page, offset = slot // page_size, slot % page_size
    layer = layer_ref[0]
    k_cache_ref[layer, page, offset, :, :] = k_ref[...]
    v_cache_ref[layer, page, offset, :, :] = v_ref[...]
