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
    def sharded_attention(how: LayerAttention, sinks: bool):
        """The attention kernels for one way of attending (with the heads' sinks, when `sinks`), each device on
        its own heads."""
        options = dict(sm_scale=how.sm_scale, sliding_window=how.sliding_window, soft_cap=how.soft_cap,
                       interpret=interpret, return_lse=sinks)
        attend = functools.partial(
            ragged_or_decode,
            ragged=functools.partial(attention_kernel.ragged_paged_attention, **options),
            decode=functools.partial(decode_kernel.paged_decode_attention, **options),
        )
        if sinks:
            attend = functools.partial(with_sinks, attend)
        in_specs = (HEADS_SPEC, KV_CACHE_SPEC, KV_CACHE_SPEC, P(), P(), P(), P())
        in_specs += (P(MODEL_AXIS),) if sinks else ()  # the sinks split with their heads
        return jax.shard_map(attend, mesh=mesh, in_specs=in_specs, out_specs=HEADS_SPEC, check_vma=False)

    sharded_write = jax.shard_map(
        functools.partial(kv_write_kernel.write_kv, interpret=interpret), mesh=mesh,
        in_specs=(KV_CACHE_SPEC, KV_CACHE_SPEC, P(), HEADS_SPEC, HEADS_SPEC, P()),
        out_specs=(KV_CACHE_SPEC, KV_CACHE_SPEC), check_vma=False,
    )

    def attention(q, caches, layer, batch: BatchDescriptor, how: LayerAttention, sinks=None) -> jax.Array:
        return sharded_attention(how, sinks is not None)(q, *caches, layer, batch.query_start_loc, batch.seq_lens,
                                                         batch.page_table, *(() if sinks is None else (sinks,)))

    def write_kv(caches, layer, k, v, batch: BatchDescriptor):
        return sharded_write(*caches, layer, k, v, batch.slot_mapping)

    name = "pallas-interpret" if interpret else "pallas"
    return AttentionBackend(name, "split", attention, write_kv)


def with_sinks(attend, q, k_cache, v_cache, layer, query_start_loc, seq_lens, page_table, sinks):
    """`attend` (giving each query head's output and the log-sum-exp of its scores) with each head's attention
    sink in its softmax's denominator: the output times sigmoid(lse - sink) (zero where a head saw no key)."""
    # sinks: (Hq,) -> (T, Hq, D)
    out, lse = attend(q, k_cache, v_cache, layer, query_start_loc, seq_lens, page_table)  # (T, Hq, D), (T, Hq)
    scale = jax.nn.sigmoid(lse - sinks.astype(jnp.float32)[None, :])  # (T, Hq)
    return (out.astype(jnp.float32) * scale[..., None]).astype(out.dtype)


def ragged_or_decode(q, k_cache, v_cache, layer, query_start_loc, seq_lens, page_table, *, ragged, decode):
    """The decode kernel (split over the KV length) when every row has at most one query token,
    else the ragged kernel; both read the same metadata (and both give the log-sum-exp too when asked)."""
    # q: (T, Hq, D); k_cache, v_cache: (L, P, S, Hkv, D); query_start_loc: (R + 1,) int32
    # seq_lens: (R,) int32; page_table: (R, W) int32
    num_tokens = q.shape[0]
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # (R,)

    def decode_step():
        has_query = query_lens == 1  # (R,) rows without a query are padding
        first = jnp.minimum(query_start_loc[:-1], num_tokens - 1)  # (R,)
        rows = decode(q[first], k_cache, v_cache, layer, jnp.where(has_query, seq_lens, 0), page_table)  # (R, Hq, D)
        target = jnp.where(has_query, query_start_loc[:-1], num_tokens)  # (R,) out of range: dropped

        def placed(values, fill):  # each row's values at its token, `fill` for the tokens no row writes
            return jnp.full((num_tokens, *values.shape[1:]), fill, values.dtype).at[target].set(values, mode="drop")

        if isinstance(rows, tuple):  # (output (R, Hq, D), log-sum-exp (R, Hq))
            return placed(rows[0], 0), placed(rows[1], -jnp.inf)
        return placed(rows, 0)  # (T, Hq, D)

    def ragged_step():
        return ragged(q, k_cache, v_cache, layer, query_start_loc, seq_lens, page_table)  # (T, Hq, D)

    return jax.lax.cond(jnp.all(query_lens <= 1), decode_step, ragged_step)
