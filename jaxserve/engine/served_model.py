"""What a front end knows of the engine's model: facts fixed at start-up, read once from the LLMEngine (or sent by an
engine-core process), so the server reads nothing of the engine's internals (it submits requests and commands
through the async engine)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxserve.config import EngineConfig
from jaxserve.engine.harmony import HarmonyReasoning
from jaxserve.engine.reasoning import ReasoningParser
from jaxserve.engine.request_maker import RequestMaker
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
        return cls.from_parts(engine.config, engine.model_path, engine.requests, kv_cache_facts(engine),
                              engine.list_loras())

    @classmethod
    def from_parts(cls, config: EngineConfig, model_path: str, requests: RequestMaker, kv_cache: KVCacheFacts,
                   loras: dict) -> ServedModel:
        """The facts of an engine of `config` whose requests `requests` checks (in-process, or a core process's
        front end)."""
        facts = requests.facts
        return cls(
            model_path=model_path, max_model_len=facts.max_model_len, vocab_size=facts.vocab_size,
            classifier=facts.classifier, reasoning=requests.reasoning,
            generation_defaults=dict(requests.generation_defaults),
            scheduling_policy=config.scheduler_config.scheduling_policy,
            structured_outputs=config.structured_outputs_config.enable_structured_outputs,
            sleep_mode=config.model_config.enable_sleep_mode, loras=dict(loras), kv_cache=kv_cache)


def kv_cache_facts(engine: LLMEngine) -> KVCacheFacts:
    """The KV pool of `engine` as configured and sized."""
    config, core = engine.config, engine.core
    cache, recomputes = config.cache_config, config.scheduler_config.preemption_mode == "recompute"
    return KVCacheFacts(
        page_size=cache.page_size, num_pages=core.num_pages, num_pages_override=cache.num_pages,
        cache_dtype=core.runner.cache_dtype.name, enable_prefix_caching=cache.enable_prefix_caching,
        gpu_memory_utilization=cache.gpu_memory_utilization, swap_space=0 if recomputes else cache.swap_space,
        num_host_pages=core.kv.host_pool.num_pages if core.kv.host_pool else 0)
