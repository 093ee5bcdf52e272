"""Phi-3 and Phi-4 (`Phi3ForCausalLM`: Phi-3-mini / medium, Phi-3.5-mini, Phi-4, Phi-4-mini): the Llama layer
(model/llama.py's module and weights) read from a checkpoint that fuses q, k, v into one `qkv_proj` and the MLP's
gate and up into one `gate_up_proj` (model/loader.py's FusedRows reads the parts apart, each shard only its rows),
with LongRoPE (`rope_scaling` longrope, the long factors when max_model_len exceeds the original context: vLLM's
choice), a partial rotary embedding (`partial_rotary_factor`) and an optional sliding window. LoRA adapters of the
fused projections are read as adapters of their parts (model/lora.py)."""

from __future__ import annotations

from jaxserve.model import llama
from jaxserve.model.registry import Model, register
from jaxserve.model_spec import ModelSpec, llama_family_spec

PHI3 = ("Phi3ForCausalLM",)


def phi3_spec(arch: str, config: dict, generation_config: dict) -> ModelSpec:
    """The spec of a Phi-3 config: the Llama family's fields (its sliding window when set); a ValueError for a
    checkpoint quantized ahead (its fused tensors' scales are not read apart: serve the float checkpoint with
    `quantization` int8 or fp8) or a rope type Phi-3 does not have."""
    if config.get("quantization_config"):
        raise ValueError("quantized Phi-3 checkpoints (fused qkv_proj / gate_up_proj with their scales) are not "
                         "supported: serve the float checkpoint, with `quantization: int8` or `fp8` to quantize it "
                         "at load")
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    if rope.get("rope_type", rope.get("type")) == "yarn":  # Phi-3's configs name LongRoPE so too (transformers)
        config = {**config, "rope_scaling": {**rope, "rope_type": "longrope"}, "rope_parameters": None}
    return llama_family_spec(arch, config, generation_config)


def fused_parts(spec: ModelSpec) -> dict[str, tuple[str, int, int]]:
    """The declared projections Phi-3 stores fused: each module suffix -> (the fused module, first row, rows)."""
    q_rows, kv_rows, inner = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    return {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q_rows),
        "self_attn.k_proj": ("self_attn.qkv_proj", q_rows, kv_rows),
        "self_attn.v_proj": ("self_attn.qkv_proj", q_rows + kv_rows, kv_rows),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inner),
        "mlp.up_proj": ("mlp.gate_up_proj", inner, inner),
    }


register(PHI3, Model(spec_from_config=phi3_spec, weights=llama.weights, module=llama.LlamaForCausalLM, lora=True,
                     fused=fused_parts))
