"""IBM Granite 3.x (`GraniteForCausalLM`): the Llama layer with four scalars, as transformers applies them: the
embeddings times `embedding_multiplier`, the attention scores scaled by `attention_multiplier` (not 1 / sqrt(D)),
each sub-layer's output times `residual_multiplier` before its residual, the logits divided by `logits_scaling`.
Its weights are the Llama family's (model/llama.py's declarations)."""

from __future__ import annotations

import dataclasses

import jax

from jaxserve.model import llama
from jaxserve.model.layers import StepContext
from jaxserve.model.registry import Model, register
from jaxserve.model_spec import ModelSpec, llama_family_spec

GRANITE = ("GraniteForCausalLM",)


@dataclasses.dataclass(frozen=True)
class GraniteSpec(ModelSpec):
    """A Granite checkpoint's spec: the Llama family's and its multipliers."""

    embedding_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0


def granite_spec(arch: str, config: dict, generation_config: dict) -> GraniteSpec:
    """The spec of a Granite config; a ValueError for attention or MLP biases (the module has none)."""
    if config.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported for GraniteForCausalLM")
    base = llama_family_spec("LlamaForCausalLM", config, generation_config)
    return base.extended(GraniteSpec, architecture=arch,
                         embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
                         attention_multiplier=float(config.get("attention_multiplier", base.head_dim**-0.5)),
                         residual_multiplier=float(config.get("residual_multiplier", 1.0)),
                         logits_scaling=float(config.get("logits_scaling", 1.0)))


class GraniteLayer(llama.LlamaLayer):
    """The Llama layer with Granite's attention scale and residual multiplier."""

    def __call__(self, x: jax.Array, caches: tuple[jax.Array, ...], layer: jax.Array, rope: tuple[jax.Array, ...],
                 step: StepContext) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """The layer over the step's tokens: (x, caches) after it."""
        # x: (T, H); rope: cos, sin (T, rotary dims // 2) each
        scale = self.spec.residual_multiplier
        attn, caches = self.self_attention(self.norm(x, self.input_norm), caches, layer, rope, step)  # (T, H)
        x = x + attn * scale
        return x + self.feed_forward(self.norm(x, self.post_norm), step) * scale, caches  # (T, H)

    def attention_scale(self) -> float:
        """Granite's `attention_multiplier`."""
        return self.spec.attention_multiplier


class GraniteForCausalLM(llama.LlamaForCausalLM):
    """Granite: the Llama decoder over `GraniteLayer`s, scaled embeddings and logits."""

    layer_module = GraniteLayer

    def embed_tokens(self, token_ids: jax.Array) -> jax.Array:
        """The embeddings times `embedding_multiplier`."""
        # token_ids: (T,) int32 -> (T, H)
        return super().embed_tokens(token_ids) * self.spec.embedding_multiplier

    def logits(self, hidden: jax.Array) -> jax.Array:
        """The Llama head's logits over `logits_scaling` (a classifier's score head's unscaled)."""
        # hidden: (N, H) -> (N, V) float32
        logits = super().logits(hidden)
        return logits if self.spec.classifier is not None else logits / self.spec.logits_scaling


register(GRANITE, Model(spec_from_config=granite_spec, weights=llama.weights, module=GraniteForCausalLM, lora=True))
