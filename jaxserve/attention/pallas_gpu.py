"""Our Pallas kernels on a GPU (the Triton lowering): ragged attention, flash-decoding, and the KV write.

A step whose rows all have at most one query token (pure decode) runs the flash-decoding kernel, which
splits each row's KV length across programs; any other step runs the ragged kernel. The kernels run
inside `shard_map` over the `model` mesh axis: every device attends its own query heads over its own KV
heads (the cache is split on the KV-head axis), so no collective is needed. Page tables and lengths are
replicated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.attention.base import AttentionBackend, LayerAttention
from jaxserve.batch.descriptor import BatchDescriptor
from jaxserve.model.sharding import KV_CACHE_SPEC, MODEL_AXIS
from pallas_kernels.paged_decode_attention import kernel as decode_kernel
from pallas_kernels.paged_kv_write import kernel as kv_write_kernel
from pallas_kernels.ragged_paged_attention import kernel as attention_kernel

HEADS_SPEC = P(None, MODEL_AXIS, None)  # (T, heads, D): heads split over the mesh


def make_backend(mesh: Mesh, interpret: bool) -> AttentionBackend:
    """The GPU kernels (or their interpreted run) as a backend over the split cache layout."""

    @functools.cache
    def sharded_attention(how: LayerAttention):
        """The attention kernels for one way of attending, each device on its own heads."""
        options = dict(sm_scale=how.sm_scale, sliding_window=how.sliding_window, soft_cap=how.soft_cap,
                       interpret=interpret)
        attend = functools.partial(
            ragged_or_decode,
            ragged=functools.partial(attention_kernel.ragged_paged_attention, **options),
            decode=functools.partial(decode_kernel.paged_decode_attention, **options),
        )
        return jax.shard_map(
            attend, mesh=mesh,
            in_specs=(HEADS_SPEC, KV_CACHE_SPEC, KV_CACHE_SPEC, P(), P(), P(), P()),
            out_specs=HEADS_SPEC, check_vma=False,
        )

    sharded_write = jax.shard_map(
        functools.partial(kv_write_kernel.write_kv, interpret=interpret), mesh=mesh,
        in_specs=(KV_CACHE_SPEC, KV_CACHE_SPEC, P(), HEADS_SPEC, HEADS_SPEC, P()),
        out_specs=(KV_CACHE_SPEC, KV_CACHE_SPEC), check_vma=False,
    )

    def attention(q, caches, layer, batch: BatchDescriptor, how: LayerAttention) -> jax.Array:
        return sharded_attention(how)(q, *caches, layer, batch.query_start_loc, batch.seq_lens, batch.page_table)

    def write_kv(caches, layer, k, v, batch: BatchDescriptor):
        return sharded_write(*caches, layer, k, v, batch.slot_mapping)

    name = "pallas-interpret" if interpret else "pallas"
    return AttentionBackend(name, "split", attention, write_kv)


def ragged_or_decode(q, k_cache, v_cache, layer, query_start_loc, seq_lens, page_table, *, ragged, decode):
    """The decode kernel (split over the KV length) when every row has at most one query token,
    else the ragged kernel; both read the same metadata."""
    # q: (T, Hq, D); k_cache, v_cache: (L, P, S, Hkv, D); query_start_loc: (R + 1,) int32
    # seq_lens: (R,) int32; page_table: (R, W) int32
    num_tokens = q.shape[0]
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # (R,)

    def decode_step():
        has_query = query_lens == 1  # (R,) rows without a query are padding
        first = jnp.minimum(query_start_loc[:-1], num_tokens - 1)  # (R,)
        rows = decode(q[first], k_cache, v_cache, layer, jnp.where(has_query, seq_lens, 0), page_table)  # (R, Hq, D)
        target = jnp.where(has_query, query_start_loc[:-1], num_tokens)  # (R,) out of range: dropped
        return jnp.zeros_like(q).at[target].set(rows, mode="drop")  # (T, Hq, D)

    def ragged_step():
        return ragged(q, k_cache, v_cache, layer, query_start_loc, seq_lens, page_table)  # (T, Hq, D)

    return jax.lax.cond(jnp.all(query_lens <= 1), decode_step, ragged_step)
