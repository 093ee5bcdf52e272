"""What every attention backend provides: the KV cache layout it stores, attention over it, and the KV write.

Two cache layouts, both rank 5 with the KV-head axis at index 3 (split over the `model` mesh axis):
- `split`: two arrays, K and V, each `(L, P, S, Hkv, D)` (our Pallas kernels and the XLA path);
- `fused`: one array `(L, P, S, 2 * Hkv, D)`, the K of KV head `h` at index `2h` and its V at `2h + 1`
  (the layout of JAX's Mosaic TPU ragged paged attention).
Pages are axis 1 in both, so page copies (copy-on-write) and swaps work on any layout.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.batch.descriptor import BatchDescriptor
from pallas_kernels.tile_math import FP8_BITS

LAYOUTS = ("split", "fused")


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """How one layer attends, fixed when the step is traced: the scale of q . k, the sliding window (a query at
    position p sees the keys at positions p - window + 1 .. p; None: every earlier key) and the soft cap of the
    scaled scores (s -> cap * tanh(s / cap); None: no cap)."""

    sm_scale: float
    sliding_window: int | None = None
    soft_cap: float | None = None


class AttentionFn(Protocol):
    """Paged attention of the step's queries for one layer; `sinks` (Hq,) float32: each query head's learned sink
    logit (gpt-oss), in the softmax's denominator only."""

    def __call__(self, q: jax.Array, caches: tuple[jax.Array, ...], layer: jax.Array, batch: BatchDescriptor,
                 how: LayerAttention, sinks: jax.Array | None = None) -> jax.Array: ...


class WriteKVFn(Protocol):
    """Writes the step's new K/V into the pages of one layer, returning the updated caches."""

    def __call__(self, caches: tuple[jax.Array, ...], layer: jax.Array, k: jax.Array, v: jax.Array,
                 batch: BatchDescriptor) -> tuple[jax.Array, ...]: ...


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """A resolved backend: its name, its cache layout, the two functions the model calls, and how it stores an
    fp8 cache: as e4m3's uint8 bits (`FP8_BITS`, in place under every XLA scatter) or as float8_e4m3fn (a kernel
    that reads float8 refs)."""

    name: str
    layout: str
    attention: AttentionFn  # (q (T, Hq, D), caches, layer, batch, how, sinks (Hq,) or None) -> (T, Hq, D)
    write_kv: WriteKVFn  # (caches, layer, k (T, Hkv, D), v (T, Hkv, D), batch) -> caches
    fp8_storage: np.dtype = FP8_BITS
    options: tuple = ()  # what besides its name and the model decides what its functions trace (e.g. the platform)

    def storage_dtype(self, cache_dtype) -> np.dtype:
        """The dtype of the arrays holding a cache of `cache_dtype` (an fp8 cache: `fp8_storage`)."""
        dtype = np.dtype(cache_dtype)
        return self.fp8_storage if dtype == np.dtype(jnp.float8_e4m3fn) else dtype

    def cache_shapes(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                     head_dim: int) -> tuple[tuple[int, ...], ...]:
        """The shape of each cache array this backend stores."""
        return cache_shapes(self.layout, num_layers, num_pages, page_size, num_kv_heads, head_dim)

    def page_bytes(self, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        """Bytes of one page of every layer in all of this backend's cache arrays (all devices together)."""
        shapes = self.cache_shapes(num_layers, 1, page_size, num_kv_heads, head_dim)
        return sum(math.prod(shape) for shape in shapes) * np.dtype(dtype).itemsize


def cache_shapes(layout: str, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of the cache arrays of `layout` (see the module docstring)."""
    if layout == "split":
        return ((num_layers, num_pages, page_size, num_kv_heads, head_dim),) * 2
    if layout == "fused":
        return ((num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim),)
    raise ValueError(f"unknown KV cache layout {layout!r}; one of {', '.join(LAYOUTS)}")
