"""jaxserve: a JAX-compiled LLM serving engine with continuous batching and a paged KV cache.

The public names below are imported on first use (PEP 562), so `import jaxserve.<module>` of a light module (the
console script's, a config's) does not pull in jax: `from jaxserve import LLM` works as before."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

# transformers' advisory warnings are for its own users: "PyTorch was not found. Models won't be available ..." on
# every command of an install without torch reads as a fault, and jaxserve needs only its tokenizers and config
# parsing (set before anything of jaxserve imports transformers; a user's own setting wins)
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# public name -> the module that defines it
_EXPORTS = {
    "EngineConfig": "jaxserve.config",
    "BeamSearchParams": "jaxserve.engine.beam_search",
    "LLM": "jaxserve.engine.llm",
    "LoRARequest": "jaxserve.lora_request",
    "ClassificationOutput": "jaxserve.outputs",
    "CompletionOutput": "jaxserve.outputs",
    "PoolingOutput": "jaxserve.outputs",
    "PoolingRequestOutput": "jaxserve.outputs",
    "RequestOutput": "jaxserve.outputs",
    "ScoringOutput": "jaxserve.outputs",
    "ScoringRequestOutput": "jaxserve.outputs",
    "TokenPoolingOutput": "jaxserve.outputs",
    "PoolingParams": "jaxserve.pooling.params",
    "SamplingParams": "jaxserve.sampling_params",
}

__all__ = ["LLM", "EngineConfig", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
           "LoRARequest", "PoolingParams", "PoolingRequestOutput", "PoolingOutput", "ScoringRequestOutput",
           "ScoringOutput", "ClassificationOutput", "TokenPoolingOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """A public name, imported from its module the first time it is asked for."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and editors see
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
