"""jaxserve: a JAX-compiled LLM serving engine with continuous batching and a paged KV cache."""

from jaxserve.config import EngineConfig
from jaxserve.engine.beam_search import BeamSearchParams
from jaxserve.engine.llm import LLM
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import (
    ClassificationOutput,
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    TokenPoolingOutput,
)
from jaxserve.pooling.params import PoolingParams
from jaxserve.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
           "LoRARequest", "PoolingParams", "PoolingRequestOutput", "PoolingOutput", "ScoringRequestOutput",
           "ScoringOutput", "ClassificationOutput", "TokenPoolingOutput"]
__version__ = "0.1.0"
