"""New weights for the model being served, without a restart or a recompile (reinforcement learning's rollouts:
the policy's weights change between generations; SGLang's update_weights_from_disk, vLLM's weight-update RPCs).

The weights come from a Hugging Face folder (safetensors) or from arrays in memory by their Hugging Face names,
in the served model's shapes. The engine checks every tensor (present, shape: `loader.check_source`) once, before
anything is written, so a bad source leaves the served weights as they were. They are then read as at start-up
(model/loader.py), each device reading its shard, into the leaves being served: each stacked leaf is written over in
place (donated), so the devices need room for one more layer, not a second copy of the model, and the executables, which
take the params as arguments, run on as compiled. Weights the engine quantized at load (`quantization` int8 / fp8 over a
float checkpoint) are read in full precision and quantized again (room for the new projections in full precision is
needed then). LoRA slots and the fp8 KV cache's scales stay as they were.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.model.loader import TensorSource, load_params
from jaxserve.model.quantize import leaf_at, quantize_params, replace_at
from jaxserve.model.registry import model_for, quantizable_paths
from jaxserve.model_spec import ModelSpec

QUANTIZED_MODES = {"int8": "int8", "float8_e4m3fn": "fp8"}  # a quantized leaf's weight dtype -> its mode


def quantized_at_load(params: dict, spec: ModelSpec) -> str | None:
    """The quantization the engine applied to the served float checkpoint's weights at load (int8 or fp8), else
    None (none applied, or the checkpoint's own fp8, which the loader reads as it is)."""
    if spec.checkpoint_quantization != "none":
        return None
    leaves = [leaf_at(params, path) for path in quantizable_paths(spec)]
    return next((QUANTIZED_MODES[leaf["weight"].dtype.name] for leaf in leaves if isinstance(leaf, dict)), None)


def undeclared_leaves(params: dict, spec: ModelSpec, num_cache_kv_heads: int, num_devices: int) -> dict:
    """The params leaves no checkpoint tensor gives (the LoRA slots, the fp8 KV cache's scales), as {"layers": ...}:
    what a weight reload keeps."""
    declared = model_for(spec.architecture).weights(spec, num_cache_kv_heads, num_devices)["layers"]
    return {"layers": {name: leaf for name, leaf in params["layers"].items() if name not in declared}}


def _holds(params: dict, path: tuple[str, ...]) -> bool:
    """Whether `params` has a leaf at `path` (not after a sleep that discarded the weights)."""
    for key in path:
        if not isinstance(params, dict) or key not in params:
            return False
        params = params[key]
    return True


def reload_params(params: dict, source: TensorSource, spec: ModelSpec, mesh: Mesh, num_cache_kv_heads: int,
                  dtype: jnp.dtype, quantization: str | None) -> dict:
    """`params` with every weight the model declares read anew from `source`, which the caller has checked
    (`loader.check_source`), in `dtype` and quantized again as at load (`quantization`: `quantized_at_load`'s).
    The declared leaves `params` holds are written over in place; those it lacks (after a sleep that discarded
    them) are made anew; its other leaves are kept."""
    layers, paths = params["layers"], quantizable_paths(spec)
    into = params
    if quantization is not None:  # those leaves are read anew in full precision (none to write over), then quantized
        into = replace_at(params, tuple(path for path in paths if _holds(params, path)), lambda _: None)
    try:
        loaded = load_params(source, spec, mesh, dtype, num_cache_kv_heads, into=into)
        if quantization is not None:
            loaded = quantize_params(loaded, quantization, paths)
    except Exception as error:  # (reading the files, say): leaves written over in place are gone
        raise RuntimeError(f"the weight update failed part-way ({type(error).__name__}: {error}); some of the served "
                           "weights are lost: update the weights again before serving") from error
    kept = {name: leaf for name, leaf in layers.items() if name not in loaded["layers"]}  # LoRA slots, KV scales
    return {**loaded, "layers": {**loaded["layers"], **kept}}
