"""LoRA adapters served together with their base model (vLLM's multi-LoRA serving, `enable_lora`).

`max_loras` adapters are resident at once, each in a slot of the layer params: for every projection leaf of
LORA_TARGETS, params["layers"]["lora"][leaf] = {"a": (L, S, in, R), "b": (L, S, R, out)} for S = max_loras slots
of rank R = max_lora_rank (an adapter of lower rank is zero-padded; a free slot is all zeros; `b` carries the
adapter's scale, lora_alpha / r). Each token of a step names its request's slot (`BatchDescriptor.lora_slots`,
-1 for none), so requests of different adapters and of the base model share a step: a projection adds, for
every token, (x @ a[s]) @ b[s] of its slot s, computed for all slots at once ((T, S, R): S * R columns, a few
percent of the projection's own work) and masked by the token's slot (`lora_delta` in model/layers.py).

Adapters are PEFT folders (`adapter_config.json`, `adapter_model.safetensors`, as `save_pretrained` writes them):
LoRA on the attention and dense MLP projections of the architectures whose module adds them (`Model.lora`: the
Llama family, Gemma 2 / 3, Phi-3, Granite, OLMo 2; the Qwen MoEs and Mixtral on their attention, not their experts);
an adapter of a fused projection (Phi-3's qkv_proj, gate_up_proj: `Model.fused`) is read as adapters of its parts,
each with the shared A and its rows of B; what else PEFT can express (DoRA, biases, embedding or LM-head adapters,
per-module ranks, modules saved whole) is refused with the reason.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file

from jaxserve.model_spec import ModelSpec
from jaxserve.sharding import put_global

# PEFT's module name -> the projection leaf it adapts (model/llama.py)
LORA_TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w_gate",
                "up_proj": "w_up", "down_proj": "w_down"}
KV_LEAVES = ("wk", "wv")  # their columns hold KV heads, repeated when tensor parallelism exceeds them
_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


def lora_specs(projection_spec: P) -> dict[str, P]:
    """A projection's slots' PartitionSpecs from its (L, in, out) one: `a` split like its input rows, `b` like its
    output columns."""
    _, rows, columns = projection_spec
    return {"a": P(None, None, rows, None), "b": P(None, None, None, columns)}


def lora_slot_structs(model, spec: ModelSpec, num_cache_kv_heads: int, mesh: Mesh, num_slots: int, rank: int,
                      dtype) -> dict:
    """params["layers"]["lora"] as ShapeDtypeStructs in their shardings: `num_slots` slots of rank `rank` for
    each dense projection of LORA_TARGETS the architecture (`model`, model/registry.py's) has, split like it (a
    mixture of experts' experts take none); ValueError for an architecture whose module adds no adapters."""
    if not model.lora:
        raise ValueError(f"enable_lora: {spec.architecture} takes no LoRA adapters (architectures that do: the "
                         f"Llama family, Gemma 2 / 3, Phi-3, Granite, OLMo 2, and the attention of the MoEs)")
    declared_layers = model.weights(spec, num_cache_kv_heads, mesh.devices.size)["layers"]
    slots = {}
    for leaf in LORA_TARGETS.values():
        if len(declared_layers[leaf].shape) != 3:  # (L, E, in, out): experts
            continue
        num_layers, width_in, width_out = declared_layers[leaf].shape
        specs = lora_specs(declared_layers[leaf].spec)
        slots[leaf] = {
            "a": jax.ShapeDtypeStruct((num_layers, num_slots, width_in, rank), dtype,
                                      sharding=NamedSharding(mesh, specs["a"])),  # (L, S, in, R)
            "b": jax.ShapeDtypeStruct((num_layers, num_slots, rank, width_out), dtype,
                                      sharding=NamedSharding(mesh, specs["b"])),  # (L, S, R, out)
        }
    return slots


def with_lora_slots(params: dict, slots: dict) -> dict:
    """The params with params["layers"]["lora"] = `slots` (lora_slot_structs'), every slot free (zeros)."""
    zeros = jax.tree_util.tree_map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype, device=leaf.sharding), slots)
    return {**params, "layers": {**params["layers"], "lora": zeros}}


def read_adapter(path: str, spec: ModelSpec, max_rank: int, num_cache_kv_heads: int, leaves: set[str],
                 fused: dict[str, tuple[str, int, int]]) -> dict[str, tuple]:
    """A PEFT LoRA folder as each adapted leaf's (a (L, in, R), b (L, R, out)) float32 host arrays, padded to rank
    `max_rank`, scale folded into b, KV heads repeated as the cache holds them; ValueError naming what this engine
    cannot serve (`leaves`: the projections with slots; `fused`: the model's fused projections, `Model.fused`)."""
    config = _adapter_config(path)
    rank = config.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise ValueError(f"LoRA adapter {path}: rank r={rank!r} must be an integer in [1, max_lora_rank={max_rank}]")
    alpha = config.get("lora_alpha", rank)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _split_fused(load_file(_weights_file(path)), fused)
    widths = _projection_widths(spec)
    kv_repeat = num_cache_kv_heads // spec.num_kv_heads
    found: dict[str, dict[str, dict[int, np.ndarray]]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.search(name)
        if match is None or LORA_TARGETS.get(match.group(2)) not in leaves:
            served = ", ".join(module for module, leaf in LORA_TARGETS.items() if leaf in leaves)
            raise ValueError(f"LoRA adapter {path}: tensor {name!r} adapts nothing this engine serves LoRA on (the "
                             f"projections {served} of each layer)")
        layer, leaf, part = int(match.group(1)), LORA_TARGETS[match.group(2)], match.group(3).lower()
        if layer >= spec.num_layers:
            raise ValueError(f"LoRA adapter {path}: tensor {name!r} is for layer {layer}; the model has "
                             f"{spec.num_layers}")
        found.setdefault(leaf, {"a": {}, "b": {}})[part][layer] = tensor.astype(np.float32)
    adapter = {}
    for leaf, parts in found.items():
        width_in, width_out = widths[leaf]
        a = np.zeros((spec.num_layers, width_in, max_rank), np.float32)  # (L, in, R)
        b = np.zeros((spec.num_layers, max_rank, width_out), np.float32)  # (L, R, out)
        for layer in sorted(set(parts["a"]) | set(parts["b"])):
            if layer not in parts["a"] or layer not in parts["b"]:
                raise ValueError(f"LoRA adapter {path}: layer {layer}'s {leaf} has lora_A or lora_B but not both")
            a_layer, b_layer = parts["a"][layer], parts["b"][layer]  # PEFT: A (r, in), B (out, r)
            if a_layer.shape != (rank, width_in) or b_layer.shape != (width_out, rank):
                raise ValueError(f"LoRA adapter {path}: layer {layer}'s {leaf} has A {a_layer.shape} and B "
                                 f"{b_layer.shape}; this model needs ({rank}, {width_in}) and ({width_out}, {rank})")
            a[layer, :, :rank] = a_layer.T
            b[layer, :rank] = b_layer.T * scale
        if leaf in KV_LEAVES and kv_repeat > 1:  # (L, R, Hkv * D) -> (L, R, Hkv * repeat * D)
            b = np.repeat(b.reshape(spec.num_layers, max_rank, spec.num_kv_heads, spec.head_dim), kv_repeat,
                          axis=2).reshape(spec.num_layers, max_rank, -1)
        adapter[leaf] = (a, b)
    if not adapter:
        raise ValueError(f"LoRA adapter {path}: no LoRA tensors in it")
    return adapter


def _split_fused(tensors: dict[str, np.ndarray], fused: dict[str, tuple[str, int, int]]) -> dict[str, np.ndarray]:
    """The adapter's tensors with each fused projection's (`fused`: part module -> (fused module, first row, rows))
    split into its parts' adapters: every part takes the fused A (r, in) and its rows of the fused B (out, r)."""
    parts_of: dict[str, list[tuple[str, int, int]]] = {}
    for part, (whole, first, rows) in fused.items():
        parts_of.setdefault(whole, []).append((part, first, rows))
    split = {}
    for name, tensor in tensors.items():
        whole = next((module for module in parts_of if f".{module}.lora_" in name), None)
        if whole is None:
            split[name] = tensor
            continue
        for part, first, rows in parts_of[whole]:
            is_b = ".lora_B" in name  # B (out, r): the part's rows; A (r, in) shared
            split[name.replace(f".{whole}.", f".{part}.")] = tensor[first: first + rows] if is_b else tensor
    return split


def write_slot(slots: dict, slot: int, adapter: dict[str, tuple], mesh: Mesh) -> dict:
    """`slots` (params["layers"]["lora"]) with slot `slot` holding `adapter` (read_adapter's; the leaves it does
    not adapt zeroed), every array in its own sharding."""
    written = {}
    for leaf, pair in slots.items():
        a_host, b_host = adapter.get(leaf, (None, None))
        written[leaf] = {part: _set_slot(pair[part], slot, host, mesh)
                         for part, host in (("a", a_host), ("b", b_host))}
    return written


def _set_slot(array: jax.Array, slot: int, host: np.ndarray | None, mesh: Mesh) -> jax.Array:
    """`array` (L, S, ...) with [:, slot] = host (L, ...), or zeros when `host` is None."""
    value_shape = array.shape[:1] + array.shape[2:]
    spec = tuple(array.sharding.spec) + (None,) * (array.ndim - len(array.sharding.spec))
    value = put_global(np.zeros(value_shape, array.dtype) if host is None else host.astype(array.dtype),
                       NamedSharding(mesh, P(spec[0], *spec[2:])))
    return _slot_writer(array.sharding)(array, value, jnp.int32(slot))


@functools.lru_cache(maxsize=None)
def _slot_writer(sharding: NamedSharding):
    """The jitted slot write for arrays in `sharding` (compiled once per shape)."""
    return jax.jit(lambda whole, part, index: jax.lax.dynamic_update_index_in_dim(whole, part, index, axis=1),
                   out_shardings=sharding)


def _projection_widths(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Each target leaf's (in, out) widths in the checkpoint (KV heads not repeated)."""
    hidden, inner = spec.hidden_size, spec.intermediate_size
    q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {"wq": (hidden, q_width), "wk": (hidden, kv_width), "wv": (hidden, kv_width), "wo": (q_width, hidden),
            "w_gate": (hidden, inner), "w_up": (hidden, inner), "w_down": (inner, hidden)}


def _adapter_config(path: str) -> dict:
    """The folder's adapter_config.json, checked for what this engine serves."""
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {path}: no adapter_config.json (a PEFT folder, as save_pretrained writes it)")
    with open(config_path) as f:
        config = json.load(f)
    refused = {
        "peft_type": (config.get("peft_type", "LORA") != "LORA", "only LoRA adapters are served"),
        "use_dora": (bool(config.get("use_dora")), "DoRA adapters are not served"),
        "bias": (config.get("bias", "none") != "none", "adapters with biases are not served"),
        "modules_to_save": (bool(config.get("modules_to_save")), "modules saved whole are not served"),
        "rank_pattern": (bool(config.get("rank_pattern")), "per-module ranks are not served"),
        "alpha_pattern": (bool(config.get("alpha_pattern")), "per-module alphas are not served"),
        "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D) weights are not served"),
        "lora_bias": (bool(config.get("lora_bias")), "LoRA biases are not served"),
        "layer_replication": (bool(config.get("layer_replication")), "replicated layers are not served"),
        "trainable_token_indices": (bool(config.get("trainable_token_indices")), "trained tokens are not served"),
        "target_parameters": (bool(config.get("target_parameters")), "LoRA on parameters is not served"),
        "alora_invocation_tokens": (bool(config.get("alora_invocation_tokens")), "aLoRA is not served"),
        "use_qalora": (bool(config.get("use_qalora")), "QA-LoRA is not served"),
    }
    for field, (bad, reason) in refused.items():
        if bad:
            raise ValueError(f"LoRA adapter {path}: {field}={config.get(field)!r}: {reason}")
    return config


def _weights_file(path: str) -> str:
    """The folder's adapter weights."""
    weights = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        raise ValueError(f"LoRA adapter {path}: no adapter_model.safetensors")
    return weights
