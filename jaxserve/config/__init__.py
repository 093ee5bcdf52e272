"""The engine's options: EngineConfig and its typed parts (engine.py draws the picture)."""

from jaxserve.config.cache import VALID_KV_CACHE_DTYPES, VALID_PAGE_SIZES, CacheConfig
from jaxserve.config.compilation import DEFAULT_CACHE_DIR, VALID_ATTENTION_BACKENDS, CompilationConfig
from jaxserve.config.engine import CONFIGS_DIR, DEFAULT_MODEL_CONFIG, OPTION_NAMES, EngineConfig
from jaxserve.config.lora import LoraConfig
from jaxserve.config.model import VALID_DTYPES, VALID_QUANTIZATIONS, ModelConfig
from jaxserve.config.parallel import ParallelConfig
from jaxserve.config.scheduler import SchedulerConfig, SchedulerSettings
from jaxserve.config.speculative import EAGLE_METHODS, SpeculativeConfig
from jaxserve.config.structured_outputs import StructuredOutputsConfig

__all__ = [
    "CONFIGS_DIR", "DEFAULT_CACHE_DIR", "DEFAULT_MODEL_CONFIG", "EAGLE_METHODS", "OPTION_NAMES",
    "VALID_ATTENTION_BACKENDS", "VALID_DTYPES", "VALID_KV_CACHE_DTYPES", "VALID_PAGE_SIZES", "VALID_QUANTIZATIONS",
    "CacheConfig", "CompilationConfig", "EngineConfig", "LoraConfig", "ModelConfig", "ParallelConfig",
    "SchedulerConfig", "SchedulerSettings", "SpeculativeConfig", "StructuredOutputsConfig",
]
