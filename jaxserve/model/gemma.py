"""Gemma, Gemma 2 and Gemma 3 (text) as Flax NNX modules: the Llama family's layer with Gemma's differences.

Gemma (the first: `GemmaForCausalLM`, and CodeGemma) is the Llama layer with the (1 + w) norm, GeGLU and the scaled,
tied embeddings below; Gemma 2 and 3 add:

- RMSNorm scales by (1 + w), in float32, and there are four norms per layer: before and after attention, before
  and after the feed-forward (whose output is normalised before its residual).
- The embeddings are multiplied by sqrt(hidden_size) (rounded to the weights' dtype); the LM head is the
  embedding's transpose; GeGLU (tanh GELU) feed-forward.
- Scores are scaled by query_pre_attn_scalar ** -0.5, soft-capped (Gemma 2: `attn_logit_softcapping`), and the
  final logits too (`final_logit_softcapping`).
- Layers are sliding (a window of `sliding_window` keys) or full (`layer_types`, or Gemma 2's alternation and Gemma
  3's `sliding_window_pattern`); in one scan, each layer picks its kind's attention (`StepContext.attend`'s `which`)
  and, in Gemma 3, its kind's rotary embedding (`rope_local_base_freq` on sliding layers) and has q/k norms.

Params: the Llama family's (model/llama.py) plus layers/pre_ffw_norm, post_ffw_norm (L, H); lm_head never.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.attention.base import LayerAttention
from jaxserve.model import llama
from jaxserve.model.layers import StepContext, apply_rope, project, rope_cos_sin
from jaxserve.model.registry import Model, map_weights, register
from jaxserve.model_spec import (
    ModelSpec,
    RopeSpec,
    checkpoint_quantization_fields,
    llama_family_spec,
    parse_eos,
    parse_rope,
)

GEMMA_FAMILY = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
FULL, SLIDING = 0, 1  # a layer's kind: its index into the (attention, rope) choices
LAYER_TYPES = {"full_attention": FULL, "sliding_attention": SLIDING}


@dataclasses.dataclass(frozen=True)
class GemmaSpec(ModelSpec):
    """A Gemma checkpoint's spec: `rope` is the full layers' rotary embedding, `sliding_window` the sliding ones'."""

    layer_kinds: tuple[int, ...] = ()  # FULL or SLIDING, per layer
    local_rope: RopeSpec | None = None  # the sliding layers' rotary embedding
    query_scale: float = 1.0  # query_pre_attn_scalar ** -0.5
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None


def gemma_spec(arch: str, config: dict, generation_config: dict) -> GemmaSpec:
    """The spec of a Gemma 2 or Gemma 3 text config; a ValueError for what the modules do not implement."""
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported hidden_activation {activation!r} for {arch}: only 'gelu_pytorch_tanh'")
    if config.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True is not supported: jaxserve serves causal decoders")
    num_heads, num_layers = config["num_attention_heads"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    global_rope, local_rope = _ropes(arch, config, head_dim)
    return GemmaSpec(
        architecture=arch,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        intermediate_size=config["intermediate_size"],
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope=global_rope,
        max_position_embeddings=config.get("max_position_embeddings", 8192),
        tie_word_embeddings=True,
        qk_norm=arch == "Gemma3ForCausalLM",
        sliding_window=config.get("sliding_window"),
        torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=parse_eos(config, generation_config),
        **checkpoint_quantization_fields(config.get("quantization_config")),
        layer_kinds=_layer_kinds(arch, config, num_layers),
        local_rope=local_rope,
        query_scale=float(config.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        attn_soft_cap=config.get("attn_logit_softcapping"),
        final_soft_cap=config.get("final_logit_softcapping"),
    )


def _layer_kinds(arch: str, config: dict, num_layers: int) -> tuple[int, ...]:
    """Each layer's kind: `layer_types` when the config lists them, else every second layer full (Gemma 2) or every
    `sliding_window_pattern`-th (Gemma 3, default 6), as transformers derives them."""
    types = config.get("layer_types")
    if types is None:
        period = 2 if arch == "Gemma2ForCausalLM" else config.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)]
    unknown = set(types) - set(LAYER_TYPES)
    if unknown or len(types) != num_layers:
        raise ValueError(f"layer_types must list {num_layers} of {', '.join(LAYER_TYPES)}; got {types}")
    if SLIDING in (kinds := tuple(LAYER_TYPES[t] for t in types)) and not config.get("sliding_window"):
        raise ValueError("sliding_attention layers need a sliding_window")
    return kinds


def _ropes(arch: str, config: dict, head_dim: int) -> tuple[RopeSpec, RopeSpec]:
    """(full layers' rope, sliding layers' rope): transformers 5's `rope_parameters` per layer type, or the full
    layers' `rope_theta` + `rope_scaling` and Gemma 3's `rope_local_base_freq` (unscaled) for the sliding ones."""
    per_type = config.get("rope_parameters") or {}
    if "full_attention" in per_type:
        return (parse_rope(config, head_dim, per_type["full_attention"]),
                parse_rope(config, head_dim, per_type.get("sliding_attention", per_type["full_attention"])))
    full = parse_rope(config, head_dim)
    if arch == "Gemma2ForCausalLM":
        return full, full
    return full, RopeSpec(theta=float(config.get("rope_local_base_freq", 10000.0)), head_dim=head_dim)


def gemma_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: x / rms(x) * (1 + w), all in float32, cast back to x's dtype at the end."""
    # x: (..., H); weight: (H,)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap), or x without a cap."""
    return x if cap is None else cap * jnp.tanh(x / cap)


class GemmaLayer(llama.LlamaLayer):
    """One Gemma decoder layer, of the kind its index has (see the module docstring)."""

    def __init__(self, params: dict, spec: GemmaSpec):
        super().__init__(params, spec)
        self.pre_ffw_norm, self.post_ffw_norm = nnx.Param(params["pre_ffw_norm"]), nnx.Param(params["post_ffw_norm"])

    def __call__(self, x: jax.Array, caches: tuple[jax.Array, ...], layer: jax.Array, rope: tuple[jax.Array, ...],
                 step: StepContext) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """The layer over the step's tokens: (x, caches) after it."""
        # x: (T, H); rope: cos, sin (2, T, D // 2) each: [FULL], [SLIDING]
        spec, slots, lora = self.spec, step.batch.lora_slots, self.lora
        kind = jnp.asarray(spec.layer_kinds, jnp.int32)[layer]  # () FULL or SLIDING
        q, k, v = self.qkv(self.norm(x, self.input_norm), slots)  # (T, Hq, D), (T, Hkv, D), (T, Hkv, D)
        cos, sin = rope[0][kind], rope[1][kind]  # (T, D // 2) each
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        hows = (LayerAttention(spec.query_scale, None, spec.attn_soft_cap),  # FULL
                LayerAttention(spec.query_scale, spec.sliding_window, spec.attn_soft_cap))  # SLIDING
        attn, caches = step.attend(q, k, v, caches, layer, hows, kind, self.kv_scales())  # (T, Hq, D)
        x = x + self.norm(project(attn.reshape(attn.shape[0], -1), self.wo, lora.get("wo"), slots),
                          self.post_norm)  # (T, H)
        h = self.norm(x, self.pre_ffw_norm)
        gate = jax.nn.gelu(project(h, self.w_gate, lora.get("w_gate"), slots), approximate=True)  # (T, I)
        down = project(gate * project(h, self.w_up, lora.get("w_up"), slots), self.w_down, lora.get("w_down"), slots)
        return x + self.norm(down, self.post_ffw_norm), caches

    def norm(self, x: jax.Array, weight: nnx.Param) -> jax.Array:
        """Gemma's RMSNorm."""
        return gemma_rms_norm(x, weight[...], self.spec.rms_norm_eps)


class GemmaForCausalLM(llama.LlamaForCausalLM):
    """Gemma 2 / 3: scaled embeddings, per-kind rotary tables, soft-capped logits."""

    layer_module = GemmaLayer

    def embed_tokens(self, token_ids: jax.Array) -> jax.Array:
        """The embeddings times sqrt(hidden_size), the factor rounded to the weights' dtype as HF does."""
        # token_ids: (T,) int32 -> (T, H)
        embed = self.embed[...]
        return embed[token_ids] * jnp.asarray(self.spec.hidden_size**0.5, embed.dtype)

    def rope_tables(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The full and the sliding layers' rotary tables."""
        # positions: (T,) int32 -> cos, sin: (2, T, D // 2) float32 each
        tables = [rope_cos_sin(positions, rope.inv_freq(), rope.attention_factor)
                  for rope in (self.spec.rope, self.spec.local_rope)]
        return jnp.stack([cos for cos, _ in tables]), jnp.stack([sin for _, sin in tables])

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final norm, the tied LM head and the final soft cap (a classifier's score head: no cap, as in
        transformers)."""
        # hidden: (N, H) -> (N, V) float32
        logits = super().logits(hidden)
        return logits if self.spec.classifier is not None else soft_cap(logits, self.spec.final_soft_cap)


def weights(spec: GemmaSpec, num_cache_kv_heads: int, tensor_parallel_size: int) -> dict:
    """The Llama family's declarations (tied head, Gemma 3's q/k norms) plus the feed-forward norms; a norm weight
    w scales by 1 + w, so random weights (load_format dummy) start it near 0, not at 1."""
    tree = llama.weights(spec, num_cache_kv_heads, tensor_parallel_size)
    layer_norm = tree["layers"]["input_norm"]
    tree["layers"]["pre_ffw_norm"] = dataclasses.replace(
        layer_norm, hf_name="model.layers.{i}.pre_feedforward_layernorm.weight")
    tree["layers"]["post_ffw_norm"] = dataclasses.replace(
        layer_norm, hf_name="model.layers.{i}.post_feedforward_layernorm.weight")
    return map_weights(lambda _, weight: dataclasses.replace(weight, ones=False) if weight.ones else weight, tree)


register(GEMMA_FAMILY, Model(spec_from_config=gemma_spec, weights=weights, module=GemmaForCausalLM, lora=True))


def gemma1_spec(arch: str, config: dict, generation_config: dict) -> ModelSpec:
    """The spec of a (first) Gemma config: the Llama family's fields with tied embeddings; a ValueError for an
    activation other than the tanh GELU (its releases' `gelu` means it, as transformers reads them)."""
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ("gelu", "gelu_pytorch_tanh"):
        raise ValueError(f"unsupported hidden_activation {activation!r} for {arch}: only 'gelu_pytorch_tanh'")
    llama_config = {**config, "hidden_act": "silu", "tie_word_embeddings": True}  # (the MLP is Gemma's GeGLU)
    return dataclasses.replace(llama_family_spec("LlamaForCausalLM", llama_config, generation_config),
                               architecture=arch)


class Gemma1Layer(llama.LlamaLayer):
    """The Llama layer with Gemma's (1 + w) norms and GeGLU feed-forward."""

    def norm(self, x: jax.Array, weight: nnx.Param) -> jax.Array:
        """Gemma's RMSNorm."""
        return gemma_rms_norm(x, weight[...], self.spec.rms_norm_eps)

    def feed_forward(self, h: jax.Array, step: StepContext) -> jax.Array:
        """The GeGLU MLP (tanh GELU)."""
        # h: (T, H) -> (T, H)
        slots, lora = step.batch.lora_slots, self.lora
        gate = jax.nn.gelu(project(h, self.w_gate, lora.get("w_gate"), slots), approximate=True)  # (T, I)
        return project(gate * project(h, self.w_up, lora.get("w_up"), slots), self.w_down, lora.get("w_down"), slots)


class Gemma1ForCausalLM(llama.LlamaForCausalLM):
    """Gemma: the Llama decoder over `Gemma1Layer`s with scaled, tied embeddings."""

    layer_module = Gemma1Layer
    embed_tokens = GemmaForCausalLM.embed_tokens


def gemma1_weights(spec: ModelSpec, num_cache_kv_heads: int, tensor_parallel_size: int) -> dict:
    """The Llama family's declarations (a tied head); a norm weight w scales by 1 + w, so random weights
    (load_format dummy) start it near 0, not at 1."""
    tree = llama.weights(spec, num_cache_kv_heads, tensor_parallel_size)
    return map_weights(lambda _, weight: dataclasses.replace(weight, ones=False) if weight.ones else weight, tree)


register(("GemmaForCausalLM",), Model(spec_from_config=gemma1_spec, weights=gemma1_weights, module=Gemma1ForCausalLM,
                                      lora=True))
