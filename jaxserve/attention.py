"""Attention backend selection: binds the paged-attention implementation the model calls."""

from __future__ import annotations


import jax

from jaxserve.batch_descriptor import BatchDescriptor
from jaxserve.model.spec import ModelSpec
from pallas_kernels.ragged_paged_attention import reference


CPU_QUERY_TILE = 8  # measured: 3-4x faster than untiled on a 2-core CPU (docs/benchmarks.md)


def resolve_backend(name: str) -> str:
    """'auto' is the XLA reference path until the Pallas kernels land for this platform."""
    return "xla" if name == "auto" else name


def make_attention(spec: ModelSpec, backend: str):
    """Return (attention, write_kv) callables with the model's static options bound."""
    if resolve_backend(backend) != "xla":
        raise ValueError(f"attention_backend {backend!r} is not available; use 'auto' or 'xla'")
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
