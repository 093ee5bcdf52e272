"""Sharding rules: a 1-D `model` mesh axis; heads split Megatron style, KV heads replicated when too few."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.model.spec import ModelSpec

MODEL_AXIS = "model"

# Partition specs of the params pytree leaves (see model/llama.py for the layout).
_LAYER_SPECS = {
    "input_norm": P(None, None),
    "post_norm": P(None, None),
    "wq": P(None, None, MODEL_AXIS),
    "wk": P(None, None, MODEL_AXIS),
    "wv": P(None, None, MODEL_AXIS),
    "bq": P(None, MODEL_AXIS),
    "bk": P(None, MODEL_AXIS),
    "bv": P(None, MODEL_AXIS),
    "q_norm": P(None, None),
    "k_norm": P(None, None),
    "wo": P(None, MODEL_AXIS, None),
    "w_gate": P(None, None, MODEL_AXIS),
    "w_up": P(None, None, MODEL_AXIS),
    "w_down": P(None, MODEL_AXIS, None),
}
KV_CACHE_SPEC = P(None, None, None, MODEL_AXIS, None)  # (L, P, S, Hkv, D): KV heads split


def make_mesh(tensor_parallel_size: int) -> Mesh:
    """A 1-D mesh over the first `tensor_parallel_size` devices."""
    devices = jax.devices()
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} but only {len(devices)} device(s) are visible"
        )
    return Mesh(np.asarray(devices[:tensor_parallel_size]), (MODEL_AXIS,))


def cache_kv_heads(spec: ModelSpec, tensor_parallel_size: int) -> int:
    """KV heads held per layer: the checkpoint's, or replicated up to the TP size when it has fewer."""
    tp = tensor_parallel_size
    if spec.num_heads % tp:
        raise ValueError(f"num_attention_heads ({spec.num_heads}) must be divisible by tensor_parallel_size ({tp})")
    if spec.intermediate_size % tp:
        raise ValueError(f"intermediate_size ({spec.intermediate_size}) must be divisible by tensor_parallel_size ({tp})")
    if spec.num_kv_heads % tp == 0:
        return spec.num_kv_heads
    if tp % spec.num_kv_heads == 0:
        return tp
    raise ValueError(
        f"num_key_value_heads ({spec.num_kv_heads}) and tensor_parallel_size ({tp}) must divide one another"
    )


def param_partition_specs(spec: ModelSpec, tensor_parallel_size: int) -> dict:
    """The PartitionSpec of every params leaf (same tree structure as the params)."""
    layers = {name: pspec for name, pspec in _LAYER_SPECS.items() if _has_layer_param(spec, name)}
    specs = {"embed": P(None, None), "final_norm": P(None), "layers": layers}
    if not spec.tie_word_embeddings:
        vocab_split = spec.vocab_size % tensor_parallel_size == 0
        specs["lm_head"] = P(None, MODEL_AXIS if vocab_split else None)
    return specs


def _has_layer_param(spec: ModelSpec, name: str) -> bool:
    if name in ("bq", "bk", "bv"):
        return spec.qkv_bias
    if name in ("q_norm", "k_norm"):
        return spec.qk_norm
    return True


def named(mesh: Mesh, tree):
    """Turn a tree of PartitionSpecs into NamedShardings on `mesh`."""
    return jax.tree_util.tree_map(lambda p: NamedSharding(mesh, p), tree, is_leaf=lambda x: isinstance(x, P))
