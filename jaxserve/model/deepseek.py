"""DeepSeek-V3's decoder (DeepseekV3ForCausalLM: DeepSeek-V3, R1, and the models built on it, Kimi K2, Moonlight)
as Flax NNX modules: multi-head latent attention (MLA) and DeepSeek's mixture of experts.

Attention. Each token's keys and values come from one compressed latent: kv_a_proj gives a latent c (r wide, then
RMSNorm'd) and one rotary key k_pe (dr) shared by every head; kv_b_proj expands c into each head's no-rope key
(dn) and value (dv). Queries go through a low-rank pair (q_a_proj, RMSNorm, q_b_proj; one q_proj without
q_lora_rank) into each head's no-rope part (dn) and rotary part (dr). The cache holds the latent, not the heads:
the attention runs "absorbed", as DeepSeek's own inference does. A head's score q_nope . k_nope equals
(q_nope W_UK^T) . c, so each query is taken into the latent space (q_lat = q_nope W_UK^T, r wide) and the step
attends with one KV head of width r + dr shared by all query heads: key [c, k_pe], value [c, 0]; each head's
output (r wide) is taken back through W_UV into its dv values. The KV pool thus holds r + dr values per token
per layer for keys and as many for values (2 x 576 for V3, against 2 x 128 x 192 for the expanded heads). The
rotary parts use YaRN's tables over dr dims, in DeepSeek's interleaved pairs (`rope_interleave`: each head's
rotary dims are de-interleaved into the rotate-half layout first, the same permutation for q and k, so the
scores are HF's); the softmax scale is (dn + dr)^-1/2 times YaRN's mscale squared (`mscale_all_dim`).

Feed-forward. The first `first_k_dense_replace` layers have a dense SwiGLU MLP; the others a mixture of experts
(model/moe.py) routed as DeepSeek-V3 routes (`moe.grouped_sigmoid_routing`: sigmoid scores, a score-correction
bias for the choice, the best `topk_group` of `n_group` expert groups, top-k experts in them, renormalised and
times `routed_scaling_factor`), plus shared experts every token takes (one SwiGLU MLP of n_shared_experts x the
expert's inner size). The two kinds of layers are two stacks (`dense_layers`, `layers`), each one `lax.scan`.

Params (Ld dense layers, Lm sparse ones; every attention leaf in both stacks):
    embed (V, H)   lm_head (H, V)   final_norm (H,)
    input_norm, post_norm (L, H)
    wq_a (L, H, rq)  q_a_norm (L, rq)  wq_b (L, rq, Hq * (dn + dr))     (wq (L, H, Hq * (dn + dr)) without rq)
    wkv_a (L, H, r + dr)  kv_a_norm (L, r)  wkv_b (L, r, Hq * (dn + dv))  wo (L, Hq * dv, H)
    dense_layers/w_gate, w_up (Ld, H, I)  w_down (Ld, I, H)
    layers/router (Lm, H, E)  router_bias (Lm, E)  w_gate, w_up (Lm, E, H, Ie)  w_down (Lm, E, Ie, H)
    layers/shared_w_gate, shared_w_up (Lm, H, Is)  shared_w_down (Lm, Is, H)
Tensor parallelism splits the query heads (wq_b / wq and wkv_b by columns, wo by rows), the MLPs and experts as
the Llama and MoE families do; the latent path (wq_a, wkv_a and their norms) is replicated, and the one latent KV
head is held once per device.

Quantization. Every projection above but the router is `quantizable` in both stacks: the releases' fp8 weights
with a scale per block of 128 x 128 (quant_method fp8, `weight_scale_inv`) are served as stored, and a float
checkpoint takes `quantization` int8 / fp8 (model/quantize.py). kv_b_proj, split into its key and value halves
rather than multiplied once, is dequantized where the step reads it (`float_weight`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.attention.base import LayerAttention
from jaxserve.model import llama, moe
from jaxserve.model.layers import (
    StepContext,
    apply_rope,
    float_weight,
    lora_slots,
    optional_param,
    project,
    projection,
    weight_value,
)
from jaxserve.model.moe_llama import MoeSpec
from jaxserve.model.registry import Model, Weight, register
from jaxserve.model_spec import llama_family_spec
from jaxserve.sharding import MODEL_AXIS, cache_kv_heads

ARCHITECTURES = ("DeepseekV3ForCausalLM",)


@dataclasses.dataclass(frozen=True)
class DeepseekSpec(MoeSpec):
    """A DeepSeek-V3 checkpoint's spec. `head_dim` is the cache's (r + dr: the latent and the rotary key),
    `num_kv_heads` 1 (the latent), `intermediate_size` an expert's inner size."""

    q_lora_rank: int | None = None  # rq; None: one q_proj
    kv_lora_rank: int = 0  # r
    qk_nope_head_dim: int = 0  # dn
    qk_rope_head_dim: int = 0  # dr
    v_head_dim: int = 0  # dv
    rope_interleave: bool = True  # the rotary dims come in interleaved pairs
    softmax_scale: float = 1.0  # (dn + dr)^-1/2 times YaRN's mscale squared
    first_dense_layers: int = 0  # first_k_dense_replace
    dense_intermediate_size: int = 0  # the dense layers' MLP's inner size
    num_groups: int = 1  # n_group
    top_groups: int = 1  # topk_group
    routed_scaling_factor: float = 1.0


def deepseek_spec(arch: str, config: dict, generation_config: dict) -> DeepseekSpec:
    """The spec of a DeepSeek-V3 config (transformers' defaults for what it leaves out); a ValueError for what the
    module does not implement."""
    if config.get("attention_bias"):
        raise ValueError("DeepSeek-V3 with attention_bias=True is not supported")
    if config.get("scoring_func", "sigmoid") != "sigmoid" or config.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"DeepSeek-V3 routes with sigmoid scores and topk_method noaux_tc (transformers' "
                         f"DeepseekV3); got scoring_func {config.get('scoring_func')!r}, topk_method "
                         f"{config.get('topk_method')!r}")
    if config.get("moe_layer_freq", 1) != 1:
        raise ValueError("DeepSeek-V3 with moe_layer_freq != 1 is not supported: every layer after the dense ones "
                         "must be sparse")
    num_layers, dense = config["num_hidden_layers"], config.get("first_k_dense_replace", 3)
    if not 0 <= dense < num_layers:
        raise ValueError(f"first_k_dense_replace {dense} leaves none of the {num_layers} layers sparse")
    experts, groups = config.get("n_routed_experts", 256), config.get("n_group", 8)
    if experts % groups or not 1 <= config.get("topk_group", 4) <= groups:
        raise ValueError(f"the {experts} experts must split into n_group {groups} equal groups, and topk_group must "
                         f"be in [1, {groups}]")
    rope_dims, latent = config.get("qk_rope_head_dim", 64), config.get("kv_lora_rank", 512)
    nope = config.get("qk_nope_head_dim", 128)
    inner = config.get("moe_intermediate_size", 2048)
    base = llama_family_spec("LlamaForCausalLM", {**config, "head_dim": rope_dims, "intermediate_size": inner,
                                                  "attention_bias": False}, generation_config)
    scale = (nope + rope_dims) ** -0.5
    rope_parameters = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    all_dims, factor = rope_parameters.get("mscale_all_dim"), rope_parameters.get("factor", 1.0)
    if base.rope.rope_type != "default" and all_dims and factor > 1:
        scale *= (0.1 * all_dims * math.log(factor) + 1.0) ** 2  # transformers' yarn_apply_mscale
    return base.extended(
        DeepseekSpec, architecture=arch, num_kv_heads=1, head_dim=latent + rope_dims,
        num_experts=experts, num_experts_per_tok=config.get("num_experts_per_tok", 8),
        normalize_top_k=bool(config.get("norm_topk_prob", True)),
        shared_expert_size=config.get("n_shared_experts", 1) * inner,
        q_lora_rank=config.get("q_lora_rank", 1536), kv_lora_rank=latent, qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dims, v_head_dim=config.get("v_head_dim", 128),
        rope_interleave=bool(config.get("rope_interleave", True)), softmax_scale=scale, first_dense_layers=dense,
        dense_intermediate_size=config.get("intermediate_size", 18432), num_groups=groups,
        top_groups=config.get("topk_group", 4), routed_scaling_factor=float(config.get("routed_scaling_factor", 2.5)))


class DeepseekLayer(llama.LlamaLayer):
    """A dense DeepSeek layer: RMSNorm -> multi-head latent attention, then RMSNorm -> SwiGLU MLP, each with its
    residual (LlamaLayer's `__call__` over its own attention)."""

    def __init__(self, params: dict, spec: DeepseekSpec):
        self.spec = spec
        self.input_norm, self.post_norm = nnx.Param(params["input_norm"]), nnx.Param(params["post_norm"])
        self.wq, self.wq_a, self.wq_b = (projection(params[leaf]) if leaf in params else None
                                         for leaf in ("wq", "wq_a", "wq_b"))
        self.q_a_norm = optional_param(params, "q_a_norm")
        self.wkv_a, self.kv_a_norm = projection(params["wkv_a"]), nnx.Param(params["kv_a_norm"])
        self.wkv_b, self.wo = projection(params["wkv_b"]), projection(params["wo"])
        self.k_scale = self.v_scale = None
        self.lora = lora_slots(params)  # (none: DeepSeek serves no adapters)
        self.init_feed_forward(params)

    def self_attention(self, h: jax.Array, caches: tuple[jax.Array, ...], layer: jax.Array,
                       rope: tuple[jax.Array, ...], step: StepContext) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """Multi-head latent attention, absorbed (the module docstring): (the attention's output, caches)."""
        # h: (T, H) -> (T, H)
        spec = self.spec
        num_tokens, latent, nope = h.shape[0], spec.kv_lora_rank, spec.qk_nope_head_dim
        if self.wq is not None:
            q = project(h, self.wq)  # (T, Hq * (dn + dr))
        else:
            q = project(self.norm(project(h, self.wq_a), self.q_a_norm), self.wq_b)
        q = q.reshape(num_tokens, -1, nope + spec.qk_rope_head_dim)  # (T, Hq, dn + dr)
        q_nope, q_pe = q[..., :nope], q[..., nope:]  # (T, Hq, dn), (T, Hq, dr)
        kv = project(h, self.wkv_a)  # (T, r + dr)
        c = self.norm(kv[:, :latent], self.kv_a_norm)[:, None, :]  # (T, 1, r)
        k_pe = kv[:, None, latent:]  # (T, 1, dr)
        if spec.rope_interleave:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = apply_rope(q_pe, *rope), apply_rope(k_pe, *rope)
        w_kv_b = float_weight(self.wkv_b, h.dtype).reshape(latent, -1, nope + spec.v_head_dim)  # (r, Hq, dn + dv)
        w_uk, w_uv = w_kv_b[..., :nope], w_kv_b[..., nope:]  # (r, Hq, dn), (r, Hq, dv)
        q_latent = jnp.einsum("thd,rhd->thr", q_nope, w_uk)  # (T, Hq, r)
        query = jnp.concatenate([q_latent, q_pe], axis=-1)  # (T, Hq, r + dr)
        heads = cache_kv_heads(spec, step.mesh.devices.size)  # the latent head, once per device
        key = jnp.broadcast_to(jnp.concatenate([c, k_pe], axis=-1), (num_tokens, heads, latent + spec.qk_rope_head_dim))
        value = jnp.broadcast_to(jnp.concatenate([c, jnp.zeros_like(k_pe)], axis=-1), key.shape)  # (T, heads, r+dr)
        how = LayerAttention(sm_scale=spec.softmax_scale)
        out, caches = step.attend(query, key, value, caches, layer, (how,))  # (T, Hq, r + dr)
        values = jnp.einsum("thr,rhv->thv", out[..., :latent], w_uv)  # (T, Hq, dv)
        return project(values.reshape(num_tokens, -1), self.wo), caches


def _deinterleave(x: jax.Array) -> jax.Array:
    """Rotary dims in interleaved pairs (x0, x1), (x2, x3), ... laid out rotate-half: evens, then odds."""
    # x: (T, heads, dr) -> (T, heads, dr)
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class DeepseekMoeLayer(DeepseekLayer):
    """A sparse DeepSeek layer: its MLP a mixture of experts routed DeepSeek-V3's way, plus the shared experts."""

    def init_feed_forward(self, params: dict) -> None:
        """The router, its score-correction bias, the experts and the shared experts."""
        self.router, self.router_bias = nnx.Param(params["router"]), nnx.Param(params["router_bias"])
        self.w_gate, self.w_up, self.w_down = (projection(params[leaf]) for leaf in ("w_gate", "w_up", "w_down"))
        self.shared_w_gate, self.shared_w_up, self.shared_w_down = (
            projection(params[leaf]) for leaf in ("shared_w_gate", "shared_w_up", "shared_w_down"))

    def feed_forward(self, h: jax.Array, step: StepContext) -> jax.Array:
        """The routed experts (split over the mesh by expert or within each expert) plus the shared experts."""
        # h: (T, H) -> (T, H)
        spec = self.spec
        chosen = moe.grouped_sigmoid_routing(h, self.router[...], self.router_bias[...], top_k=spec.num_experts_per_tok,
                                             num_groups=spec.num_groups, top_groups=spec.top_groups,
                                             normalize_top_k=spec.normalize_top_k, scale=spec.routed_scaling_factor)
        block = moe.experts_expert_parallel if spec.expert_parallel else moe.experts_tensor_parallel
        routed = block(h, chosen, *(weight_value(w) for w in (self.w_gate, self.w_up, self.w_down)),
                       mesh=step.mesh)  # (T, H)
        gate = jax.nn.silu(project(h, self.shared_w_gate))  # (T, Is)
        return routed + project(gate * project(h, self.shared_w_up), self.shared_w_down)


class DeepseekForCausalLM(llama.LlamaForCausalLM):
    """DeepSeek-V3: the embedding, the dense layers' scan, the sparse layers' scan, the final norm and LM head."""

    def __init__(self, params: dict, spec: DeepseekSpec):
        self.spec = spec
        self.embed, self.final_norm = nnx.Param(params["embed"]), nnx.Param(params["final_norm"])
        self.lm_head, self.lm_head_bias = optional_param(params, "lm_head"), None
        self.dense_layers = DeepseekLayer(params["dense_layers"], spec) if spec.first_dense_layers else None
        self.layers = DeepseekMoeLayer(params["layers"], spec)

    def layer_stacks(self) -> tuple[tuple[nnx.Module, int], ...]:
        """The dense layers (if any), then the sparse ones, each with its first layer's index."""
        sparse = ((self.layers, self.spec.first_dense_layers),)
        return sparse if self.dense_layers is None else ((self.dense_layers, 0), *sparse)


def weights(spec: DeepseekSpec, num_cache_kv_heads: int, tensor_parallel_size: int) -> dict:
    """Every params leaf (the module docstring's) with its Hugging Face tensor, shape and sharding."""
    tp = tensor_parallel_size
    for name, size in (("intermediate_size", spec.dense_intermediate_size), ("shared experts' inner size",
                                                                              spec.shared_expert_size)):
        if size % tp:
            raise ValueError(f"the {name} ({size}) must be divisible by tensor_parallel_size ({tp})")
    if spec.expert_parallel and spec.num_experts % tp:
        raise ValueError(f"expert parallelism splits the {spec.num_experts} experts over the {tp} devices: the "
                         f"device count must divide the experts")
    hidden, heads, latent = spec.hidden_size, spec.num_heads, spec.kv_lora_rank
    query_width = heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim)
    columns, rows, replicated = P(None, None, MODEL_AXIS), P(None, MODEL_AXIS, None), P(None, None)
    whole = P(None, None, None)  # a per-layer matrix on every device
    num_dense, num_sparse = spec.first_dense_layers, spec.num_layers - spec.first_dense_layers

    def stack(first: int, count: int) -> dict:
        def layer(name: str, shape: tuple[int, ...], pspec: P, **storage) -> Weight:
            return Weight(f"model.layers.{{i}}.{name}", (count, *shape), pspec, first_layer=first, **storage)

        def linear(name: str, shape: tuple[int, int], pspec: P) -> Weight:
            return layer(f"{name}.weight", shape, pspec, transpose=True, quantizable=True)

        leaves = {
            "input_norm": layer("input_layernorm.weight", (hidden,), replicated, ones=True),
            "post_norm": layer("post_attention_layernorm.weight", (hidden,), replicated, ones=True),
            "wkv_a": linear("self_attn.kv_a_proj_with_mqa", (hidden, latent + spec.qk_rope_head_dim), whole),
            "kv_a_norm": layer("self_attn.kv_a_layernorm.weight", (latent,), replicated, ones=True),
            "wkv_b": linear("self_attn.kv_b_proj", (latent, heads * (spec.qk_nope_head_dim + spec.v_head_dim)),
                            columns),
            "wo": linear("self_attn.o_proj", (heads * spec.v_head_dim, hidden), rows),
        }
        if spec.q_lora_rank is None:
            leaves["wq"] = linear("self_attn.q_proj", (hidden, query_width), columns)
        else:
            leaves.update({
                "wq_a": linear("self_attn.q_a_proj", (hidden, spec.q_lora_rank), whole),
                "q_a_norm": layer("self_attn.q_a_layernorm.weight", (spec.q_lora_rank,), replicated, ones=True),
                "wq_b": linear("self_attn.q_b_proj", (spec.q_lora_rank, query_width), columns),
            })
        return leaves

    dense = stack(0, num_dense)
    inner = spec.dense_intermediate_size
    for name, hf_name, shape, pspec in (("w_gate", "gate_proj", (hidden, inner), columns),
                                        ("w_up", "up_proj", (hidden, inner), columns),
                                        ("w_down", "down_proj", (inner, hidden), rows)):
        dense[name] = Weight(f"model.layers.{{i}}.mlp.{hf_name}.weight", (num_dense, *shape), pspec, transpose=True,
                             quantizable=True)
    sparse = stack(num_dense, num_sparse)
    experts, expert_inner, shared = spec.num_experts, spec.intermediate_size, spec.shared_expert_size
    if spec.expert_parallel:
        expert_columns = expert_rows = P(None, MODEL_AXIS, None, None)
    else:
        expert_columns, expert_rows = P(None, None, None, MODEL_AXIS), P(None, None, MODEL_AXIS, None)

    def sparse_leaf(name: str, shape: tuple[int, ...], pspec: P, **storage) -> Weight:
        return Weight(f"model.layers.{{i}}.mlp.{name}", (num_sparse, *shape), pspec, first_layer=num_dense,
                      **storage)

    def sparse_linear(name: str, shape: tuple[int, ...], pspec: P) -> Weight:
        return sparse_leaf(f"{name}.weight", shape, pspec, transpose=True, quantizable=True)

    sparse.update({
        "router": sparse_leaf("gate.weight", (hidden, experts), whole, transpose=True),
        "router_bias": sparse_leaf("gate.e_score_correction_bias", (experts,), P(None, None)),
        "w_gate": sparse_linear("experts.{j}.gate_proj", (experts, hidden, expert_inner), expert_columns),
        "w_up": sparse_linear("experts.{j}.up_proj", (experts, hidden, expert_inner), expert_columns),
        "w_down": sparse_linear("experts.{j}.down_proj", (experts, expert_inner, hidden), expert_rows),
        "shared_w_gate": sparse_linear("shared_experts.gate_proj", (hidden, shared), columns),
        "shared_w_up": sparse_linear("shared_experts.up_proj", (hidden, shared), columns),
        "shared_w_down": sparse_linear("shared_experts.down_proj", (shared, hidden), rows),
    })
    tree = {"embed": Weight("model.embed_tokens.weight", (spec.vocab_size, hidden), replicated),
            "final_norm": Weight("model.norm.weight", (hidden,), P(None), ones=True), "layers": sparse}
    if num_dense:
        tree["dense_layers"] = dense
    if not spec.tie_word_embeddings:
        vocab_split = MODEL_AXIS if spec.vocab_size % tp == 0 else None
        tree["lm_head"] = Weight("lm_head.weight", (hidden, spec.vocab_size), P(None, vocab_split), transpose=True)
    return tree


register(ARCHITECTURES, Model(spec_from_config=deepseek_spec, weights=weights, module=DeepseekForCausalLM,
                             fp8_kv_cache=False, classifiers=False))
