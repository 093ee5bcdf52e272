"""Attention backends: which paged-attention implementation the model calls, and the KV layout it stores.

Backends (`attention_backend`):
- `xla`: plain jnp, bounded in memory (see attention/xla.py); the CPU default and every platform's fallback.
- `pallas`: the platform's Pallas kernels: our Triton kernels on a GPU (attention/pallas_gpu.py), JAX's Mosaic
  ragged paged attention on a TPU (attention/tpu.py).
- `pallas-interpret`: our GPU kernels run by the Pallas interpreter (CPU tests).
- `pallas-tpu-interpret`: the TPU kernel run by JAX's TPU interpreter (CPU tests).
- `auto`: `pallas` on a GPU or a TPU when its kernels take the model's shapes, else `xla`.

Every backend is an `AttentionBackend` (attention/base.py): its cache layout, `attention` and `write_kv`. Every
backend reads a cache in the queries' dtype or in float8_e4m3fn (the fp8 KV cache, attention/fp8.py).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.attention.base import AttentionBackend
from jaxserve.config import VALID_ATTENTION_BACKENDS
from jaxserve.model_spec import ModelSpec
from jaxserve.sharding import cache_kv_heads
from pallas_kernels.ragged_paged_attention.tuning import gpu_unsupported

logger = logging.getLogger("jaxserve")
FP8_COMPUTE_CAPABILITY = 8.9  # Triton converts float8_e4m3fn from here (Ada, Hopper and later)


def resolve_backend(name: str, spec: ModelSpec, page_size: int, platform: str | None = None,
                    tensor_parallel_size: int = 1, cache_dtype=jnp.bfloat16) -> str:
    """The backend `name` stands for on `platform` ('cpu', 'gpu' or 'tpu'; default: JAX's default backend).

    'auto' is 'pallas' on a GPU or a TPU when that platform's kernels take the model's shapes (sharded over
    `tensor_parallel_size` devices) and a cache of `cache_dtype`, else 'xla'. ValueError for a Pallas backend
    that cannot run."""
    if name not in VALID_ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; use {', '.join(VALID_ATTENTION_BACKENDS)}")
    platform = platform or jax.default_backend()
    has_kernels = platform in ("gpu", "tpu")
    if name == "auto":
        unsupported = has_kernels and kernels_unsupported(platform, spec, page_size, tensor_parallel_size,
                                                          cache_dtype)
        if unsupported:
            logger.warning("attention_backend auto: using the XLA path because %s", unsupported)
        return "pallas" if has_kernels and not unsupported else "xla"
    if name == "pallas" and not has_kernels:
        raise ValueError(f"attention_backend pallas compiles the kernels for a GPU or a TPU, and this is "
                         f"{platform}: use pallas-interpret or pallas-tpu-interpret (slow, for tests) or xla")
    kernels_platform = {"pallas": platform, "pallas-tpu-interpret": "tpu"}.get(name)
    unsupported = kernels_platform and kernels_unsupported(kernels_platform, spec, page_size, tensor_parallel_size,
                                                           cache_dtype)
    if unsupported:
        raise ValueError(f"attention_backend {name}: {unsupported}; use attention_backend xla")
    return name


def kernels_unsupported(platform: str, spec: ModelSpec, page_size: int, tensor_parallel_size: int,
                        cache_dtype=jnp.bfloat16) -> str | None:
    """Why `platform`'s Pallas kernels cannot take the model's shapes and cache dtype, or None when they can (or
    it has none)."""
    if platform == "gpu":
        capability = gpu_compute_capability()
        if jnp.dtype(cache_dtype).itemsize == 1 and capability is not None and capability < FP8_COMPUTE_CAPABILITY:
            return (f"the Triton kernels read an fp8 KV cache from compute capability {FP8_COMPUTE_CAPABILITY} "
                    f"(Ada, Hopper) and this GPU has {capability}")
        return gpu_unsupported(page_size, spec.head_dim)
    if platform == "tpu":
        from jaxserve.attention.tpu import tpu_unsupported

        if spec.attention_sinks:
            return "JAX's TPU ragged paged attention has no attention sinks (gpt-oss)"

        return tpu_unsupported(cache_kv_heads(spec, tensor_parallel_size) // tensor_parallel_size, cache_dtype)
    return None


def gpu_compute_capability() -> float | None:
    """The first device's CUDA compute capability (9.0 on an H100 / H200), or None off a GPU (cross-lowering)."""
    if jax.default_backend() != "gpu":
        return None
    capability = getattr(jax.devices()[0], "compute_capability", None)
    return None if capability is None else float(capability)


def make_attention(spec: ModelSpec, backend: str, mesh: Mesh, page_size: int,
                   platform: str | None = None, cache_dtype=jnp.bfloat16) -> AttentionBackend:
    """The resolved backend for the model's shapes and a cache of `cache_dtype`."""
    platform = platform or jax.default_backend()
    backend = resolve_backend(backend, spec, page_size, platform, mesh.size, cache_dtype)
    if backend == "xla":
        from jaxserve.attention import xla

        return xla.make_backend(platform)
    if backend == "pallas-tpu-interpret" or (backend == "pallas" and platform == "tpu"):
        from jaxserve.attention import tpu

        return tpu.make_backend(mesh, interpret=backend == "pallas-tpu-interpret")
    from jaxserve.attention import pallas_gpu

    return pallas_gpu.make_backend(mesh, interpret=backend == "pallas-interpret")
