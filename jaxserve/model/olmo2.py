"""AllenAI's OLMo 2 (`Olmo2ForCausalLM`): the Llama layer with its norms after the sub-layers instead of before
(x + norm(attention(x)), then x + norm(mlp(x))) and q / k RMSNorms over the whole projection (every head together)
before the heads are split.

Params: the Llama family's (model/llama.py) without layers/input_norm, with
    layers/post_norm (L, H)       the norm of the attention's output (post_attention_layernorm)
    layers/post_ffw_norm (L, H)   the norm of the MLP's output (post_feedforward_layernorm)
    layers/q_norm (L, Hq*D)       layers/k_norm (L, Hkv*D)  split with the heads (k's repeated with them)
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.model import llama
from jaxserve.model.layers import StepContext
from jaxserve.model.registry import Model, Weight, register
from jaxserve.model_spec import ModelSpec, llama_family_spec
from jaxserve.sharding import MODEL_AXIS

OLMO2 = ("Olmo2ForCausalLM",)


def olmo2_spec(arch: str, config: dict, generation_config: dict) -> ModelSpec:
    """The spec of an OLMo 2 config; a ValueError for attention biases (the module has none)."""
    if config.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported for Olmo2ForCausalLM")
    return dataclasses.replace(llama_family_spec("LlamaForCausalLM", config, generation_config), architecture=arch)


class Olmo2Layer(llama.LlamaLayer):
    """The OLMo 2 decoder layer (see the module docstring)."""

    def __init__(self, params: dict, spec: ModelSpec):
        super().__init__(params, spec)
        self.post_ffw_norm = nnx.Param(params["post_ffw_norm"])

    def __call__(self, x: jax.Array, caches: tuple[jax.Array, ...], layer: jax.Array, rope: tuple[jax.Array, ...],
                 step: StepContext) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """The layer over the step's tokens: (x, caches) after it."""
        # x: (T, H); rope: cos, sin (T, rotary dims // 2) each
        attn, caches = self.self_attention(x, caches, layer, rope, step)  # (T, H)
        x = x + self.norm(attn, self.post_norm)
        return x + self.norm(self.feed_forward(x, step), self.post_ffw_norm), caches  # (T, H)

    def qkv(self, h: jax.Array, slots: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q and k normed over their whole width (every head), then q, k, v split into heads."""
        # h: (T, H); slots: (T,) int32 -> (T, Hq, D), (T, Hkv, D), (T, Hkv, D)
        q, k, v = self.projections(h, slots)  # (T, Hq*D), (T, Hkv*D), (T, Hkv*D)
        return self.heads(self.norm(q, self.q_norm), self.norm(k, self.k_norm), v)


class Olmo2ForCausalLM(llama.LlamaForCausalLM):
    """OLMo 2: the Llama decoder over `Olmo2Layer`s."""

    layer_module = Olmo2Layer


def weights(spec: ModelSpec, num_cache_kv_heads: int, tensor_parallel_size: int) -> dict:
    """The Llama family's declarations with OLMo 2's norms: none before the attention, one after each sub-layer,
    q / k norms as wide as their projections (split and repeated with their heads)."""
    tree = llama.weights(spec, num_cache_kv_heads, tensor_parallel_size)
    layers = tree["layers"]
    norm = layers.pop("input_norm")
    q_width, kv_width = spec.num_heads * spec.head_dim, num_cache_kv_heads * spec.head_dim
    split = P(None, MODEL_AXIS)
    layers.update({
        "post_ffw_norm": dataclasses.replace(norm, hf_name="model.layers.{i}.post_feedforward_layernorm.weight"),
        "q_norm": Weight("model.layers.{i}.self_attn.q_norm.weight", (spec.num_layers, q_width), split, ones=True),
        "k_norm": Weight("model.layers.{i}.self_attn.k_norm.weight", (spec.num_layers, kv_width), split, ones=True,
                         kv_heads=True),
    })
    return tree


register(OLMO2, Model(spec_from_config=olmo2_spec, weights=weights, module=Olmo2ForCausalLM, lora=True))
