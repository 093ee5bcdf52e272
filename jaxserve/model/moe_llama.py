"""Mixture-of-experts decoders with the Llama family's attention: Mixtral, Qwen2-MoE and Qwen3-MoE, as Flax NNX
modules.

Each layer is the Llama layer (Qwen2-MoE with Qwen2's q/k/v biases, Qwen3-MoE with Qwen3's q/k norms) whose MLP is a
sparse mixture of SwiGLU experts (model/moe.py): a router picks each token's top-k experts (softmax, top-k,
renormalised for Mixtral and for the Qwens' `norm_topk_prob`), and only the routed (token, expert) pairs are
computed. Qwen2-MoE adds a shared expert every token takes: a dense SwiGLU MLP scaled by the sigmoid of its own
one-output gate.

Parallelism over the `model` mesh axis: attention is split by heads as in the Llama family; the experts are
either each split like a dense MLP (tensor parallelism: w_gate, w_up by I columns, w_down by I rows) or, with
`enable_expert_parallel` (vLLM's flag), split whole across the devices (E / N experts each): every device routes
every token, runs the assignments to its own experts, and the partial outputs are summed (`psum`).

Params: the Llama family's (model/llama.py) with per-expert MLP leaves and a router:
    layers/router (L, H, E)
    layers/w_gate, w_up (L, E, H, I)   layers/w_down (L, E, I, H)      I: the expert's inner size
and Qwen2-MoE's shared expert (split over the mesh like a dense MLP):
    layers/shared_gate (L, H, 1)
    layers/shared_w_gate, shared_w_up (L, H, Is)   layers/shared_w_down (L, Is, H)   Is: its inner size
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.model import llama, moe
from jaxserve.model.layers import StepContext, optional_param, project, projection, weight_value
from jaxserve.model.registry import Model, Weight, register
from jaxserve.model_spec import ModelSpec, llama_family_spec
from jaxserve.sharding import MODEL_AXIS

# architecture -> (the Llama-family architecture whose attention it has, the MoE block's HF prefix, the HF names of
# the expert's gate, up and down projections)
MOE_ARCHITECTURES = {
    "MixtralForCausalLM": ("MistralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2")),
    "Qwen2MoeForCausalLM": ("Qwen2ForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "Qwen3MoeForCausalLM": ("Qwen3ForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
}
QWEN_MOES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")  # their config's names, router and dense layers


@dataclasses.dataclass(frozen=True)
class MoeSpec(ModelSpec):
    """A mixture-of-experts checkpoint's spec; `intermediate_size` is each expert's inner size."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    normalize_top_k: bool = True  # renormalise the top-k routing weights to sum to 1
    round_weights: bool = False  # the routing weights are cast to the activations' dtype before combining
    shared_expert_size: int = 0  # Qwen2-MoE's shared expert's inner size (0: none)


def moe_spec(arch: str, config: dict, generation_config: dict) -> MoeSpec:
    """The spec of a Mixtral, Qwen2-MoE or Qwen3-MoE config; a ValueError for a layout the module does not
    implement."""
    attention_arch = MOE_ARCHITECTURES[arch][0]
    name = arch.removesuffix("ForCausalLM")
    if arch in QWEN_MOES:
        if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"{name} with dense layers (mlp_only_layers, decoder_sparse_step != 1) is not "
                             "supported: every layer must be a mixture of experts")
        inner, normalize = config["moe_intermediate_size"], config.get("norm_topk_prob", False)
    else:
        inner, normalize = config["intermediate_size"], True
    shared = config.get("shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0
    experts = config.get("num_local_experts") or config["num_experts"]  # transformers 5's name, or the Hub's
    base = llama_family_spec(attention_arch, {**config, "intermediate_size": inner}, generation_config)
    qkv_bias = bool(config.get("qkv_bias", True)) if arch == "Qwen2MoeForCausalLM" else base.qkv_bias
    return base.extended(MoeSpec, architecture=arch, qkv_bias=qkv_bias, num_experts=experts,
                         num_experts_per_tok=config["num_experts_per_tok"], normalize_top_k=bool(normalize),
                         round_weights=arch in QWEN_MOES, shared_expert_size=shared)


class MoeLayer(llama.LlamaLayer):
    """The Llama layer with a sparse mixture of experts (and Qwen2-MoE's shared expert) in place of its MLP."""

    def __init__(self, params: dict, spec: MoeSpec):
        super().__init__(params, spec)
        self.router = nnx.Param(params["router"])
        self.shared_gate = optional_param(params, "shared_gate")
        if self.shared_gate is not None:
            self.shared_w_gate, self.shared_w_up, self.shared_w_down = (
                projection(params[leaf]) for leaf in ("shared_w_gate", "shared_w_up", "shared_w_down"))

    def feed_forward(self, h: jax.Array, step: StepContext) -> jax.Array:
        """The routed experts, split over the mesh by expert (expert parallelism) or within each expert, plus the
        shared expert when the model has one."""
        # h: (T, H) -> (T, H)
        spec = self.spec
        block = moe.moe_mlp_expert_parallel if spec.expert_parallel else moe.moe_mlp_tensor_parallel
        routed = block(h, self.router[...], *(weight_value(w) for w in (self.w_gate, self.w_up, self.w_down)),
                       mesh=step.mesh, top_k=spec.num_experts_per_tok, normalize_top_k=spec.normalize_top_k,
                       round_weights=spec.round_weights)  # (T, H)
        return routed if self.shared_gate is None else routed + self.shared_expert(h)

    def shared_expert(self, h: jax.Array) -> jax.Array:
        """Qwen2-MoE's shared expert: a SwiGLU MLP every token takes, scaled by the sigmoid of its gate."""
        # h: (T, H) -> (T, H)
        gate = jax.nn.silu(project(h, self.shared_w_gate))  # (T, Is)
        out = project(gate * project(h, self.shared_w_up), self.shared_w_down)  # (T, H)
        return jax.nn.sigmoid(h @ self.shared_gate[...]) * out  # (T, 1) scales each token


class MoeForCausalLM(llama.LlamaForCausalLM):
    """Mixtral / Qwen2-MoE / Qwen3-MoE: the Llama-family decoder over `MoeLayer`s."""

    layer_module = MoeLayer


def weights(spec: MoeSpec, num_cache_kv_heads: int, tensor_parallel_size: int) -> dict:
    """The Llama family's declarations with the MLP replaced by the router and the experts (one checkpoint tensor
    per expert, stacked): split by expert under expert parallelism, else each expert by its inner size; a shared
    expert split as a dense MLP is."""
    if spec.expert_parallel and spec.num_experts % tensor_parallel_size:
        raise ValueError(f"expert parallelism splits the {spec.num_experts} experts over the "
                         f"{tensor_parallel_size} devices: the device count must divide the experts")
    tree = llama.weights(spec, num_cache_kv_heads, tensor_parallel_size)
    _, prefix, (gate, up, down) = MOE_ARCHITECTURES[spec.architecture]
    num_layers, hidden, inner, experts = spec.num_layers, spec.hidden_size, spec.intermediate_size, spec.num_experts
    if spec.expert_parallel:
        columns = rows = P(None, MODEL_AXIS, None, None)
    else:
        columns, rows = P(None, None, None, MODEL_AXIS), P(None, None, MODEL_AXIS, None)

    def expert(name: str, shape: tuple[int, int], pspec: P) -> Weight:
        return Weight(f"model.layers.{{i}}.{prefix}.experts.{{j}}.{name}.weight", (num_layers, experts, *shape),
                      pspec, transpose=True, quantizable=True)

    tree["layers"].update({
        "router": Weight(f"model.layers.{{i}}.{prefix}.gate.weight", (num_layers, hidden, experts),
                         P(None, None, None), transpose=True),
        "w_gate": expert(gate, (hidden, inner), columns),
        "w_up": expert(up, (hidden, inner), columns),
        "w_down": expert(down, (inner, hidden), rows),
    })
    if spec.shared_expert_size:
        shared = spec.shared_expert_size

        def dense(name: str, shape: tuple[int, int], pspec: P) -> Weight:
            return Weight(f"model.layers.{{i}}.{prefix}.shared_expert.{name}.weight", (num_layers, *shape), pspec,
                          transpose=True, quantizable=True)

        tree["layers"].update({
            "shared_gate": Weight(f"model.layers.{{i}}.{prefix}.shared_expert_gate.weight", (num_layers, hidden, 1),
                                  P(None, None, None), transpose=True),
            "shared_w_gate": dense(gate, (hidden, shared), P(None, None, MODEL_AXIS)),
            "shared_w_up": dense(up, (hidden, shared), P(None, None, MODEL_AXIS)),
            "shared_w_down": dense(down, (shared, hidden), P(None, MODEL_AXIS, None)),
        })
    return tree


register(tuple(MOE_ARCHITECTURES), Model(spec_from_config=moe_spec, weights=weights, module=MoeForCausalLM,
                                          lora=True))
