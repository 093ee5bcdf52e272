"""What a front end knows of the engine's model: facts fixed at start-up, read once from the LLMEngine, so the server
reads nothing of the engine's internals (it submits requests and commands through the async engine)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxserve.engine.harmony import HarmonyReasoning
from jaxserve.engine.reasoning import ReasoningParser
from jaxserve.model_spec import ClassifierHead

if TYPE_CHECKING:  # (the engine module imports this one)
    from jaxserve.engine.llm_engine import LLMEngine


@dataclasses.dataclass(frozen=True)
class KVCacheFacts:
    """The KV pool as configured and as sized at start-up (vLLM's cache_config_info reports these)."""

    page_size: int
    num_pages: int  # the pool's pages, page 0 (the null page) included
    num_pages_override: int | None  # the num_pages option (None: sized from memory)
    cache_dtype: str  # what the pages hold, e.g. bfloat16 or float8_e4m3fn
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    swap_space: float  # GiB of host swap space (0 when preemption recomputes)
    num_host_pages: int  # the host swap pool's pages (0 without one)


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """The served model and the engine options that change what a request may ask."""

    model_path: str
    max_model_len: int  # the longest prompt + output
    vocab_size: int
    classifier: ClassifierHead | None  # a sequence classifier's head: it classifies and cannot generate
    reasoning: ReasoningParser | HarmonyReasoning | None  # how replies split into thinking and answer
    generation_defaults: dict  # SamplingParams field -> the model's default, for fields a request leaves unset
    scheduling_policy: str  # fcfs or priority: whether a request's priority means anything
    structured_outputs: bool  # whether requests may constrain their output
    sleep_mode: bool  # whether the engine may sleep (the sleep routes)
    loras: dict  # the adapters loaded at start-up: name -> folder
    kv_cache: KVCacheFacts

    @classmethod
    def of(cls, engine: LLMEngine) -> ServedModel:
        """The facts of `engine`, read at start-up."""
        config, core = engine.config, engine.core
        cache, recomputes = config.cache_config, config.scheduler_config.preemption_mode == "recompute"
        kv_cache = KVCacheFacts(
            page_size=cache.page_size, num_pages=core.num_pages, num_pages_override=cache.num_pages,
            cache_dtype=core.runner.cache_dtype.name, enable_prefix_caching=cache.enable_prefix_caching,
            gpu_memory_utilization=cache.gpu_memory_utilization, swap_space=0 if recomputes else cache.swap_space,
            num_host_pages=core.kv.host_pool.num_pages if core.kv.host_pool else 0)
        return cls(
            model_path=engine.model_path, max_model_len=engine.max_model_len, vocab_size=core.spec.vocab_size,
            classifier=core.spec.classifier, reasoning=engine.reasoning,
            generation_defaults=dict(engine.generation_defaults),
            scheduling_policy=config.scheduler_config.scheduling_policy,
            structured_outputs=config.structured_outputs_config.enable_structured_outputs,
            sleep_mode=config.model_config.enable_sleep_mode, loras=engine.list_loras(), kv_cache=kv_cache)
