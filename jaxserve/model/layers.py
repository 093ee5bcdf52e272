"""What the architectures' Flax NNX modules share: their params as NNX variables, the step's context (the paged
attention a layer calls), the scan over stacked layers, norms and rotary embeddings.

A model module is built from the engine's params tree (`Model.module(params, spec)`, model/registry.py) inside
the traced step: its attributes are the tree's leaves wrapped as `nnx.Param`s (a quantized projection as a
`QuantizedWeight`), so `nnx.state(module)` is the params tree again and building it costs nothing at run time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.attention.base import AttentionFn, LayerAttention, WriteKVFn
from jaxserve.attention.fp8 import write_and_attend
from jaxserve.batch.descriptor import BatchDescriptor
from jaxserve.model.quantize import dequantize, linear


class QuantizedWeight(nnx.Module):
    """A quantized projection (model/quantize.py): int8, float8_e4m3fn or packed int4 `weight` (..., in, out), its
    float32 `scale` (..., out) or grouped (..., groups, out), an asymmetric int4 checkpoint's `zero` points, and
    act-order GPTQ's `row_groups` (..., in)."""

    def __init__(self, weight: jax.Array, scale: jax.Array, zero: jax.Array | None = None,
                 row_groups: jax.Array | None = None):
        self.weight = nnx.Param(weight)
        self.scale = nnx.Param(scale)
        self.zero = None if zero is None else nnx.Param(zero)
        self.row_groups = None if row_groups is None else nnx.Param(row_groups)


def projection(value: jax.Array | dict) -> nnx.Param | QuantizedWeight:
    """A projection's params leaf as NNX state: a Param, or a QuantizedWeight for {weight, scale[, zero][,
    row_groups]}."""
    if isinstance(value, dict):
        return QuantizedWeight(value["weight"], value["scale"], value.get("zero"), value.get("row_groups"))
    return nnx.Param(value)


def optional_param(params: dict, name: str) -> nnx.Param | None:
    """params[name] as a Param, or None when the tree has no such leaf."""
    return nnx.Param(params[name]) if name in params else None


def weight_value(weight: nnx.Param | QuantizedWeight) -> jax.Array | dict:
    """A projection's array, or a quantized one's {weight, scale} arrays (what model/quantize.py's `linear` takes)."""
    if isinstance(weight, QuantizedWeight):
        parts = {"weight": weight.weight, "scale": weight.scale, "zero": weight.zero, "row_groups": weight.row_groups}
        return {name: part[...] for name, part in parts.items() if part is not None}
    return weight[...]


def float_weight(weight: nnx.Param | QuantizedWeight, dtype) -> jax.Array:
    """A projection's weight as floats (..., in, out), a quantized one dequantized into `dtype`: for a weight read
    other than by one matmul (DeepSeek's kv_b_proj, split into its heads' key and value parts)."""
    value = weight_value(weight)
    return dequantize(value, dtype) if isinstance(value, dict) else value


class LoraSlots(nnx.Module):
    """One projection's resident LoRA adapters (model/lora.py): `a` (..., S, in, R), `b` (..., S, R, out)."""

    def __init__(self, a: jax.Array, b: jax.Array):
        self.a = nnx.Param(a)
        self.b = nnx.Param(b)


def lora_slots(params: dict) -> nnx.Dict:
    """A layer's LoraSlots by projection leaf (params["lora"]; empty when the engine serves no adapters)."""
    return nnx.Dict({leaf: LoraSlots(pair["a"], pair["b"]) for leaf, pair in params.get("lora", {}).items()})


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """What the tokens' LoRA adapters add to a projection of x: (x @ a[s]) @ b[s] for each token's slot s (none for
    -1), every slot's computed at once and masked (model/lora.py)."""
    # x: (T, in); a: (S, in, R); b: (S, R, out); slots: (T,) int32 -> (T, out)
    mask = (slots[:, None] == jnp.arange(a.shape[0])[None, :]).astype(x.dtype)  # (T, S)
    down = jnp.einsum("ti,sir->tsr", x, a) * mask[:, :, None]  # (T, S, R)
    return jnp.einsum("tsr,sro->to", down, b)


def project(x: jax.Array, weight: nnx.Param | QuantizedWeight, lora: LoraSlots | None = None,
            slots: jax.Array | None = None) -> jax.Array:
    """x @ weight for a float or a quantized projection, plus what each token's LoRA adapter adds (`slots`: (T,)
    its slot, -1 for none) when the projection has `lora`; the result in x's dtype."""
    # x: (T, in) -> (T, out)
    out = linear(x, weight_value(weight))
    if lora is None:
        return out
    return out + lora_delta(x, lora.a[...], lora.b[...], slots).astype(out.dtype)


def projection_width(weight: nnx.Param | QuantizedWeight) -> int:
    """The output width of a projection (its last axis)."""
    return (weight.weight if isinstance(weight, QuantizedWeight) else weight).shape[-1]


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a model's forward takes besides its params and the KV caches: the step's batch, the attention
    backend's functions, and the device mesh (for layers that shard by hand, as expert parallelism does)."""

    batch: BatchDescriptor
    attention: AttentionFn
    write_kv: WriteKVFn
    mesh: Mesh

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, caches: tuple[jax.Array, ...], layer: jax.Array,
               hows: tuple[LayerAttention, ...], which: jax.Array | int = 0,
               kv_scales: tuple[jax.Array, jax.Array] | None = None,
               sinks: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """Write the layer's K/V into its pages and attend as `hows[which]` (layers of several kinds in one scan
        pick theirs by a traced index): (attention out, caches). `kv_scales` are the layer's fp8 KV scales
        (attention/fp8.py); `sinks` (Hq,) its heads' attention sinks (gpt-oss)."""
        # q: (T, Hq, D); k, v: (T, Hkv, D) -> out (T, Hq, D)
        return write_and_attend(q, k, v, caches, layer, self.batch, hows, which, kv_scales,
                                attention=self.attention, write_kv=self.write_kv, sinks=sinks)


def scan_layers(layers: nnx.Module, carry, body: Callable) -> object:
    """Run `body(layer, carry, index) -> carry` over a module of stacked layers (every variable (L, ...)) as one
    `lax.scan`, so the step compiles one layer however many there are."""
    graphdef, state = nnx.split(layers)
    num_layers = jax.tree_util.tree_leaves(state)[0].shape[0]

    def step(carry, inputs):
        layer_state, index = inputs
        return body(nnx.merge(graphdef, layer_state), carry, index), None

    carry, _ = jax.lax.scan(step, carry, (state, jnp.arange(num_layers, dtype=jnp.int32)))
    return carry


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, cast back to the input dtype before the weight (as HF's Llama does)."""
    # x: (..., H); weight: (H,)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables for the given absolute positions (times `scale`: LongRoPE's attention factor)."""
    # positions: (T,) int32 -> cos, sin: (T, rotary dims // 2) float32
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half rotary embedding (HF's non-interleaved layout), in float32, of each head's first 2 * (D // 2 of
    the tables) dims (a partial rotary embedding leaves the rest as they are)."""
    # x: (T, heads, D); cos, sin: (T, rotary dims // 2)
    half = cos.shape[-1]
    x32 = x.astype(jnp.float32)
    x1, x2, rest = x32[..., :half], x32[..., half: 2 * half], x32[..., 2 * half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1).astype(x.dtype)
