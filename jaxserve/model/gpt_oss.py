"""gpt-oss (`GptOssForCausalLM`: openai/gpt-oss-20b and -120b) as Flax NNX modules: the Llama layer with its
differences, as transformers 5 writes them (`modeling_gpt_oss.py`).

- Attention: q, k, v and o projections with biases; a learned sink logit per query head that joins each query's
  softmax denominator (`StepContext.attend`'s `sinks`: the attention backends fold it in); sliding layers (a
  window of `sliding_window` keys) and full layers alternating as `layer_types` lists them (each layer picks its
  kind's attention by a traced index, as Gemma's do); YaRN rope.
- RMSNorm weights the float32 normalised value before the cast back (Llama casts first).
- The feed-forward is a mixture of experts (model/moe.py): a router with a bias, each token's top-k experts
  weighted by the softmax of their k logits; each expert's gate and up projections are one fused tensor with
  their columns interleaved and a bias, its activation clamped ((up + 1) * gate * sigmoid(alpha * gate), gate
  clamped above at `swiglu_limit`, up within it: `moe.clamped_swiglu`), and its down projection's bias is added
  with the routing weights.

Tensor parallelism splits attention by heads (each head's sink with it) and each expert by its inner size (the
fused gate/up by columns, a device keeping whole gate/up pairs), or, with `enable_expert_parallel`, the experts
whole.

Params: the Llama family's attention (model/llama.py, with q/k/v biases) plus
    layers/bo (L, H)                     o_proj's bias, added once after the heads' partial sums
    layers/sinks (L, Hq) float           self_attn.sinks
    layers/router (L, H, E)   layers/router_bias (L, E)
    layers/w_gate_up (L, E, H, 2I)   layers/b_gate_up (L, E, 2I)      gate and up interleaved by column
    layers/w_down (L, E, I, H)       layers/b_down (L, E, H)
The checkpoint's experts are one tensor per layer, (E, in, out) as stored by transformers (the Hub's BF16
copies), or, in the original release (openai/gpt-oss-20b, -120b: quant_method mxfp4), MXFP4: each projection's
`_blocks` (E, out, in / 32, 16) FP4 codes two to a byte and `_scales` (E, out, in / 32) power-of-two scales, one per
32 inputs, which model/loader.py's Mxfp4Experts view dequantizes as they load (each device reading its experts'
rows and blocks), as transformers' Mxfp4Config(dequantize=True) does: served in the dtype asked for, or quantized
by `quantization` int8 / fp8 as a float checkpoint is.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.attention.base import LayerAttention
from jaxserve.model import llama, moe
from jaxserve.model.gemma import SLIDING, _layer_kinds
from jaxserve.model.layers import StepContext, apply_rope, project, projection, weight_value
from jaxserve.model.moe_llama import MoeSpec
from jaxserve.model.registry import Model, Weight, register
from jaxserve.model_spec import checkpoint_quantization_fields, llama_family_spec
from jaxserve.sharding import MODEL_AXIS


@dataclasses.dataclass(frozen=True)
class GptOssSpec(MoeSpec):
    """A gpt-oss checkpoint's spec: `sliding_window` is the sliding layers' window."""

    layer_kinds: tuple[int, ...] = ()  # model/gemma.py's FULL or SLIDING, per layer
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702


def gpt_oss_spec(arch: str, config: dict, generation_config: dict) -> GptOssSpec:
    """The spec of a gpt-oss config; a ValueError for what the module does not implement."""
    quantization = checkpoint_quantization_fields(config.get("quantization_config"), mxfp4_experts=True)
    if not config.get("attention_bias", True):
        raise ValueError("gpt-oss without attention biases (attention_bias false) is not supported")
    num_layers = config["num_hidden_layers"]
    dense = {key: value for key, value in config.items()
             if key not in ("attention_bias", "sliding_window", "quantization_config")}
    base = llama_family_spec("LlamaForCausalLM", dense, generation_config)
    return base.extended(
        GptOssSpec, architecture=arch, qkv_bias=True, sliding_window=config.get("sliding_window"), attention_sinks=True,
        num_experts=config["num_local_experts"], num_experts_per_tok=config["num_experts_per_tok"],
        normalize_top_k=True, round_weights=True, layer_kinds=_layer_kinds(arch, config, num_layers),
        swiglu_limit=float(config.get("swiglu_limit", 7.0)), swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
        reasoning_parser="openai_gptoss", **quantization)


class GptOssLayer(llama.LlamaLayer):
    """One gpt-oss decoder layer (see the module docstring)."""

    def __init__(self, params: dict, spec: GptOssSpec):
        super().__init__(params, spec)
        self.bo, self.sinks = nnx.Param(params["bo"]), nnx.Param(params["sinks"])

    def init_feed_forward(self, params: dict) -> None:
        """The router and the experts' variables."""
        self.router, self.router_bias = nnx.Param(params["router"]), nnx.Param(params["router_bias"])
        self.w_gate_up, self.w_down = projection(params["w_gate_up"]), projection(params["w_down"])
        self.b_gate_up, self.b_down = nnx.Param(params["b_gate_up"]), nnx.Param(params["b_down"])

    def self_attention(self, h: jax.Array, caches: tuple[jax.Array, ...], layer: jax.Array,
                       rope: tuple[jax.Array, ...], step: StepContext) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """q, k, v -> RoPE -> paged attention with the heads' sinks, windowed on sliding layers -> o (+ its bias)."""
        # h: (T, H) -> (T, H)
        spec = self.spec
        q, k, v = self.qkv(h)  # (T, Hq, D), (T, Hkv, D), (T, Hkv, D)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        kind = jnp.asarray(spec.layer_kinds, jnp.int32)[layer]  # () FULL or SLIDING
        hows = tuple(LayerAttention(self.attention_scale(), spec.sliding_window if kind_ == SLIDING else None)
                     for kind_ in range(2))
        attn, caches = step.attend(q, k, v, caches, layer, hows, kind, self.kv_scales(), sinks=self.sinks[...])
        out = project(attn.reshape(attn.shape[0], -1), self.wo)  # (T, H)
        return out + self.bo[...].astype(out.dtype), caches

    def feed_forward(self, h: jax.Array, step: StepContext) -> jax.Array:
        """The routed experts, split over the mesh by expert (expert parallelism) or within each expert."""
        # h: (T, H) -> (T, H)
        spec = self.spec
        block = moe.moe_mlp_expert_parallel if spec.expert_parallel else moe.moe_mlp_tensor_parallel
        return block(h, self.router[...], weight_value(self.w_gate_up), self.b_gate_up[...],
                     weight_value(self.w_down), mesh=step.mesh, top_k=spec.num_experts_per_tok,
                     normalize_top_k=True, round_weights=True, mlp=_experts(spec.swiglu_limit, spec.swiglu_alpha),
                     router_bias=self.router_bias[...], down_bias=self.b_down[...])

    def norm(self, x: jax.Array, weight: nnx.Param) -> jax.Array:
        """gpt-oss's RMSNorm: the weight times the float32 normalised value, then cast."""
        # x: (..., H); weight: (H,)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.spec.rms_norm_eps)
        return (weight[...] * normed).astype(x.dtype)


@functools.cache
def _experts(limit: float, alpha: float) -> moe.ExpertMLP:
    """The experts' MLP of a (limit, alpha) (one object per setting: the step traces it once)."""
    return moe.clamped_swiglu(limit, alpha)


class GptOssForCausalLM(llama.LlamaForCausalLM):
    """gpt-oss: the Llama-family decoder over `GptOssLayer`s."""

    layer_module = GptOssLayer


def weights(spec: GptOssSpec, num_cache_kv_heads: int, tensor_parallel_size: int) -> dict:
    """The Llama family's attention declarations (q/k/v biases) with o's bias and the sinks, and the router and the
    experts (one tensor per layer for all experts): split by expert under expert parallelism, else each expert by
    its inner size."""
    if spec.expert_parallel and spec.num_experts % tensor_parallel_size:
        raise ValueError(f"expert parallelism splits the {spec.num_experts} experts over the "
                         f"{tensor_parallel_size} devices: the device count must divide the experts")
    tree = llama.weights(spec, num_cache_kv_heads, tensor_parallel_size)
    layers = {name: weight for name, weight in tree["layers"].items() if name not in ("w_gate", "w_up", "w_down")}
    num_layers, hidden, inner, experts = spec.num_layers, spec.hidden_size, spec.intermediate_size, spec.num_experts
    if spec.expert_parallel:
        columns = rows = P(None, MODEL_AXIS, None, None)
        bias_columns = P(None, MODEL_AXIS, None)
    else:
        columns, rows, bias_columns = P(None, None, None, MODEL_AXIS), P(None, None, MODEL_AXIS, None), P(
            None, None, MODEL_AXIS)

    def layer(name: str, shape: tuple[int, ...], pspec: P, **storage) -> Weight:
        return Weight(f"model.layers.{{i}}.{name}", (num_layers, *shape), pspec, **storage)

    layers.update({
        "bo": layer("self_attn.o_proj.bias", (hidden,), P(None, None)),
        "sinks": layer("self_attn.sinks", (spec.num_heads,), P(None, MODEL_AXIS)),
        "router": layer("mlp.router.weight", (hidden, experts), P(None, None, None), transpose=True),
        "router_bias": layer("mlp.router.bias", (experts,), P(None, None)),
        "w_gate_up": layer("mlp.experts.gate_up_proj", (experts, hidden, 2 * inner), columns, quantizable=True),
        "b_gate_up": layer("mlp.experts.gate_up_proj_bias", (experts, 2 * inner), bias_columns),
        "w_down": layer("mlp.experts.down_proj", (experts, inner, hidden), rows, quantizable=True),
        "b_down": layer("mlp.experts.down_proj_bias", (experts, hidden), P(None, None, None)),
    })
    return {**tree, "layers": layers}


register(("GptOssForCausalLM",), Model(spec_from_config=gpt_oss_spec, weights=weights, module=GptOssForCausalLM))
