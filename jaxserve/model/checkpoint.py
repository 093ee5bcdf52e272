"""The engine's own checkpoint format: its parameter pytree (stacked, cast, optionally quantized) saved with
orbax, next to the Hugging Face config and tokenizer files, so a converted folder is a model folder.

    DST/
        jaxserve_checkpoint.json   what the pytree is: dtype, quantization, KV heads stored, kv_cache_dtype
        params/                    orbax (StandardCheckpointer) of the params pytree
        config.json, generation_config.json, tokenizer files, chat template   copied from the source

`jaxserve convert SRC DST` writes one (`convert`); an engine whose `model` is such a folder restores the
pytree straight into its shardings (`load_checkpoint`): orbax reads each device's shard of each array, and
nothing else, from the files. `load_weights` is every loader's one entry (engine, draft model, convert,
scoring): a converted folder, random weights, or a Hugging Face folder, quantized as configured.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.attention import fp8
from jaxserve.config import EngineConfig
from jaxserve.model.kv_calibration import calibrate_kv_scales, calibration_prompts
from jaxserve.model.loader import dummy_params, load_kv_scales, load_params, resolve_dtype
from jaxserve.model.quantize import INT4_PER_BYTE, quantize_params, quantized_partition_specs, weight_bytes
from jaxserve.model.registry import (
    Weight,
    load_model_spec,
    map_weights_with,
    model_for,
    param_partition_specs,
    quantizable_paths,
)
from jaxserve.model_spec import ModelSpec
from jaxserve.sharding import cache_kv_heads, make_mesh, put_global

logger = logging.getLogger("jaxserve")

MARKER = "jaxserve_checkpoint.json"
PARAMS_DIR = "params"
FORMAT_VERSION = 1
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".safetensors.index.json",
                   ".bin.index.json")


def is_checkpoint(path: str) -> bool:
    """True for a folder `convert` wrote."""
    return os.path.isfile(os.path.join(path, MARKER))


def read_metadata(path: str) -> dict:
    """The folder's jaxserve_checkpoint.json."""
    with open(os.path.join(path, MARKER)) as f:
        return json.load(f)


def convert(source: str, destination: str, dtype: str = "auto", quantization: str = "none",
            kv_cache_dtype: str = "auto", calculate_kv_scales: bool = False, tensor_parallel_size: int = 1) -> dict:
    """Load a model folder as the engine does (`load_weights`: cast to `dtype`, KV heads replicated for
    `tensor_parallel_size`, quantized under `quantization` or as an fp8 checkpoint is, with the fp8 KV cache's
    scales under `kv_cache_dtype` fp8, calibrated under `calculate_kv_scales`) and write it to `destination` as an
    orbax checkpoint with the source's config and tokenizer files; returns the metadata written."""
    import orbax.checkpoint as ocp

    if os.path.exists(destination) and os.listdir(destination):
        raise ValueError(f"{destination!r} exists and is not empty: choose a new folder")
    config = EngineConfig(model=source, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                          calculate_kv_scales=calculate_kv_scales, tensor_parallel_size=tensor_parallel_size)
    spec = load_model_spec(source)
    kv_heads = cache_kv_heads(spec, tensor_parallel_size)
    params, cast = load_weights(config, source, spec, make_mesh(tensor_parallel_size), kv_heads)
    os.makedirs(destination, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.abspath(os.path.join(destination, PARAMS_DIR)), params)
    checkpointer.wait_until_finished()
    for name in sorted(os.listdir(source)):
        path = os.path.join(source, name)
        if os.path.isfile(path) and not name.endswith(WEIGHT_SUFFIXES) and name != MARKER:
            shutil.copy(path, destination)
    metadata = {"format_version": FORMAT_VERSION, "dtype": jnp.dtype(cast).name,
                "quantization": weight_quantization(config, spec), "num_cache_kv_heads": kv_heads,
                "kv_cache_dtype": kv_cache_dtype, "source": os.path.abspath(source)}
    with open(os.path.join(destination, MARKER), "w") as f:
        json.dump(metadata, f, indent=2)
    return metadata


def load_weights(config: EngineConfig, model_path: str, spec: ModelSpec, mesh: Mesh, kv_heads: int
                 ) -> tuple[dict, jnp.dtype]:
    """(params in their shardings, the float dtype of the weights): from a converted orbax folder
    (`load_checkpoint`), random (load_format dummy) or a Hugging Face folder, then quantized as configured, with
    the fp8 KV cache's scales when `kv_cache_dtype` is fp8 (and none otherwise)."""
    check_params_options(config, spec)
    model, cache = config.model_config, config.cache_config
    dummy = model.load_format == "dummy"
    if not dummy and is_checkpoint(model_path):
        params, stored = load_checkpoint(model_path, spec, mesh, kv_heads, model.dtype, model.quantization)
        logger.info("weights: %.1f MiB (orbax, %s, %s)", weight_bytes(params) / 2**20, stored["dtype"],
                    stored["quantization"])
        return with_kv_scales(params, config, model_path, None, spec, mesh, kv_heads), jnp.dtype(stored["dtype"])
    dtype = resolve_dtype(model.dtype, spec)
    mode = weight_quantization(config, spec)
    if dummy:
        params = dummy_params(spec, mesh, dtype, kv_heads, model.seed)
    else:
        params = load_params(model_path, spec, mesh, dtype, kv_heads)  # an fp8 checkpoint's layers come quantized
    if mode != "none" and (spec.checkpoint_quantization == "none" or dummy):
        params = quantize_params(params, mode, quantizable_paths(spec))
    logger.info("weights: %.1f MiB (%s)", weight_bytes(params) / 2**20,
                "not quantized" if mode == "none" else f"quantized: {mode}")
    scales = None
    if cache.kv_cache_dtype == "fp8" and not dummy and not cache.calculate_kv_scales:
        scales = load_kv_scales(model_path, spec, kv_heads)
    return with_kv_scales(params, config, model_path, scales, spec, mesh, kv_heads), dtype


def with_kv_scales(params: dict, config: EngineConfig, model_path: str, scales: dict | None, spec: ModelSpec,
                   mesh: Mesh, kv_heads: int) -> dict:
    """The params with the fp8 KV cache's scale leaves (attention/fp8.py) under kv_cache_dtype fp8, without them
    otherwise. The scales are calibrated under calculate_kv_scales (model/kv_calibration.py), else `scales` (from a
    Hugging Face checkpoint), else the ones a converted folder holds, else 1.0 (vLLM's default, with a warning)."""
    layers = {name: leaf for name, leaf in params["layers"].items() if name not in fp8.SCALE_LEAVES}
    if config.cache_config.kv_cache_dtype != "fp8":
        return {**params, "layers": layers}
    if config.cache_config.calculate_kv_scales:
        prompts = calibration_prompts(config.model_config.tokenizer or model_path, spec.max_position_embeddings)
        scales = calibrate_kv_scales({**params, "layers": layers}, spec, mesh, kv_heads, prompts)
        logger.info("KV scales calibrated over %d tokens: k %.3g..%.3g, v %.3g..%.3g", sum(map(len, prompts)),
                    scales["k_scale"].min(), scales["k_scale"].max(), scales["v_scale"].min(),
                    scales["v_scale"].max())
    elif scales is None and "k_scale" in params["layers"]:
        return params
    elif scales is None:
        logger.warning("kv_cache_dtype fp8: the checkpoint has no self_attn.k_scale / v_scale, so every KV scale "
                       "is 1.0 (K and V beyond +-%g saturate)", fp8.FP8_MAX)
        num_layers = layers["input_norm"].shape[0]
        scales = {leaf: np.ones((num_layers, kv_heads), np.float32) for leaf in fp8.SCALE_LEAVES}
    sharding = NamedSharding(mesh, fp8.SCALE_SPEC)
    return {**params, "layers": {**layers, **{leaf: put_global(scales[leaf], sharding) for leaf in scales}}}


def check_stored_shapes(stored: dict, spec: ModelSpec, num_cache_kv_heads: int, num_devices: int, path: str) -> None:
    """ValueError naming the first weight the model (as the folder's config.json describes it) declares that the
    converted arrays `stored` (orbax's metadata tree) lack or hold in another shape: a config.json edited after
    converting is refused as a Hugging Face folder's would be, not served with the arrays' shapes."""
    declared = model_for(spec.architecture).weights(spec, num_cache_kv_heads, num_devices)

    def check(_: str, weight: Weight, leaf) -> None:
        array = leaf.get("weight") if isinstance(leaf, dict) else leaf  # a quantized leaf: {weight, scale, ...}
        if array is None or not hasattr(array, "shape"):
            raise ValueError(f"{path!r} lacks the weight {weight.hf_name!r} that its config.json gives the model: "
                             "convert the model again")
        shape = tuple(array.shape)
        if isinstance(leaf, dict) and jnp.dtype(array.dtype) == jnp.uint8:  # int4: two input rows to a byte
            shape = (*shape[:-2], shape[-2] * INT4_PER_BYTE, shape[-1])
        if shape != tuple(weight.shape):
            raise ValueError(f"{path!r} stores the weight {weight.hf_name!r} in shape {shape} but its config.json "
                             f"gives the model {tuple(weight.shape)}: was config.json edited after converting? Restore "
                             "it, or convert the model again")

    map_weights_with(check, declared, stored)


def check_params_options(config: EngineConfig, spec: ModelSpec) -> None:
    """ValueError for a weight quantization the architecture declares no weights for, or an fp8 KV cache its
    layers do not read (the KV scales live in params["layers"], one stack of every layer, which a model with two
    kinds of layers in two stacks, DeepSeek-V3, does not have)."""
    quantization = config.model_config.quantization
    if quantization != "none" and not quantizable_paths(spec):
        raise ValueError(f"quantization {quantization}: {spec.architecture} has no weights it applies to; "
                         f"serve it unquantized")
    if config.cache_config.kv_cache_dtype == "fp8" and not model_for(spec.architecture).fp8_kv_cache:
        raise ValueError(f"kv_cache_dtype fp8 is not supported for {spec.architecture}: use auto")


def weight_quantization(config: EngineConfig, spec: ModelSpec) -> str:
    """The quantization the weights are served in: the configured one, or an fp8 checkpoint's own; a ValueError
    when the two disagree."""
    stored, configured = spec.checkpoint_quantization, config.model_config.quantization
    if stored != "none" and configured not in ("none", stored):
        raise ValueError(f"the checkpoint's weights are already {stored}: quantization={configured} cannot "
                         f"apply to them (drop it, or start from the float checkpoint)")
    return stored if configured == "none" else configured


def load_checkpoint(path: str, spec: ModelSpec, mesh: Mesh, num_cache_kv_heads: int, dtype: str,
                    quantization: str) -> tuple[dict, dict]:
    """(a converted folder's params restored into the engine's shardings, its metadata); a ValueError when the
    folder does not match what the engine was asked for (dtype, quantization, KV heads for its tensor
    parallelism)."""
    import orbax.checkpoint as ocp

    metadata = read_metadata(path)
    if metadata.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path!r} is a jaxserve checkpoint of format {metadata.get('format_version')}, this "
                         f"jaxserve reads format {FORMAT_VERSION}: convert the model again")
    if quantization not in ("none", metadata["quantization"]):
        raise ValueError(f"{path!r} holds {metadata['quantization']} weights but quantization={quantization} was "
                         f"asked: drop the option, or convert the float model with --quantization {quantization}")
    if dtype != "auto" and jnp.dtype(resolve_dtype(dtype, spec)).name != metadata["dtype"]:
        raise ValueError(f"{path!r} holds {metadata['dtype']} weights but dtype={dtype} was asked: use dtype auto, "
                         f"or convert again with --dtype {dtype}")
    if metadata["num_cache_kv_heads"] != num_cache_kv_heads:
        raise ValueError(f"{path!r} stores {metadata['num_cache_kv_heads']} KV heads per layer but tensor parallelism "
                         f"over {mesh.devices.size} devices needs {num_cache_kv_heads}: convert with "
                         f"--tensor-parallel-size {mesh.devices.size}")
    specs = param_partition_specs(spec, num_cache_kv_heads, mesh.devices.size)
    if metadata["quantization"] != "none":  # a checkpoint's block-wise scales (and zero points) were converted grouped
        as_stored = metadata["quantization"] == spec.checkpoint_quantization
        grouped = as_stored and spec.checkpoint_weight_block is not None
        specs = quantized_partition_specs(specs, quantizable_paths(spec), grouped,
                                          as_stored and spec.checkpoint_zero_points,
                                          as_stored and spec.checkpoint_act_order)
    if metadata.get("kv_cache_dtype") == "fp8":
        specs = fp8.with_scale_leaves(specs, fp8.SCALE_SPEC)
    checkpointer = ocp.StandardCheckpointer()
    params_path = os.path.abspath(os.path.join(path, PARAMS_DIR))
    stored = checkpointer.metadata(params_path).item_metadata.tree
    check_stored_shapes(stored, spec, num_cache_kv_heads, mesh.devices.size, path)
    try:
        abstract = jax.tree_util.tree_map(
            lambda pspec, leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, pspec)),
            specs, stored, is_leaf=lambda node: isinstance(node, P))
    except ValueError as error:
        raise ValueError(f"the arrays in {params_path!r} do not match the parameters of {spec.architecture} as "
                         f"config.json describes it: {error}") from error
    return checkpointer.restore(params_path, abstract), metadata
