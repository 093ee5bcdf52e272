"""The XLA attention path: the plain-jnp reference, gathering each query tile's pages."""

from __future__ import annotations

from jaxserve.attention.base import AttentionBackend
from jaxserve.batch_descriptor import BatchDescriptor
from jaxserve.model.spec import ModelSpec
from pallas_kernels.ragged_paged_attention import reference

CPU_QUERY_TILE = 8  # measured: 3-4x faster than untiled on a 2-core CPU (docs/benchmarks.md)


def make_backend(spec: ModelSpec, platform: str) -> AttentionBackend:
    """The XLA backend for `platform` ('cpu', 'gpu' or 'tpu')."""
    sm_scale = spec.head_dim**-0.5
    query_tile = CPU_QUERY_TILE if platform == "cpu" else None

    def attention(q, caches, layer, batch: BatchDescriptor):
        k_cache, v_cache = caches
        return reference.ragged_paged_attention(
            q, k_cache, v_cache, layer, batch.positions, batch.query_start_loc, batch.page_table,
            sm_scale=sm_scale, sliding_window=spec.sliding_window, query_tile=query_tile,
        )

    def write_kv(caches, layer, k, v, batch: BatchDescriptor):
        return reference.write_kv(*caches, layer, k, v, batch.slot_mapping)

    return AttentionBackend("xla", "split", attention, write_kv)
