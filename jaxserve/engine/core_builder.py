"""Wiring one EngineCore: the process group, the model and its weights, the runner and a draft, the KV pools, the
LoRA slots and weight control, in the order each needs the others.

    join the process group (multi-host) -> the model's spec and max_model_len -> the mesh and the weights
      -> the runner (and an EAGLE head's or a draft model's) -> the KV pool's size, agreed by every process
      -> compile (all buckets, the largest first, or none) -> KV manager, LoRA slots, weight control
      -> every process ready; the leader's device calls mirrored to the followers
"""

from __future__ import annotations

import dataclasses
import logging

from jax.sharding import Mesh

from jaxserve.attention import fp8
from jaxserve.batch.builder import BucketLadders
from jaxserve.config import EngineConfig
from jaxserve.distributed import runtime
from jaxserve.distributed.channel import FollowerChannel, LeaderChannel
from jaxserve.distributed.mirror import Mirrored, exit_soon
from jaxserve.engine.lora_slots import LoraSlots
from jaxserve.engine.sizing import bucket_ladders, resolve_max_model_len, resolve_num_host_pages, resolve_num_pages
from jaxserve.engine.weight_control import WeightControl
from jaxserve.kv.cache_manager import KVCacheManager, pages_for_tokens
from jaxserve.kv.page_pool import PagePool
from jaxserve.kv.sizing import reserve_device_memory
from jaxserve.lora_request import LoRARequest
from jaxserve.model.checkpoint import is_checkpoint, load_weights
from jaxserve.model.eagle import HeadConfig, read_head_config
from jaxserve.model.lora import lora_slot_structs, with_lora_slots
from jaxserve.model.registry import load_model_spec, model_for
from jaxserve.model_spec import ModelSpec
from jaxserve.pooling.params import PoolerConfig, matryoshka_dimensions, resolve_pooler_config
from jaxserve.runner.executables import enable_compilation_cache
from jaxserve.runner.runner import Runner
from jaxserve.sharding import cache_kv_heads, check_replica_devices, make_mesh, with_expert_parallel
from jaxserve.spec_decode.draft import DraftModelProposer
from jaxserve.spec_decode.eagle import EagleProposer

logger = logging.getLogger("jaxserve")


@dataclasses.dataclass
class CoreParts:
    """What an EngineCore runs over."""

    group: runtime.ProcessGroup | None  # the multi-host launch's processes; None in one process
    channel: LeaderChannel | FollowerChannel | None  # the step channel between them
    spec: ModelSpec  # the model, for max_model_len
    max_model_len: int
    mesh: Mesh
    ladders: BucketLadders  # the step buckets' shapes
    runner: Runner  # (Mirrored on a multi-host leader)
    draft: DraftModelProposer | EagleProposer | None  # speculative decoding's draft model or EAGLE head
    pooler: PoolerConfig | None  # runner pooling: how prompts are pooled into embeddings or classes
    matryoshka_dimensions: tuple[int, ...] | None  # the sizes a Matryoshka model may cut embeddings to
    num_pages: int  # of the KV pool (the draft's has as many)
    kv: KVCacheManager
    lora_slots: LoraSlots
    weights: WeightControl  # the weights' version and source; sleep mode


def build_core_parts(config: EngineConfig, model_path: str, show_progress: bool = True,
                     first_device: int = 0) -> CoreParts:
    """The parts of the engine of `config` over the model folder `model_path`, on `tensor_parallel_size` devices
    from `first_device` on (a data-parallel replica's); in a multi-host launch, over every process's devices.

    Args:
        config: the engine's options.
        model_path: the model folder (Hugging Face or `jaxserve convert`'s).
        show_progress: progress bars while the buckets compile.
        first_device: the first of this engine's devices.
    Returns:
        The parts, the buckets compiled as `compilation_config` says, every process past its start-up barrier.
    """
    cache, compilation, parallel = config.cache_config, config.compilation_config, config.parallel_config
    reserve_device_memory(cache.gpu_memory_utilization)  # before JAX starts its GPU backend
    group = runtime.join(parallel.distributed_coordinator, parallel.num_processes, parallel.process_id,
                         parallel.distributed_timeout_s)  # before anything touches a device
    channel = _open_step_channel(group, parallel.distributed_timeout_s)
    enable_compilation_cache(compilation.compilation_cache_dir)
    spec = with_expert_parallel(load_model_spec(model_path), parallel.enable_expert_parallel)
    max_model_len = resolve_max_model_len(config, spec)
    spec = spec.for_max_model_len(max_model_len)
    pooling = config.model_config.runs_pooling(spec)
    if spec.classifier is not None and config.speculative_config is not None:
        raise ValueError("speculative_config: a sequence classifier generates nothing to speculate on; leave it unset")
    tp = parallel.tensor_parallel_size
    if group is not None:
        runtime.check_mesh_spans_processes(tp, group)
    check_replica_devices(tp, parallel.data_parallel_size)  # before replica 0 loads anything
    mesh = make_mesh(tp, first_device)
    kv_heads = cache_kv_heads(spec, tp)
    ladders = bucket_ladders(config, spec, max_model_len)
    speculative = config.speculative_config
    head = read_head_config(speculative.model, speculative.method, spec) if speculative and speculative.uses_eagle \
        else None  # an EAGLE head's folder, read once: what the target keeps for it, then the head
    runner, dtype = _load_runner(config, model_path, spec, mesh, kv_heads, ladders, pooling, head)
    pooler = resolve_pooler_config(model_path, config.model_config.pooler_config) if pooling else None
    matryoshka = matryoshka_dimensions(model_path, spec.hidden_size) if pooling else None
    draft = None
    if speculative is not None and speculative.method == "draft_model":
        draft = DraftModelProposer.load(config, spec, mesh, ladders, max_model_len)
    elif head is not None:
        draft = EagleProposer.load(config, head, mesh, ladders, max_model_len, runner)
    # The draft's pool has as many pages as the target's, so a page of each is sized together.
    num_pages = resolve_num_pages(config, max_model_len, [runner] + ([draft.runner] if draft else []))
    if group is not None:  # hosts may see different free memory: every process takes the smallest pool
        num_pages = runtime.agreed_minimum("num_pages", num_pages, group)
    logger.info("KV cache: %d pages of %d tokens (%d tokens) in %s%s", num_pages, cache.page_size,
                num_pages * cache.page_size, runner.cache_dtype.name, fp8.tokens_note(cache.kv_cache_dtype, dtype))
    kv = _allocate_and_compile(config, runner, draft, num_pages, max_model_len, show_progress, group is not None)
    if isinstance(draft, EagleProposer):
        draft.target_kv = kv  # where the target keeps each request's features
    lora = config.lora_config
    lora_slots = LoraSlots(spec, lora.max_loras, lora.max_lora_rank, kv_heads)
    if lora.enable_lora:
        runner.set_lora(0, {})  # compiles the slot writes now, not at the first adapter loaded later
        for index, (name, path) in enumerate((lora.lora_modules or {}).items()):
            lora_slots.add(LoRARequest(name, index + 1, path), runner)
    reloadable = config.model_config.load_format == "auto" and not is_checkpoint(model_path)
    weights = WeightControl(spec, kv_heads, mesh.devices.size, group is not None, model_path if reloadable else None)
    if group is not None:  # nobody runs a step (a collective) before everybody can
        runtime.barrier("started")
    if isinstance(channel, LeaderChannel):  # every device call from here on is made by every process
        runner = Mirrored(runner, "runner", channel)
        if draft is not None:
            draft.runner = Mirrored(draft.runner, "draft", channel)
    return CoreParts(group, channel, spec, max_model_len, mesh, ladders, runner, draft, pooler, matryoshka,
                     num_pages, kv, lora_slots, weights)


def _open_step_channel(group: runtime.ProcessGroup | None, timeout_s: float) -> LeaderChannel | FollowerChannel | None:
    """The multi-host step channel (distributed/channel.py), or None in a one-process engine. A lost follower ends
    the leader soon after (distributed/mirror.py); the leader says stop to the followers at exit."""
    if group is None:
        return None
    if not group.is_leader:
        return FollowerChannel(group, timeout_s)
    channel = LeaderChannel(group, timeout_s)
    channel.on_lost(exit_soon)
    runtime.before_leaving(channel.close)
    return channel


def _load_runner(config: EngineConfig, model_path: str, spec: ModelSpec, mesh: Mesh, kv_heads: int,
                 ladders: BucketLadders, pooling: bool, head: HeadConfig | None) -> tuple[Runner, object]:
    """(the target's runner over its weights, with LoRA slots when enable_lora; the weights' float dtype)."""
    lora = config.lora_config
    params, dtype = load_weights(config, model_path, spec, mesh, kv_heads)
    if lora.enable_lora:  # max_loras free adapter slots in the params (model/lora.py)
        params = with_lora_slots(params, lora_slot_structs(model_for(spec.architecture), spec, kv_heads, mesh,
                                                           lora.max_loras, lora.max_lora_rank, dtype))
    runner = Runner(
        spec, params, mesh,
        page_size=config.cache_config.page_size, num_cache_kv_heads=kv_heads,
        cache_dtype=fp8.cache_dtype(config.cache_config.kv_cache_dtype, dtype), ladders=ladders,
        attention_backend=config.compilation_config.attention_backend,
        num_scheduler_steps=config.scheduler_config.num_scheduler_steps,
        num_speculative_tokens=config.num_speculative_tokens,
        structured_outputs=config.structured_outputs_config.enable_structured_outputs, pooling=pooling,
        logprobs_mode=config.model_config.logprobs_mode,
        features=head.features if head else None,  # what an EAGLE head reads of the target
    )
    return runner, dtype


def _allocate_and_compile(config: EngineConfig, runner: Runner, draft, num_pages: int, max_model_len: int,
                          show_progress: bool, multi_host: bool) -> KVCacheManager:
    """Allocate the KV pools (the host's swap space too, when preemption swaps), compile the buckets as
    `compilation_config` says, and return the KV manager over the pool."""
    cache, compilation = config.cache_config, config.compilation_config
    host_pool = None
    if config.scheduler_config.preemption_mode != "recompute":
        host_pool = PagePool(resolve_num_host_pages(cache.swap_space, runner.page_bytes()))
    runner.allocate_kv(num_pages)
    if compilation.skip_precompile:
        logger.info("skip_precompile: each bucket compiles at its first use")
    else:
        if compilation.background_compile and multi_host:  # every process must run the same buckets
            logger.info("background_compile: a multi-host engine compiles every bucket first")
        runner.warmup(show_progress, background=compilation.background_compile and not multi_host)
    if draft is not None:
        draft.allocate(num_pages, show_progress, precompile=not compilation.skip_precompile)
    if host_pool is not None:
        runner.allocate_host_kv(host_pool.num_pages, pages_for_tokens(max_model_len, cache.page_size))
    return KVCacheManager(PagePool(num_pages), cache.page_size, config.prefix_caching, host_pool)
