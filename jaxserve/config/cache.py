"""The KV cache part of the engine's config: the page pool's size and dtype, prefix caching, and the host swap pool."""

from __future__ import annotations

import dataclasses

from jaxserve.config.options import SERVE_ONLY, check_bools, check_choice, option

VALID_PAGE_SIZES = (8, 16, 32)
# auto: the weights' dtype; fp8: e4m3 pages with per-head scales (attention/fp8.py)
VALID_KV_CACHE_DTYPES = ("auto", "fp8")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The KV page pool (vLLM's CacheConfig)."""

    page_size: int = option(16, "tokens per KV page", choices=VALID_PAGE_SIZES)
    num_pages: int | None = option(None, "KV pages in the pool (page 0 is the null page)",
                                   default_text="what memory holds")
    gpu_memory_utilization: float = option(
        0.9, "share of each accelerator's memory for the engine: weights, the largest step's activations, and the "
        "KV pool, which gets what is left")
    cpu_kv_cache_gib: float = option(0.5, "KV pool size on the CPU when --num-pages is not given")
    enable_prefix_caching: bool = option(True, "share the KV pages of prompts' common prefixes across requests",
                                         commands=SERVE_ONLY)
    kv_cache_dtype: str = option(
        "auto", "the KV pages' dtype: auto (the weights') or fp8 (e4m3 with a scale per layer and KV head: twice "
        "the tokens in the same memory)", choices=VALID_KV_CACHE_DTYPES)
    calculate_kv_scales: bool = option(
        False, "with kv_cache_dtype fp8: compute the scales from a calibration pass at start-up instead of taking "
        "the checkpoint's k_scale/v_scale (or 1.0)")
    swap_space: float = option(4.0, "GiB of host memory for swapped-out KV pages (preemption_mode swap or auto)",
                               commands=SERVE_ONLY)

    def __post_init__(self):
        check_choice("page_size", self.page_size, VALID_PAGE_SIZES)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, VALID_KV_CACHE_DTYPES)
        check_bools(self, "enable_prefix_caching", "calculate_kv_scales")
        if self.calculate_kv_scales and self.kv_cache_dtype != "fp8":
            raise ValueError("calculate_kv_scales computes the fp8 KV cache's scales: set kv_cache_dtype fp8 too")
        if not isinstance(self.swap_space, (int, float)) or not 0 <= self.swap_space < float("inf"):
            raise ValueError(f"swap_space must be a finite number of GiB >= 0, got {self.swap_space!r}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
