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


def dummy_params(spec: ModelSpec, mesh: Mesh, dtype: jnp.dtype, num_cache_kv_heads: int, seed: int) -> dict:
    """Random weights of the right shapes, made on the device in their final sharding (load_format
    "dummy", for benchmarks of shapes whose real weights are not at hand): matrices N(0, 0.02^2), norms 1."""
    shardings = named(mesh, param_partition_specs(spec, mesh.devices.size))
    shapes = _param_shapes(spec, num_cache_kv_heads)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree_util.tree_leaves(shapes))))

    def make(shape: tuple[int, ...], sharding, is_norm: bool) -> jax.Array:
        if is_norm:
            return jax.jit(lambda: jnp.ones(shape, dtype), out_shardings=sharding)()
        return jax.jit(lambda key: 0.02 * jax.random.normal(key, shape, dtype), out_shardings=sharding)(next(keys))

    return {
        name: ({leaf: make(shape, shardings[name][leaf], leaf.endswith("norm")) for leaf, shape in shapes[name].items()}
               if name == "layers" else make(shapes[name], shardings[name], name.endswith("norm")))
        for name in shapes
    }


def _param_shapes(spec: ModelSpec, num_cache_kv_heads: int) -> dict:
    """The shape of every params leaf, as load_params makes them (stacked layers, Linear weights (in, out))."""
    layers, hidden, inner = spec.num_layers, spec.hidden_size, spec.intermediate_size
    q_width, kv_width = spec.num_heads * spec.head_dim, num_cache_kv_heads * spec.head_dim
    layer_shapes = {
        "input_norm": (layers, hidden), "post_norm": (layers, hidden),
        "wq": (layers, hidden, q_width), "wk": (layers, hidden, kv_width), "wv": (layers, hidden, kv_width),
        "bq": (layers, q_width), "bk": (layers, kv_width), "bv": (layers, kv_width),
        "q_norm": (layers, spec.head_dim), "k_norm": (layers, spec.head_dim),
        "wo": (layers, q_width, hidden),
        "w_gate": (layers, hidden, inner), "w_up": (layers, hidden, inner), "w_down": (layers, inner, hidden),
    }
    present = param_partition_specs(spec, 1)
    shapes = {"embed": (spec.vocab_size, hidden), "final_norm": (hidden,),
              "layers": {leaf: layer_shapes[leaf] for leaf in present["layers"]}}
    if "lm_head" in present:
        shapes["lm_head"] = (hidden, spec.vocab_size)
    return shapes


def _maybe_t(weight: np.ndarray, transpose: bool) -> np.ndarray:
    return weight.T if transpose else weight


def _repeat_kv_heads(stacked: np.ndarray, head_dim: int, repeat: int) -> np.ndarray:
    """Replicate each KV head `repeat` times along the last axis (vLLM's layout when TP > KV heads)."""
    # stacked: (L, ..., Hkv * D) -> (L, ..., Hkv * repeat * D)
    *lead, last = stacked.shape
    heads = stacked.reshape(*lead, last // head_dim, head_dim)
    return np.repeat(heads, repeat, axis=-2).reshape(*lead, last * repeat)
