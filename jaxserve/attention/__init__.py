"""Attention backends: which paged-attention implementation the model calls, and the KV layout it stores.

Backends (`attention_backend`):
- `xla`: plain jnp, bounded in memory (see attention/xla.py); the CPU default and every platform's fallback.
- `pallas`: the platform's Pallas kernels: our Triton kernels on a GPU (attention/pallas_gpu.py).
- `pallas-interpret`: our GPU kernels run by the Pallas interpreter (CPU tests).
- `auto`: `pallas` on a GPU when the kernels take the model's shapes, else `xla`.

Every backend is an `AttentionBackend` (attention/base.py): its cache layout, `attention` and `write_kv`.
"""

from __future__ import annotations

import logging

import jax
from jax.sharding import Mesh

from jaxserve.attention.base import AttentionBackend
from jaxserve.config import VALID_ATTENTION_BACKENDS
from jaxserve.model.spec import ModelSpec
from pallas_kernels.ragged_paged_attention.tuning import gpu_unsupported

logger = logging.getLogger("jaxserve")


def resolve_backend(name: str, spec: ModelSpec, page_size: int, platform: str | None = None) -> str:
    """The backend `name` stands for on `platform` ('cpu', 'gpu' or 'tpu'; default: JAX's default backend).

    'auto' is 'pallas' on a GPU when the kernels take the model's shapes, else 'xla'. ValueError for
    'pallas' where it cannot run."""
    platform = platform or jax.default_backend()
    on_gpu = platform == "gpu"
    unsupported = gpu_unsupported(page_size, spec.head_dim)
    if name == "auto":
        if on_gpu and unsupported:
            logger.warning("attention_backend auto: using the XLA path because %s", unsupported)
        return "pallas" if on_gpu and not unsupported else "xla"
    if name == "pallas" and not on_gpu:
        raise ValueError(f"attention_backend pallas compiles the kernels for a GPU, and this is "
                         f"{platform}: use pallas-interpret (slow, for tests) or xla")
    if name == "pallas" and unsupported:
        raise ValueError(f"attention_backend pallas: {unsupported}; use attention_backend xla")
    if name not in VALID_ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; use {', '.join(VALID_ATTENTION_BACKENDS)}")
    return name


def make_attention(spec: ModelSpec, backend: str, mesh: Mesh, page_size: int,
                   platform: str | None = None) -> AttentionBackend:
    """The resolved backend with the model's static options bound."""
    platform = platform or jax.default_backend()
    backend = resolve_backend(backend, spec, page_size, platform)
    if backend == "xla":
        from jaxserve.attention import xla

        return xla.make_backend(spec, platform)
    from jaxserve.attention import pallas_gpu

    return pallas_gpu.make_backend(spec, mesh, interpret=backend == "pallas-interpret")
