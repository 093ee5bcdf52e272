"""The engine's shapes and its KV pool's size, from its config, the model and the devices: the longest request, the
bucket ladders, the device and host pools (the memory arithmetic itself is kv/sizing.py)."""

from __future__ import annotations

import logging

import jax

from jaxserve.batch.builder import MAX_AUX_EXTRA, BucketLadders
from jaxserve.config import EngineConfig
from jaxserve.kv.cache_manager import pages_for_tokens
from jaxserve.kv.sizing import check_allocator_limit, device_memory_bytes, plan_kv_pages
from jaxserve.model_spec import ModelSpec
from jaxserve.runner.runner import Runner

logger = logging.getLogger(__name__)


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    """The configured length, bounded by what the model was trained for."""
    requested, scheduler = config.model_config.max_model_len, config.scheduler_config
    if requested is None:
        length = spec.max_position_embeddings
    elif requested > spec.max_position_embeddings:
        raise ValueError(
            f"max_model_len ({requested}) exceeds the model's max_position_embeddings "
            f"({spec.max_position_embeddings})"
        )
    else:
        length = requested
    if not scheduler.enable_chunked_prefill and scheduler.max_num_batched_tokens < length:
        raise ValueError(
            f"without chunked prefill max_num_batched_tokens ({scheduler.max_num_batched_tokens}) must be >= "
            f"max_model_len ({length}); enable chunked prefill or lower max_model_len"
        )
    return length


def bucket_ladders(config: EngineConfig, spec: ModelSpec, max_model_len: int) -> BucketLadders:
    """The padded shapes an engine with this config compiles for."""
    return BucketLadders.build(
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        max_model_len=max_model_len,
        page_size=config.cache_config.page_size,
        min_token_bucket=config.compilation_config.min_token_bucket,
        min_page_bucket=config.compilation_config.min_page_bucket,
        max_aux_extra=MAX_AUX_EXTRA + len(spec.eos_token_ids),
    )


def resolve_num_pages(config: EngineConfig, max_model_len: int, runners: list[Runner]) -> int:
    """Pages from `num_pages`, or what `gpu_memory_utilization` of the device leaves after the weights and the
    largest step's activations (kv/sizing.py), or the CPU's `cpu_kv_cache_gib`. `runners`: the target model's
    and, with a draft model, the draft's; each holds a pool of that many pages, and their steps run one after
    the other, so the peak activation is the largest of theirs."""
    per_page = sum(runner.page_bytes() for runner in runners)
    platform = device_platform()
    if config.cache_config.num_pages is not None:
        num_pages = config.cache_config.num_pages
    elif platform == "cpu":
        num_pages = int(config.cache_config.cpu_kv_cache_gib * 2**30 // per_page)
    else:
        tp = config.parallel_config.tensor_parallel_size
        stats = device_memory_stats(tp)
        if platform == "gpu":
            check_allocator_limit(stats, config.cache_config.gpu_memory_utilization)
        pool = pages_for_tokens(max_model_len, config.cache_config.page_size) + 1
        plan = plan_kv_pages(
            device_bytes=device_memory_bytes(stats, platform),
            utilization=config.cache_config.gpu_memory_utilization,
            used_bytes=int(stats.get("bytes_in_use", 0)),
            activation_bytes=max(runner.peak_activation_bytes(pool) for runner in runners),
            page_bytes=per_page // tp,
        )
        logger.info("KV cache sizing: %s", plan.describe())
        num_pages = plan.num_pages
    check_pool_holds_a_request(num_pages, max_model_len, config.cache_config.page_size)
    return num_pages


def resolve_num_host_pages(swap_space_gib: float, page_bytes: int) -> int:
    """Pages of the host swap pool that `swap_space_gib` holds, page 0 (never handed out) included; a ValueError
    when that is not one usable page."""
    num_pages = int(swap_space_gib * 2**30 // page_bytes)
    if num_pages < 2:
        raise ValueError(
            f"swap_space={swap_space_gib} GiB does not hold one KV page of {page_bytes} bytes (plus the unused "
            f"page 0): raise swap_space to at least {2 * page_bytes / 2**30:.6g} GiB or use preemption_mode recompute"
        )
    return num_pages


def check_pool_holds_a_request(num_pages: int, max_model_len: int, page_size: int) -> None:
    """ValueError when a pool of `num_pages` cannot hold one request of `max_model_len` plus the null page."""
    needed = pages_for_tokens(max_model_len, page_size) + 1
    if num_pages < needed:
        raise ValueError(
            f"the KV pool of {num_pages} pages cannot hold one request of max_model_len={max_model_len} "
            f"({needed - 1} pages of {page_size} tokens plus the null page): raise num_pages or the "
            f"memory for the cache, or lower max_model_len"
        )


def device_platform() -> str:
    """The platform the engine runs on: 'cpu', 'gpu' or 'tpu'."""
    return jax.default_backend()


def device_memory_stats(num_devices: int) -> dict:
    """The memory stats of the most loaded of the engine's devices (the pool is the same size on each)."""
    stats = [device.memory_stats() or {} for device in jax.devices()[:num_devices]]
    return max(stats, key=lambda s: s.get("bytes_in_use", 0))
