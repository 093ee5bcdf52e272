"""EAGLE-1 draft heads (speculative_config method "eagle"; e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B, in the form vLLM
reads): one Llama decoder layer over the target's own features.

At a position p the head takes the token that follows p (x_{p+1}) and the target's FEATURE at p, its final hidden
state after the final norm: h = fc(concat(embed(x_{p+1}), feature_p)) (+ fc.bias when the head has one, as EAGLE's
own model does), then the Llama layer without a norm before its attention (EAGLE-1's first layer has none), and the
target's LM head over its output (no final norm) predicts x_{p+2}. Proposing further, the head's own output at a
position stands in for the target's feature there.

The head's folder: a Llama config.json (one layer) and tensors named without "model.": fc.weight (H, 2H), fc.bias,
layers.0.{self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}.weight, embed_tokens.weight
(when it has none, a copy of the target's embedding is used).

Params:
    embed (V, H)   fc (2H, H)   fc_bias (H,) optional   layers/...: the Llama layer's without input_norm (L = 1)
and, given at each call, the target's LM head `lm_head` (H, V) (its embedding's transpose when tied).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.attention.base import AttentionFn, WriteKVFn
from jaxserve.batch.descriptor import BatchDescriptor
from jaxserve.model import llama
from jaxserve.model.layers import StepContext, optional_param, rope_cos_sin, scan_layers
from jaxserve.model.registry import Weight, copy_pages
from jaxserve.model.spec import ModelSpec


def eagle_weights(spec: ModelSpec, num_cache_kv_heads: int, tensor_parallel_size: int, has_embed: bool,
                  has_bias: bool) -> dict:
    """Every params leaf of an EAGLE-1 head (the module docstring's) with its tensor in the head's folder: the
    Llama layer's (split as the Llama family's), fc and its bias whole, the embedding when the head has one."""
    tree = llama.weights(spec, num_cache_kv_heads, tensor_parallel_size)
    layers = {name: dataclasses.replace(weight, hf_name=weight.hf_name.removeprefix("model."), quantizable=False)
              for name, weight in tree["layers"].items() if name != "input_norm"}
    hidden = spec.hidden_size
    declared = {"fc": Weight("fc.weight", (2 * hidden, hidden), P(None, None), transpose=True), "layers": layers}
    if has_bias:
        declared["fc_bias"] = Weight("fc.bias", (hidden,), P(None))
    if has_embed:
        declared["embed"] = Weight("embed_tokens.weight", (spec.vocab_size, hidden), P(None, None))
    return declared


class EagleLayer(llama.LlamaLayer):
    """The Llama layer without a norm before its attention."""

    def __call__(self, x: jax.Array, caches: tuple[jax.Array, ...], layer: jax.Array, rope: tuple[jax.Array, ...],
                 step: StepContext) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """The layer over the step's tokens: (x, caches) after it."""
        # x: (T, H); rope: cos, sin (T, rotary dims // 2) each
        attn, caches = self.self_attention(x, caches, layer, rope, step)  # (T, H)
        x = x + attn
        return x + self.feed_forward(self.norm(x, self.post_norm), step), caches  # (T, H)


class EagleHead(nnx.Module):
    """An EAGLE-1 head over the params tree (the module docstring's, `lm_head` included)."""

    def __init__(self, params: dict, spec: ModelSpec):
        self.spec = spec
        self.embed, self.fc, self.lm_head = (nnx.Param(params[name]) for name in ("embed", "fc", "lm_head"))
        self.fc_bias = optional_param(params, "fc_bias")
        self.layers = EagleLayer(params["layers"], spec)

    def __call__(self, caches: tuple[jax.Array, ...], step: StepContext, features: jax.Array
                 ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
        """One step over the padded batch, each token with the feature of its position: (logits (R, V) float32 of
        each row's last token, every token's output (T, H), caches)."""
        # features: (T, H)
        batch, rope_spec = step.batch, self.spec.rope
        embeddings = self.embed[...][batch.input_ids]  # (T, H)
        x = jnp.concatenate([embeddings, features.astype(embeddings.dtype)], axis=-1) @ self.fc[...]  # (T, H)
        if self.fc_bias is not None:
            x = x + self.fc_bias[...]
        rope = rope_cos_sin(batch.positions, rope_spec.inv_freq(), rope_spec.attention_factor)

        def layer_step(layer: EagleLayer, carry, index):
            return layer(*carry, index, rope, step)

        x, caches = scan_layers(self.layers, (x, caches), layer_step)
        logits = jnp.dot(x[batch.logits_indices], self.lm_head[...], preferred_element_type=jnp.float32)  # (R, V)
        return logits, x, caches


def eagle_forward(spec: ModelSpec, attention: AttentionFn, write_kv: WriteKVFn, mesh: Mesh) -> Callable:
    """forward(params, caches, batch, features (T, H)) -> (logits (R, V) float32, outputs (T, H), caches) of an
    EAGLE-1 head, the step's page copies made first."""

    def forward(params: dict, caches: tuple[jax.Array, ...], batch: BatchDescriptor, features: jax.Array):
        caches = copy_pages(caches, batch.copy_src, batch.copy_dst)
        return EagleHead(params, spec)(caches, StepContext(batch, attention, write_kv, mesh), features)

    return forward
