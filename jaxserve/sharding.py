"""Sharding rules: a 1-D `model` mesh axis; KV heads replicated when too few (each model declares its leaves'
partition specs, model/registry.py)."""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.model_spec import ModelSpec

logger = logging.getLogger("jaxserve")
MODEL_AXIS = "model"

KV_CACHE_SPEC = P(None, None, None, MODEL_AXIS, None)  # (L, P, S, Hkv, D): KV heads split


def make_mesh(tensor_parallel_size: int, first_device: int = 0) -> Mesh:
    """A 1-D mesh over `tensor_parallel_size` devices from `first_device` on (a data-parallel replica's set), in
    JAX's global order: in a multi-host launch, every process's devices."""
    devices = jax.devices()[first_device:]
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} but only {len(devices)} device(s) are visible"
            + (f" from device {first_device} on" if first_device else "")
        )
    return Mesh(np.asarray(devices[:tensor_parallel_size]), (MODEL_AXIS,))


def check_replica_devices(tensor_parallel_size: int, data_parallel_size: int) -> None:
    """ValueError unless the devices hold `data_parallel_size` disjoint meshes of `tensor_parallel_size`."""
    needed, visible = tensor_parallel_size * data_parallel_size, len(jax.devices())
    if needed > visible:
        raise ValueError(f"data_parallel_size {data_parallel_size} x tensor_parallel_size {tensor_parallel_size} "
                         f"needs {needed} devices, but {visible} are visible")


def put_global(values, sharding: NamedSharding):
    """Host values (numpy, a tree of them) -> arrays in `sharding`. In a multi-host launch each process fills its
    own devices from its copy (every process holds the same values): `jax.device_put` would compile and run a
    cross-process check for each new shape there."""
    if sharding.is_fully_addressable:
        return jax.device_put(values, sharding)
    return jax.tree_util.tree_map(
        lambda value: jax.make_array_from_callback(value.shape, sharding, lambda index: value[index]), values)


def cache_kv_heads(spec: ModelSpec, tensor_parallel_size: int) -> int:
    """KV heads held per layer: the checkpoint's, or replicated up to the TP size when it has fewer."""
    tp = tensor_parallel_size
    if spec.num_heads % tp:
        raise ValueError(f"num_attention_heads ({spec.num_heads}) must be divisible by tensor_parallel_size ({tp})")
    if spec.intermediate_size % tp:
        raise ValueError(f"intermediate_size ({spec.intermediate_size}) must be divisible by "
                         f"tensor_parallel_size ({tp})")
    if spec.num_kv_heads % tp == 0:
        return spec.num_kv_heads
    if tp % spec.num_kv_heads == 0:
        return tp
    raise ValueError(
        f"num_key_value_heads ({spec.num_kv_heads}) and tensor_parallel_size ({tp}) must divide one another"
    )


def with_expert_parallel(spec: ModelSpec, enabled: bool) -> ModelSpec:
    """`spec` with its experts split whole over the devices when `enabled`; a model without experts is unchanged
    (with a warning, as vLLM ignores the flag there)."""
    if not enabled:
        return spec
    if not getattr(spec, "num_experts", 0):
        logger.warning("enable_expert_parallel: %s has no experts; the flag changes nothing", spec.architecture)
        return spec
    return dataclasses.replace(spec, expert_parallel=True)


def named(mesh: Mesh, tree):
    """Turn a tree of PartitionSpecs into NamedShardings on `mesh`."""
    return jax.tree_util.tree_map(lambda p: NamedSharding(mesh, p), tree, is_leaf=lambda x: isinstance(x, P))
