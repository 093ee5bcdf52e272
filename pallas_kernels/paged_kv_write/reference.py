"""Plain-jnp KV write: the definition of correct for the kernel (the engine's XLA path uses it too)."""

from pallas_kernels.ragged_paged_attention.reference import write_kv

__all__ = ["write_kv"]
