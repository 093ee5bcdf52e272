"""The fp8 KV cache (`kv_cache_dtype: fp8`, vLLM's field): pages hold K and V in float8_e4m3fn, one scale per
(layer, KV head), so the pool holds twice the tokens of a 16-bit cache in the same memory.

A page stores `clip(x / scale, -448, 448)` in e4m3, so `x ~ stored * scale`. The scales are two params leaves,
`layers/k_scale` and `layers/v_scale` (L, Hkv) float32, from the checkpoint's `self_attn.k_scale` / `v_scale`
(one per layer or one per KV head), calibrated (`calculate_kv_scales`, model/kv_calibration.py), or 1.0 (vLLM's
default).

The pages hold e4m3 values; a backend stores them as their uint8 bits (the XLA path and our Pallas kernels:
integer pages are scattered in place everywhere, while XLA's CPU scatter converts a whole float8 pool) or as
float8 (JAX's TPU kernel reads float8 pages): `AttentionBackend.storage_dtype`.

No backend dequantizes a page: a K scale multiplies its head group's queries before the scores
(`q . (s k) = (s q) . k`) and a V scale multiplies the attention output after (`sum p (s v) = s sum p v`), so
every attention backend reads the fp8 pages as they are and only casts them to the queries' dtype where it
loads them (the Pallas kernels in VMEM / SRAM, the XLA path after its gather).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.attention.base import AttentionFn, LayerAttention, WriteKVFn
from jaxserve.batch.descriptor import BatchDescriptor
from jaxserve.sharding import MODEL_AXIS

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
SCALE_LEAVES = ("k_scale", "v_scale")  # params["layers"] leaves of an fp8 cache, each (L, Hkv) float32
SCALE_SPEC = P(None, MODEL_AXIS)  # split over the KV heads, as the cache is


def cache_dtype(kv_cache_dtype: str, dtype) -> jnp.dtype:
    """The dtype the pages hold: e4m3 under `fp8`, else the weights' `dtype` (`auto`)."""
    return jnp.dtype(FP8_DTYPE if kv_cache_dtype == "fp8" else dtype)


def with_scale_leaves(tree: dict, value) -> dict:
    """A params-shaped tree (partition specs, abstract arrays) with `value` at both scale leaves of its layers."""
    return {**tree, "layers": {**tree["layers"], **dict.fromkeys(SCALE_LEAVES, value)}}


def quantize(x: jax.Array, scale: jax.Array) -> jax.Array:
    """K or V in e4m3 under per-head `scale`, saturating at the format's largest value (no NaN)."""
    # x: (T, Hkv, D); scale: (Hkv,) float32 -> (T, Hkv, D) float8_e4m3fn
    return jnp.clip(x.astype(jnp.float32) / scale[:, None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def scale_heads(x: jax.Array, scale: jax.Array) -> jax.Array:
    """Every query head times its KV head's scale (query head h reads KV head h // (Hq / Hkv))."""
    # x: (T, Hq, D); scale: (Hkv,) float32 -> (T, Hq, D) in x's dtype
    group = x.shape[1] // scale.shape[0]
    return (x.astype(jnp.float32) * jnp.repeat(scale, group)[None, :, None]).astype(x.dtype)


def write_and_attend(q: jax.Array, k: jax.Array, v: jax.Array, caches: tuple[jax.Array, ...], layer: jax.Array,
                     batch: BatchDescriptor, hows: tuple[LayerAttention, ...], which: jax.Array | int,
                     kv_scales: tuple[jax.Array, jax.Array] | None, *, attention: AttentionFn, write_kv: WriteKVFn,
                     sinks: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Write the step's K/V into layer `layer`'s pages and attend over them as `hows[which]` (with the heads'
    `sinks` (Hq,) when the layer has them): (attention out, caches). With fp8 `kv_scales` (each (Hkv,)), K/V are
    stored quantized and the scales folded into q and the output."""
    # q: (T, Hq, D); k, v: (T, Hkv, D) -> out (T, Hq, D)
    if kv_scales is not None:
        k, v = quantize(k, kv_scales[0]), quantize(v, kv_scales[1])
        q = scale_heads(q, kv_scales[0])
    caches = write_kv(caches, layer, k, v, batch)
    attend = [functools.partial(attention, how=how, sinks=sinks) for how in hows]
    out = attend[0](q, caches, layer, batch) if len(hows) == 1 else jax.lax.switch(which, attend, q, caches,
                                                                                    layer, batch)  # (T, Hq, D)
    return (out if kv_scales is None else scale_heads(out, kv_scales[1])), caches


def tokens_note(kv_cache_dtype: str, weight_dtype) -> str:
    """What the start-up log adds about the cache's dtype: under fp8, how many times the tokens a cache in the
    weights' dtype would hold in the same memory."""
    if kv_cache_dtype != "fp8":
        return ""
    ratio = jnp.dtype(weight_dtype).itemsize // jnp.dtype(FP8_DTYPE).itemsize
    return f" (fp8 e4m3: {ratio}x the tokens a {jnp.dtype(weight_dtype).name} cache holds in the same memory)"
