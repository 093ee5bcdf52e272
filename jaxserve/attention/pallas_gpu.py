"""Our Pallas kernels on a GPU (the Triton lowering): ragged attention, flash-decoding, and the KV write.

Rows with one query token (decodes) run the flash-decoding kernel, which splits each row's KV length across
programs; rows with more (prompt chunks) run the ragged kernel, which skips the decode rows. A step of
decodes only launches the decode kernel alone, one without decodes the ragged kernel alone, a mixed step
both, so a step with one prompt chunk does not send its decode rows through the prefill kernel. The kernels run
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
from jaxserve.sharding import KV_CACHE_SPEC, MODEL_AXIS
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
            decode_and_prompt_rows,
            ragged=functools.partial(attention_kernel.ragged_paged_attention, skip_decode_rows=True, **options),
            decode=functools.partial(decode_kernel.paged_decode_attention, **options), return_lse=sinks,
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


def decode_and_prompt_rows(q, k_cache, v_cache, layer, query_start_loc, seq_lens, page_table, *, ragged, decode,
                           return_lse: bool = False):
    """Each row on the kernel made for it: rows of one query token (decodes) through the decode kernel (split
    over the KV length), rows of more (prompt chunks) through the ragged kernel, which `ragged` must make skip
    the decode rows (`skip_decode_rows=True`). A step of decodes only runs the decode kernel alone, a step
    without decodes the ragged kernel alone, a mixed step both (`lax.switch`: all three are compiled). Both
    read the same metadata; with `return_lse` (the kernels made to give it too) the result is (out, lse)."""
    # q: (T, Hq, D); k_cache, v_cache: (L, P, S, Hkv, D); query_start_loc: (R + 1,) int32
    # seq_lens: (R,) int32; page_table: (R, W) int32
    num_tokens = q.shape[0]
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # (R,)
    is_decode = query_lens == 1  # (R,) rows without a query are padding
    operands = (q, k_cache, v_cache, layer, query_start_loc, seq_lens, page_table)

    def decode_rows(into):
        """`into` (zeros, and -inf for the log-sum-exp, at the decode tokens) with the decode rows' outputs."""
        first = jnp.minimum(query_start_loc[:-1], num_tokens - 1)  # (R,)
        rows = decode(q[first], k_cache, v_cache, layer, jnp.where(is_decode, seq_lens, 0), page_table)  # (R, Hq, D)
        target = jnp.where(is_decode, query_start_loc[:-1], num_tokens)  # (R,) out of range: dropped
        if return_lse:  # (output (R, Hq, D), log-sum-exp (R, Hq)) into (T, Hq, D), (T, Hq)
            return tuple(whole.at[target].set(part, mode="drop") for whole, part in zip(into, rows))
        return into.at[target].set(rows, mode="drop")  # (T, Hq, D)

    def empty():
        """What a kernel gives the tokens it does not attend: zeros, and -inf for the log-sum-exp."""
        out = jnp.zeros_like(q)  # (T, Hq, D)
        return (out, jnp.full(q.shape[:2], -jnp.inf, jnp.float32)) if return_lse else out  # (T, Hq)

    branches = (
        lambda: decode_rows(empty()),  # decodes only
        lambda: ragged(*operands),  # prompt chunks only: no decode row to skip
        lambda: decode_rows(ragged(*operands)),  # mixed
    )
    has_decode, has_prompt = jnp.any(is_decode), jnp.any(query_lens > 1)
    index = jnp.where(has_prompt, jnp.where(has_decode, 2, 1), 0)  # () int32
    return jax.lax.switch(index, branches)
