"""The Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3) as pure functions over a params pytree,
registered for spec.LLAMA_FAMILY (model/registry.py) with its weights declared in `weights`.

Params layout (leading `L` = layers, stacked so the layer loop is one `lax.scan`):
    embed        (V, H)
    lm_head      (H, V)            absent when embeddings are tied
    final_norm   (H,)
    layers/input_norm (L, H)       layers/post_norm (L, H)
    layers/wq (L, H, Hq*D)         layers/wk, wv (L, H, Hkv*D)       layers/wo (L, Hq*D, H)
    layers/bq (L, Hq*D)            layers/bk, bv (L, Hkv*D)          Qwen2 only
    layers/q_norm, k_norm (L, D)   Qwen3 only
    layers/w_gate, w_up (L, H, I)  layers/w_down (L, I, H)
Under weight quantization (model/quantize.py) each of wq, wk, wv, wo, w_gate, w_up, w_down is
{"weight": the same shape in int8 or float8_e4m3fn, "scale": (L, out) float32}.
Under an fp8 KV cache (kv/fp8.py): layers/k_scale, v_scale (L, Hkv) float32.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec as P

from jaxserve.attention.base import AttentionFn, WriteKVFn
from jaxserve.batch_descriptor import BatchDescriptor
from jaxserve.kv.fp8 import write_and_attend
from jaxserve.model.quantize import linear
from jaxserve.model.registry import Model, Weight, register
from jaxserve.model.sharding import MODEL_AXIS
from jaxserve.model.spec import LLAMA_FAMILY, ModelSpec, llama_family_spec


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, cast back to the input dtype before the weight (as HF does)."""
    # x: (..., H); weight: (H,)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables for the given absolute positions."""
    # positions: (T,) int32 -> cos, sin: (T, D // 2) float32
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half rotary embedding (HF's non-interleaved layout), in float32."""
    # x: (T, heads, D); cos, sin: (T, D // 2)
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def forward(
    params: dict,
    caches: tuple[jax.Array, ...],
    batch: BatchDescriptor,
    *,
    spec: ModelSpec,
    num_kv_heads: int,
    attention: AttentionFn,
    write_kv: WriteKVFn,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One model step over a padded ragged batch: returns (logits (R, V) float32, hidden (T, H), caches),
    where `hidden` is every token's last hidden state before the final norm (for prompt
    logprobs: keeping it costs nothing, it is the layer loop's carry).

    `num_kv_heads` is the number of KV heads held in the cache, which is the checkpoint's count
    or, when tensor parallelism is wider than that, the replicated count.
    """
    # caches: the attention backend's KV arrays, each (L, P, S, heads, D)
    caches = copy_pages(caches, batch.copy_src, batch.copy_dst)
    inv_freq = spec.rope.inv_freq()
    cos, sin = rope_cos_sin(batch.positions, inv_freq)  # (T, D // 2) each
    x = params["embed"][batch.input_ids]  # (T, H)

    def layer_step(carry, layer_inputs):
        x, caches = carry
        layer_params, layer = layer_inputs
        h = rms_norm(x, layer_params["input_norm"], spec.rms_norm_eps)  # (T, H)
        q, k, v = _qkv(h, layer_params, spec, num_kv_heads)  # (T, Hq, D), (T, Hkv, D), (T, Hkv, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn, caches = write_and_attend(q, k, v, caches, layer, batch, layer_params, attention=attention,
                                        write_kv=write_kv)  # (T, Hq, D)
        x = x + linear(attn.reshape(attn.shape[0], -1), layer_params["wo"])  # (T, H)
        h = rms_norm(x, layer_params["post_norm"], spec.rms_norm_eps)
        gate = jax.nn.silu(linear(h, layer_params["w_gate"]))  # (T, I)
        x = x + linear(gate * linear(h, layer_params["w_up"]), layer_params["w_down"])  # (T, H)
        return (x, caches), None

    layers = jnp.arange(spec.num_layers, dtype=jnp.int32)  # (L,)
    (x, caches), _ = jax.lax.scan(layer_step, (x, caches), (params["layers"], layers))

    logits = token_logits(params, x[batch.logits_indices], spec)  # (R, V) float32
    return logits, x, caches


def copy_pages(caches: tuple[jax.Array, ...], src: jax.Array, dst: jax.Array) -> tuple[jax.Array, ...]:
    """Copy whole pages (every layer) before the step writes: copy-on-write of shared pages. Padding
    copies the null page onto itself."""
    # caches: each (L, P, S, heads, D); src, dst: (C,) int32
    return tuple(cache.at[:, dst].set(cache[:, src]) for cache in caches)


def token_logits(params: dict, hidden: jax.Array, spec: ModelSpec) -> jax.Array:
    """Final norm and LM head over some tokens' last hidden states."""
    # hidden: (N, H) -> (N, V) float32
    normed = rms_norm(hidden, params["final_norm"], spec.rms_norm_eps)  # (N, H)
    lm_head = params["embed"].T if spec.tie_word_embeddings else params["lm_head"]  # (H, V)
    return jnp.dot(normed, lm_head, preferred_element_type=jnp.float32)


def _qkv(h: jax.Array, p: dict, spec: ModelSpec, num_kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Project to per-head q, k, v, with Qwen2's biases and Qwen3's per-head RMSNorm."""
    # h: (T, H)
    q, k, v = linear(h, p["wq"]), linear(h, p["wk"]), linear(h, p["wv"])  # (T, Hq*D), (T, Hkv*D), (T, Hkv*D)
    if spec.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    num_tokens, head_dim = h.shape[0], spec.head_dim
    q = q.reshape(num_tokens, spec.num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    if spec.qk_norm:
        q = rms_norm(q, p["q_norm"], spec.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], spec.rms_norm_eps)
    return q, k, v


def make_forward(spec: ModelSpec, num_kv_heads: int, attention: AttentionFn, write_kv: WriteKVFn) -> Callable:
    """Bind the static model configuration; the result maps (params, caches, batch) to (logits, hidden, caches)."""

    def bound(params, caches, batch):
        return forward(
            params, caches, batch, spec=spec, num_kv_heads=num_kv_heads, attention=attention, write_kv=write_kv
        )

    return bound


def weights(spec: ModelSpec, num_cache_kv_heads: int, tensor_parallel_size: int) -> dict:
    """Every params leaf (see the module docstring) with its Hugging Face tensor, shape and sharding: heads split
    Megatron style (q, k, v, gate and up by output columns, o and down by input rows), each KV head repeated
    when the tensor parallelism exceeds them, the LM head split on the vocabulary when it divides."""
    num_layers, hidden, inner, vocab = spec.num_layers, spec.hidden_size, spec.intermediate_size, spec.vocab_size
    q_width, kv_width = spec.num_heads * spec.head_dim, num_cache_kv_heads * spec.head_dim
    columns, rows, replicated = P(None, None, MODEL_AXIS), P(None, MODEL_AXIS, None), P(None, None)

    def layer(name: str, shape: tuple[int, ...], pspec: P, **storage) -> Weight:
        return Weight(f"model.layers.{{i}}.{name}", (num_layers, *shape), pspec, **storage)

    def projection(name: str, shape: tuple[int, int], pspec: P, kv_heads: bool = False) -> Weight:
        return layer(f"{name}.weight", shape, pspec, transpose=True, kv_heads=kv_heads, quantizable=True)

    layers = {
        "input_norm": layer("input_layernorm.weight", (hidden,), replicated, ones=True),
        "post_norm": layer("post_attention_layernorm.weight", (hidden,), replicated, ones=True),
        "wq": projection("self_attn.q_proj", (hidden, q_width), columns),
        "wk": projection("self_attn.k_proj", (hidden, kv_width), columns, kv_heads=True),
        "wv": projection("self_attn.v_proj", (hidden, kv_width), columns, kv_heads=True),
    }
    if spec.qkv_bias:
        layers["bq"] = layer("self_attn.q_proj.bias", (q_width,), P(None, MODEL_AXIS))
        layers["bk"] = layer("self_attn.k_proj.bias", (kv_width,), P(None, MODEL_AXIS), kv_heads=True)
        layers["bv"] = layer("self_attn.v_proj.bias", (kv_width,), P(None, MODEL_AXIS), kv_heads=True)
    if spec.qk_norm:
        layers["q_norm"] = layer("self_attn.q_norm.weight", (spec.head_dim,), replicated, ones=True)
        layers["k_norm"] = layer("self_attn.k_norm.weight", (spec.head_dim,), replicated, ones=True)
    layers.update({
        "wo": projection("self_attn.o_proj", (q_width, hidden), rows),
        "w_gate": projection("mlp.gate_proj", (hidden, inner), columns),
        "w_up": projection("mlp.up_proj", (hidden, inner), columns),
        "w_down": projection("mlp.down_proj", (inner, hidden), rows),
    })
    tree = {"embed": Weight("model.embed_tokens.weight", (vocab, hidden), replicated),
            "final_norm": Weight("model.norm.weight", (hidden,), P(None), ones=True), "layers": layers}
    if not spec.tie_word_embeddings:
        vocab_split = MODEL_AXIS if vocab % tensor_parallel_size == 0 else None
        tree["lm_head"] = Weight("lm_head.weight", (hidden, vocab), P(None, vocab_split), transpose=True)
    return tree


register(LLAMA_FAMILY, Model(spec_from_config=llama_family_spec, weights=weights, make_forward=make_forward,
                             token_logits=token_logits))
