"""The Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3) as Flax NNX modules over the params tree,
registered for spec.LLAMA_FAMILY (model/registry.py) with its weights declared in `weights`.

Params layout (leading `L` = layers, stacked so the layer loop is one `lax.scan`):
    embed        (V, H)
    lm_head      (H, V)            absent when embeddings are tied; a sequence classifier's score head (H, labels)
    lm_head_bias (labels,)         a token classifier's score head's bias only
    final_norm   (H,)
    layers/input_norm (L, H)       layers/post_norm (L, H)
    layers/wq (L, H, Hq*D)         layers/wk, wv (L, H, Hkv*D)       layers/wo (L, Hq*D, H)
    layers/bq (L, Hq*D)            layers/bk, bv (L, Hkv*D)          Qwen2 only
    layers/q_norm, k_norm (L, D)   Qwen3 only
    layers/w_gate, w_up (L, H, I)  layers/w_down (L, I, H)
Under weight quantization (model/quantize.py) each of wq, wk, wv, wo, w_gate, w_up, w_down is
{"weight": the same shape in int8 or float8_e4m3fn, "scale": (L, out) float32} (model/quantize.py: a checkpoint's
block or group scales, int4 weights, zero points).
Under an fp8 KV cache (attention/fp8.py): layers/k_scale, v_scale (L, Hkv) float32.
Serving LoRA adapters (model/lora.py): layers/lora/{wq, ..., w_down}/{a (L, S, in, R), b (L, S, R, out)}.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.attention.base import LayerAttention
from jaxserve.model.layers import (
    StepContext,
    apply_rope,
    lora_slots,
    optional_param,
    project,
    projection,
    projection_width,
    rms_norm,
    rope_cos_sin,
    scan_layers,
)
from jaxserve.model.registry import Model, Weight, register
from jaxserve.model_spec import LLAMA_FAMILY, ModelSpec, llama_family_spec
from jaxserve.sharding import MODEL_AXIS


class LlamaLayer(nnx.Module):
    """One decoder layer: RMSNorm -> q, k, v (Qwen2's biases, Qwen3's per-head RMSNorm) -> RoPE -> paged attention
    -> o, then RMSNorm -> SwiGLU MLP, each with its residual. Built over the stacked params["layers"] (every
    variable (L, ...)) and called on one layer's slice inside `scan_layers`."""

    def __init__(self, params: dict, spec: ModelSpec):
        self.spec = spec
        self.input_norm = optional_param(params, "input_norm")  # (OLMo 2 has none: its norms follow the sub-layers)
        self.post_norm = nnx.Param(params["post_norm"])
        self.wq, self.wk, self.wv = projection(params["wq"]), projection(params["wk"]), projection(params["wv"])
        self.bq, self.bk, self.bv = (optional_param(params, name) for name in ("bq", "bk", "bv"))
        self.q_norm, self.k_norm = optional_param(params, "q_norm"), optional_param(params, "k_norm")
        self.wo = projection(params["wo"])
        self.k_scale, self.v_scale = optional_param(params, "k_scale"), optional_param(params, "v_scale")
        self.lora = lora_slots(params)  # projection leaf -> its LoRA adapters (none unless enable_lora)
        self.init_feed_forward(params)

    def init_feed_forward(self, params: dict) -> None:
        """The feed-forward's variables: the SwiGLU MLP's projections."""
        self.w_gate, self.w_up = projection(params["w_gate"]), projection(params["w_up"])
        self.w_down = projection(params["w_down"])

    def __call__(self, x: jax.Array, caches: tuple[jax.Array, ...], layer: jax.Array, rope: tuple[jax.Array, ...],
                 step: StepContext) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """The layer over the step's tokens: (x, caches) after it."""
        # x: (T, H); rope: cos, sin (T, rotary dims // 2) each
        attn, caches = self.self_attention(self.norm(x, self.input_norm), caches, layer, rope, step)  # (T, H)
        x = x + attn
        return x + self.feed_forward(self.norm(x, self.post_norm), step), caches  # (T, H)

    def self_attention(self, h: jax.Array, caches: tuple[jax.Array, ...], layer: jax.Array,
                       rope: tuple[jax.Array, ...], step: StepContext) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """q, k, v -> RoPE -> paged attention -> o over the (normed) step tokens: (the attention's output, caches)."""
        # h: (T, H) -> (T, H)
        slots = step.batch.lora_slots
        q, k, v = self.qkv(h, slots)  # (T, Hq, D), (T, Hkv, D), (T, Hkv, D)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        how = LayerAttention(sm_scale=self.attention_scale(), sliding_window=self.spec.sliding_window)
        attn, caches = step.attend(q, k, v, caches, layer, (how,), kv_scales=self.kv_scales())  # (T, Hq, D)
        return project(attn.reshape(attn.shape[0], -1), self.wo, self.lora.get("wo"), slots), caches

    def attention_scale(self) -> float:
        """The attention scores' scale: 1 / sqrt(head_dim)."""
        return self.spec.head_dim**-0.5

    def feed_forward(self, h: jax.Array, step: StepContext) -> jax.Array:
        """The SwiGLU MLP."""
        # h: (T, H) -> (T, H)
        slots = step.batch.lora_slots
        gate = jax.nn.silu(project(h, self.w_gate, self.lora.get("w_gate"), slots))  # (T, I)
        return project(gate * project(h, self.w_up, self.lora.get("w_up"), slots), self.w_down,
                       self.lora.get("w_down"), slots)

    def norm(self, x: jax.Array, weight: nnx.Param) -> jax.Array:
        """The family's RMSNorm."""
        return rms_norm(x, weight[...], self.spec.rms_norm_eps)

    def kv_scales(self) -> tuple[jax.Array, jax.Array] | None:
        """The layer's fp8 KV scales (each (Hkv,)), or None for a cache in the weights' dtype."""
        return None if self.k_scale is None else (self.k_scale[...], self.v_scale[...])

    def qkv(self, h: jax.Array, slots: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Per-head q, k, v (KV heads: as many as the cache holds, the projection's width over D); `slots`: each
        token's LoRA slot when the engine serves adapters."""
        # h: (T, H); slots: (T,) int32
        q, k, v = self.heads(*self.projections(h, slots))  # (T, Hq, D), (T, Hkv, D), (T, Hkv, D)
        if self.q_norm is not None:
            q, k = self.norm(q, self.q_norm), self.norm(k, self.k_norm)
        return q, k, v

    def projections(self, h: jax.Array, slots: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k, v flat, with Qwen2's biases."""
        # h: (T, H) -> (T, Hq*D), (T, Hkv*D), (T, Hkv*D)
        q, k, v = (project(h, weight, self.lora.get(leaf), slots)
                   for weight, leaf in ((self.wq, "wq"), (self.wk, "wk"), (self.wv, "wv")))
        if self.bq is not None:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        return q, k, v

    def heads(self, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Flat q, k, v split into heads."""
        # q: (T, Hq*D), k, v: (T, Hkv*D) -> (T, Hq, D), (T, Hkv, D), (T, Hkv, D)
        num_tokens, head_dim = q.shape[0], self.spec.head_dim
        num_kv_heads = projection_width(self.wk) // head_dim
        return (q.reshape(num_tokens, -1, head_dim), k.reshape(num_tokens, num_kv_heads, head_dim),
                v.reshape(num_tokens, num_kv_heads, head_dim))


class LlamaForCausalLM(nnx.Module):
    """The Llama-family decoder: embedding -> a scan over the stacked `LlamaLayer` -> final norm -> LM head (the
    embedding's transpose when tied; a sequence classifier's score head, whose logits are its classes')."""

    layer_module = LlamaLayer

    def __init__(self, params: dict, spec: ModelSpec):
        self.spec = spec
        self.embed, self.final_norm = nnx.Param(params["embed"]), nnx.Param(params["final_norm"])
        self.lm_head = optional_param(params, "lm_head")
        self.lm_head_bias = optional_param(params, "lm_head_bias")
        self.layers = self.layer_module(params["layers"], spec)

    def __call__(self, caches: tuple[jax.Array, ...], step: StepContext
                 ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
        """One step over the padded ragged batch: (logits (R, V) float32 of each row's last token, every token's
        hidden state before the final norm (T, H), caches)."""
        return self.tapped(caches, step, ())[:3]

    def tapped(self, caches: tuple[jax.Array, ...], step: StepContext, layers: tuple[int, ...]
               ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...], jax.Array | None]:
        """`__call__`'s step and each token's inputs of `layers` (ascending, distinct; the residual stream before
        each, 0: the embeddings) side by side, (T, len(layers) * H) (EAGLE-3's features; None for no layers)."""
        batch = step.batch
        rope = self.rope_tables(batch.positions)
        x = self.embed_tokens(batch.input_ids)  # (T, H)
        kept = None
        if layers:  # kept: (len(layers) + 1, T, H); a layer not tapped writes to the last place, never read
            kept = jnp.zeros((len(layers) + 1, *x.shape), x.dtype)
            places = np.full((self.spec.num_layers,), len(layers), np.int32)  # (L,) each layer's place
            places[list(layers)] = np.arange(len(layers))

        def stack_step(first: int):
            def layer_step(layer: LlamaLayer, carry, index):
                x, caches, kept = carry
                index = index + first  # the layer's index in the model
                if kept is not None:
                    kept = jax.lax.dynamic_update_index_in_dim(kept, x, jnp.asarray(places)[index], 0)
                return *layer(x, caches, index, rope, step), kept

            return layer_step

        carry = (x, caches, kept)
        for stack, first in self.layer_stacks():
            carry = scan_layers(stack, carry, stack_step(first))
        x, caches, kept = carry
        taps = None if kept is None else jnp.concatenate(list(kept[:-1]), axis=-1)  # (T, len(layers) * H)
        return self.logits(x[batch.logits_indices]), x, caches, taps

    def layer_stacks(self) -> tuple[tuple[nnx.Module, int], ...]:
        """The stacks of layers the step scans, in order, each with its first layer's index (one stack here; a model
        whose layers come in two kinds has one per kind)."""
        return ((self.layers, 0),)

    def embed_tokens(self, token_ids: jax.Array) -> jax.Array:
        """The tokens' embeddings."""
        # token_ids: (T,) int32 -> (T, H)
        return self.embed[...][token_ids]

    def rope_tables(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The rotary tables every layer takes."""
        # positions: (T,) int32 -> cos, sin: (T, rotary dims // 2) float32 each
        rope = self.spec.rope
        return rope_cos_sin(positions, rope.inv_freq(), rope.attention_factor)

    def final_states(self, hidden: jax.Array) -> jax.Array:
        """The final norm over some tokens' last layer outputs (Hugging Face's `last_hidden_state`)."""
        # hidden: (N, H) -> (N, H)
        return self.layers.norm(hidden, self.final_norm)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final norm and LM head over some tokens' last hidden states."""
        # hidden: (N, H) -> (N, V) float32
        normed = self.final_states(hidden)  # (N, H)
        lm_head = self.embed[...].T if self.lm_head is None else self.lm_head[...]  # (H, V)
        logits = jnp.dot(normed, lm_head, preferred_element_type=jnp.float32)  # (N, V)
        return logits if self.lm_head_bias is None else logits + self.lm_head_bias[...].astype(jnp.float32)


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
    if spec.classifier is not None:  # Hugging Face's XForSequenceClassification: `score` instead of an LM head
        tree["lm_head"] = Weight("score.weight", (hidden, spec.classifier.num_labels), replicated, transpose=True)
        if spec.classifier.per_token:  # XForTokenClassification's score head has a bias
            tree["lm_head_bias"] = Weight("score.bias", (spec.classifier.num_labels,), P(None))
    elif not spec.tie_word_embeddings:
        vocab_split = MODEL_AXIS if vocab % tensor_parallel_size == 0 else None
        tree["lm_head"] = Weight("lm_head.weight", (hidden, vocab), P(None, vocab_split), transpose=True)
    return tree


register(LLAMA_FAMILY, Model(spec_from_config=llama_family_spec, weights=weights, module=LlamaForCausalLM, lora=True))
