"""How many KV pages fit: `gpu_memory_utilization` as vLLM means it.

The engine may use `gpu_memory_utilization` of each device's whole memory for everything it holds:
weights, the peak activations of its largest step, and the KV pool, which gets what is left:

    kv = utilization * device memory - memory in use after loading the weights - peak activations

The peak activations come from XLA's memory analysis of the largest forward bucket (temporaries plus
outputs that do not alias a donated input), so they are known before any pool is allocated.

On a GPU, JAX's allocator may hand out only `XLA_PYTHON_CLIENT_MEM_FRACTION` of the memory (0.75 by
default). `reserve_device_memory` raises that fraction to the utilisation when JAX has not started its
GPU backend yet; if it has, a utilisation above the fraction is a clear error.
"""

from __future__ import annotations

import dataclasses
import os

GIB = 2**30
MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
DEFAULT_GPU_MEM_FRACTION = 0.75  # JAX's default share of GPU memory for its allocator

# Memory of one device, as its runtime reports it (nvidia-smi's memory.total for the GPUs), for estimates
# made without the device (`jaxserve check-config`).
DEVICE_MEMORY_BYTES = {
    "h100": 81559 * 2**20,
    "h200": 143771 * 2**20,  # read on this project's H200, 2026-11-30
    "tpu-v5e": 16 * GIB,
    "tpu-v5p": 95 * GIB,
    "tpu-v6e": 32 * GIB,
}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The split of one device's memory (bytes, per device)."""

    device_bytes: int  # the device's whole memory
    utilization: float  # the share the engine may use
    used_bytes: int  # in use before the pool: weights (and anything else already allocated)
    activation_bytes: int  # peak temporaries of the largest step
    page_bytes: int  # one page of every layer's K and V on this device
    num_pages: int  # pages in the pool, the null page included

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV pool."""
        return self.num_pages * self.page_bytes

    def describe(self) -> str:
        """One line for the start-up log."""
        budget = self.utilization * self.device_bytes
        return (f"device memory {self.device_bytes / GIB:.1f} GiB x gpu_memory_utilization {self.utilization:g} = "
                f"{budget / GIB:.1f} GiB: weights and other buffers {self.used_bytes / GIB:.2f} GiB, peak "
                f"activations {self.activation_bytes / GIB:.2f} GiB, KV cache {self.kv_bytes / GIB:.2f} GiB "
                f"({self.num_pages} pages)")


def plan_kv_pages(device_bytes: int, utilization: float, used_bytes: int, activation_bytes: int,
                  page_bytes: int) -> MemoryPlan:
    """The pool that fills what `utilization` of the device leaves; ValueError (saying what to change) when
    nothing is left."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    left = utilization * device_bytes - used_bytes - activation_bytes
    num_pages = int(left // page_bytes)
    if num_pages < 2:
        raise ValueError(
            f"no memory left for the KV cache: gpu_memory_utilization {utilization:g} of "
            f"{device_bytes / GIB:.1f} GiB is {utilization * device_bytes / GIB:.1f} GiB, and the weights and other "
            f"buffers take {used_bytes / GIB:.2f} GiB and the largest step's activations "
            f"{activation_bytes / GIB:.2f} GiB: raise gpu_memory_utilization, lower max_num_batched_tokens, or "
            f"use more devices (tensor_parallel_size)"
        )
    return MemoryPlan(device_bytes, utilization, used_bytes, activation_bytes, page_bytes, num_pages)


def allocator_fraction() -> float:
    """The share of GPU memory JAX's allocator may hand out in this process."""
    return float(os.environ.get(MEM_FRACTION_ENV, DEFAULT_GPU_MEM_FRACTION))


def device_memory_bytes(stats: dict, platform: str) -> int:
    """The whole memory of a device from its `memory_stats()`: on a GPU, the allocator's limit is
    `allocator_fraction()` of it; on a TPU the limit is the whole memory."""
    limit = int(stats.get("bytes_limit", 0))
    if limit <= 0:
        raise ValueError("the device reports no memory limit: set num_pages to size the KV cache")
    return int(limit / allocator_fraction()) if platform == "gpu" else limit


def check_allocator_limit(stats: dict, utilization: float) -> None:
    """ValueError when JAX's GPU allocator may not hand out the share of memory the engine is to use."""
    fraction = allocator_fraction()
    if utilization > fraction + 1e-9:
        raise ValueError(
            f"gpu_memory_utilization {utilization:g} is more than JAX's allocator may use in this process "
            f"({MEM_FRACTION_ENV}={fraction:g}, {int(stats.get('bytes_limit', 0)) / GIB:.1f} GiB): set "
            f"{MEM_FRACTION_ENV}={utilization:g} before JAX starts (jaxserve's commands and LLM do this when they "
            f"start JAX), or lower gpu_memory_utilization"
        )


def reserve_device_memory(utilization: float) -> None:
    """Let JAX's GPU allocator use `utilization` of the memory, when JAX has not started its backends yet
    and the user has not set the fraction themselves."""
    from jax._src import xla_bridge

    if MEM_FRACTION_ENV not in os.environ and not xla_bridge.backends_are_initialized():
        os.environ[MEM_FRACTION_ENV] = f"{max(utilization, 0.01):g}"
