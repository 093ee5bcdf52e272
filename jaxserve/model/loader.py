"""Load a Hugging Face Llama-family folder's safetensors straight into sharded, stacked params."""

from __future__ import annotations

import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open

from jaxserve.model.sharding import named, param_partition_specs
from jaxserve.model.spec import ModelSpec

# params leaf -> (HF name template, transpose a Linear weight to (in, out))
_LAYER_WEIGHTS = {
    "input_norm": ("model.layers.{i}.input_layernorm.weight", False),
    "post_norm": ("model.layers.{i}.post_attention_layernorm.weight", False),
    "wq": ("model.layers.{i}.self_attn.q_proj.weight", True),
    "wk": ("model.layers.{i}.self_attn.k_proj.weight", True),
    "wv": ("model.layers.{i}.self_attn.v_proj.weight", True),
    "bq": ("model.layers.{i}.self_attn.q_proj.bias", False),
    "bk": ("model.layers.{i}.self_attn.k_proj.bias", False),
    "bv": ("model.layers.{i}.self_attn.v_proj.bias", False),
    "q_norm": ("model.layers.{i}.self_attn.q_norm.weight", False),
    "k_norm": ("model.layers.{i}.self_attn.k_norm.weight", False),
    "wo": ("model.layers.{i}.self_attn.o_proj.weight", True),
    "w_gate": ("model.layers.{i}.mlp.gate_proj.weight", True),
    "w_up": ("model.layers.{i}.mlp.up_proj.weight", True),
    "w_down": ("model.layers.{i}.mlp.down_proj.weight", True),
}
_KV_LEAVES = ("wk", "wv", "bk", "bv")


def resolve_dtype(dtype: str, spec: ModelSpec) -> jnp.dtype:
    """'auto' takes the checkpoint's dtype."""
    name = spec.torch_dtype.replace("torch.", "") if dtype == "auto" else dtype
    return jnp.dtype({"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}.get(name, jnp.float32))


class SafetensorsFolder:
    """Name -> tensor access over one or several safetensors files of a folder."""

    def __init__(self, path: str):
        index_path = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"no *.safetensors weights in model folder {path!r}")
        self._location: dict[str, str] = {}
        for file in files:
            full = os.path.join(path, file)
            if not os.path.isfile(full):
                raise ValueError(f"model folder {path!r} is missing weight file {file!r} named in its index")
            with safe_open(full, framework="flax") as f:
                for name in f.keys():
                    self._location[name] = full

    def __contains__(self, name: str) -> bool:
        return name in self._location

    def get(self, name: str) -> np.ndarray:
        """One tensor as a host numpy array (bfloat16 via ml_dtypes)."""
        if name not in self._location:
            raise ValueError(f"weight {name!r} not found in the checkpoint")
        with jax.default_device(jax.devices("cpu")[0]), safe_open(self._location[name], framework="flax") as f:
            return np.asarray(f.get_tensor(name))


def load_params(path: str, spec: ModelSpec, mesh: Mesh, dtype: jnp.dtype, num_cache_kv_heads: int) -> dict:
    """Read, stack, cast and place every weight directly into its final sharding, one leaf at a time."""
    folder = SafetensorsFolder(path)
    tp = mesh.devices.size
    shardings = named(mesh, param_partition_specs(spec, tp))
    kv_repeat = num_cache_kv_heads // spec.num_kv_heads

    def place(host: np.ndarray, sharding) -> jax.Array:
        host = host.astype(dtype)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    layers = {}
    for leaf, sharding in shardings["layers"].items():
        template, transpose = _LAYER_WEIGHTS[leaf]
        stacked = np.stack([_maybe_t(folder.get(template.format(i=i)), transpose) for i in range(spec.num_layers)])
        if leaf in _KV_LEAVES and kv_repeat > 1:
            stacked = _repeat_kv_heads(stacked, spec.head_dim, kv_repeat)
        layers[leaf] = place(stacked, sharding)
    params = {
        "embed": place(folder.get("model.embed_tokens.weight"), shardings["embed"]),
        "final_norm": place(folder.get("model.norm.weight"), shardings["final_norm"]),
        "layers": layers,
    }
    if not spec.tie_word_embeddings:
        params["lm_head"] = place(folder.get("lm_head.weight").T, shardings["lm_head"])
    return params


def _maybe_t(weight: np.ndarray, transpose: bool) -> np.ndarray:
    return weight.T if transpose else weight


def _repeat_kv_heads(stacked: np.ndarray, head_dim: int, repeat: int) -> np.ndarray:
    """Replicate each KV head `repeat` times along the last axis (vLLM's layout when TP > KV heads)."""
    # stacked: (L, ..., Hkv * D) -> (L, ..., Hkv * repeat * D)
    *lead, last = stacked.shape
    heads = stacked.reshape(*lead, last // head_dim, head_dim)
    return np.repeat(heads, repeat, axis=-2).reshape(*lead, last * repeat)
