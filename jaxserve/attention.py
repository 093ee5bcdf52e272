"""Attention backend selection: binds the paged-attention implementation the model calls.

Backends:
- `xla`: the plain-jnp reference (gathers each query tile's pages); the CPU default.
- `pallas`: the Pallas kernels (ragged attention and KV write), compiled for the accelerator.
- `pallas-interpret`: the same kernels run by Pallas's interpreter (CPU tests).
- `auto`: `pallas` on GPU when the kernels take the model's shapes (power-of-two head_dim), `xla`
  elsewhere (TPU Mosaic kernels are not written yet).

With Pallas, a step whose rows all have at most one query token (pure decode) runs the
flash-decoding kernel, which splits each row's KV length across programs; any other step runs the
ragged kernel. The Pallas kernels run inside `shard_map` over the `model` mesh axis: every device attends its own
query heads over its own KV heads (the cache is split on the KV-head axis), so no collective is
needed. Page tables and lengths are replicated.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.batch_descriptor import BatchDescriptor
from jaxserve.model.sharding import KV_CACHE_SPEC, MODEL_AXIS
from jaxserve.model.spec import ModelSpec
from pallas_kernels.ragged_paged_attention import reference
from pallas_kernels.ragged_paged_attention.tuning import gpu_unsupported

logger = logging.getLogger("jaxserve")

CPU_QUERY_TILE = 8  # measured: 3-4x faster than untiled on a 2-core CPU (docs/benchmarks.md)
HEADS_SPEC = P(None, MODEL_AXIS, None)  # (T, heads, D): heads split over the mesh


def resolve_backend(name: str, spec: ModelSpec, page_size: int) -> str:
    """The backend `name` stands for here: 'auto' is 'pallas' on a GPU when the kernels take the
    model's shapes, else 'xla'. ValueError for 'pallas' on shapes the GPU kernels cannot take."""
    on_gpu = jax.default_backend() == "gpu"
    unsupported = gpu_unsupported(page_size, spec.head_dim)
    if name == "auto":
        if on_gpu and unsupported:
            logger.warning("attention_backend auto: using the XLA path because %s", unsupported)
        return "pallas" if on_gpu and not unsupported else "xla"
    if name == "pallas" and not on_gpu:
        raise ValueError(f"attention_backend pallas compiles the kernels for a GPU, and this is "
                         f"{jax.default_backend()}: use pallas-interpret (slow, for tests) or xla")
    if name == "pallas" and unsupported:
        raise ValueError(f"attention_backend pallas: {unsupported}; use attention_backend xla")
    return name


def make_attention(spec: ModelSpec, backend: str, mesh: Mesh, page_size: int):
    """Return (attention, write_kv) callables with the model's static options bound."""
    backend = resolve_backend(backend, spec, page_size)
    if backend == "xla":
        return _xla_attention(spec)
    if backend in ("pallas", "pallas-interpret"):
        return _pallas_attention(spec, mesh, interpret=backend == "pallas-interpret")
    raise ValueError(f"unknown attention_backend {backend!r}; use auto, xla, pallas or pallas-interpret")


def _xla_attention(spec: ModelSpec):
    sm_scale = spec.head_dim**-0.5
    query_tile = CPU_QUERY_TILE if jax.default_backend() == "cpu" else None

    def attention(q, k_cache, v_cache, layer, batch: BatchDescriptor) -> jax.Array:
        return reference.ragged_paged_attention(
            q, k_cache, v_cache, layer, batch.positions, batch.query_start_loc, batch.page_table,
            sm_scale=sm_scale, sliding_window=spec.sliding_window, query_tile=query_tile,
        )

    def write_kv(k_cache, v_cache, layer, k, v, batch: BatchDescriptor):
        return reference.write_kv(k_cache, v_cache, layer, k, v, batch.slot_mapping)

    return attention, write_kv


def _pallas_attention(spec: ModelSpec, mesh: Mesh, interpret: bool):
    # Imported here, so the XLA path never needs Pallas or its GPU lowerings.
    from pallas_kernels.paged_decode_attention import kernel as decode_kernel
    from pallas_kernels.paged_kv_write import kernel as kv_write_kernel
    from pallas_kernels.ragged_paged_attention import kernel as attention_kernel

    options = dict(sm_scale=spec.head_dim**-0.5, sliding_window=spec.sliding_window, interpret=interpret)
    attend = functools.partial(
        ragged_or_decode,
        ragged=functools.partial(attention_kernel.ragged_paged_attention, **options),
        decode=functools.partial(decode_kernel.paged_decode_attention, **options),
    )
    sharded_attention = jax.shard_map(
        attend, mesh=mesh,
        in_specs=(HEADS_SPEC, KV_CACHE_SPEC, KV_CACHE_SPEC, P(), P(), P(), P()),
        out_specs=HEADS_SPEC, check_vma=False,
    )
    sharded_write = jax.shard_map(
        functools.partial(kv_write_kernel.write_kv, interpret=interpret), mesh=mesh,
        in_specs=(KV_CACHE_SPEC, KV_CACHE_SPEC, P(), HEADS_SPEC, HEADS_SPEC, P()),
        out_specs=(KV_CACHE_SPEC, KV_CACHE_SPEC), check_vma=False,
    )

    def attention(q, k_cache, v_cache, layer, batch: BatchDescriptor) -> jax.Array:
        return sharded_attention(q, k_cache, v_cache, layer, batch.query_start_loc, batch.seq_lens, batch.page_table)

    def write_kv(k_cache, v_cache, layer, k, v, batch: BatchDescriptor):
        return sharded_write(k_cache, v_cache, layer, k, v, batch.slot_mapping)

    return attention, write_kv


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
