"""The model part of the engine's config: which weights, in what dtype and form, and what the engine runs them for."""

from __future__ import annotations

import dataclasses
import os

from jaxserve.config.options import SERVE_ONLY, check_bools, check_choice, mapping_option, option
from jaxserve.pooling.params import PoolerConfig

VALID_DTYPES = ("auto", "float32", "bfloat16", "float16")
VALID_QUANTIZATIONS = ("none", "int8", "fp8")  # weight-only quantization at load time (model/quantize.py)
VALID_LOAD_FORMATS = ("auto", "dummy")  # dummy: random weights made on the device (vLLM's name), for benchmarks
# generate: the engine samples tokens; pooling: it also serves embeddings or a classifier's classes (pooling/);
# auto: pooling for a sequence classifier, else generate (vLLM's `runner`)
VALID_RUNNERS = ("auto", "generate", "pooling")
# What sampled tokens' logprobs report (vLLM's logprobs_mode; sampling/sampler.py): the raw model distribution's
# log-probabilities or logits, or those of the processed distribution each row samples from.
VALID_LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model and how it is loaded (vLLM's ModelConfig and LoadConfig)."""

    model: str | None = option(None, "Hugging Face model folder (or an orbax checkpoint from `jaxserve convert`)",
                               default_text="the bundled tiny model")
    tokenizer: str | None = option(None, "tokenizer folder", default_text="the model folder")
    dtype: str = option("auto", "the weights' and activations' dtype (auto: the checkpoint's)", choices=VALID_DTYPES)
    max_model_len: int | None = option(None, "longest prompt + output of a request",
                                       default_text="the model's max_position_embeddings")
    quantization: str | None = option(
        "none", "weight-only quantization of the linear layers at load time: int8 or fp8 (e4m3), one scale per "
        "output channel", choices=VALID_QUANTIZATIONS)
    load_format: str = option("auto", "auto (the folder's safetensors) or dummy (random weights, for benchmarks)",
                              choices=VALID_LOAD_FORMATS)
    generation_config: str = option(
        "auto", "sampling defaults for what a request leaves unset: auto (the model's generation_config.json), "
        "vllm (none) or a folder")
    seed: int = option(0, "seeds the per-request seeds of unseeded requests")
    runner: str = option(
        "auto", "pooling: also serve embeddings (/v1/embeddings, LLM.embed) or a sequence classifier's classes "
        "(/classify, LLM.classify); auto: pooling for a sequence classifier, else generate", choices=VALID_RUNNERS,
        commands=SERVE_ONLY)
    pooler_config: dict | None = option(
        None, 'with runner pooling, how to pool, as JSON: \'{"pooling_type": "MEAN", "normalize": false}\'',
        default_text="the folder's sentence-transformers pooling, else LAST, normalized", commands=SERVE_ONLY)
    logprobs_mode: str = option(
        "raw_logprobs", "what logprobs report: the raw distribution's (raw_logprobs, raw_logits) or the processed "
        "one each token was sampled from (processed_logprobs, processed_logits)", choices=VALID_LOGPROBS_MODES,
        commands=SERVE_ONLY)
    enable_sleep_mode: bool = option(
        False, "let the engine free its KV pool and weights between uses (LLM.sleep / wake_up; POST /sleep, "
        "/wake_up)", commands=SERVE_ONLY)

    def __post_init__(self):
        check_choice("dtype", self.dtype, VALID_DTYPES)
        if self.quantization is None:
            object.__setattr__(self, "quantization", "none")
        check_choice("quantization", self.quantization, VALID_QUANTIZATIONS)
        check_choice("load_format", self.load_format, VALID_LOAD_FORMATS)
        check_choice("runner", self.runner, VALID_RUNNERS)
        check_choice("logprobs_mode", self.logprobs_mode, VALID_LOGPROBS_MODES)
        check_bools(self, "enable_sleep_mode")
        if self.pooler_config is not None:
            object.__setattr__(self, "pooler_config", _checked_pooler_config(self.pooler_config))
            if self.runner == "generate":  # (runner auto: checked against the model, runs_pooling)
                raise ValueError("pooler_config is for runner pooling: set runner pooling too")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise ValueError(f"generation_config must be auto, vllm or a folder holding generation_config.json; "
                             f"got {self.generation_config!r}")

    def runs_pooling(self, spec) -> bool:
        """Whether an engine of this model (`spec`, its ModelSpec) pools: runner pooling, or auto over a sequence
        classifier; a ValueError for runner generate over a classifier, which has no LM head, and for a pooler_config
        given to an engine that does not pool."""
        if spec.classifier is not None and self.runner == "generate":
            raise ValueError(f"the model is a sequence classifier ({spec.classifier.counted}, no LM head): it "
                             f"classifies and cannot generate; start it with runner pooling (or auto)")
        pooling = self.runner == "pooling" or spec.classifier is not None
        if self.pooler_config is not None and not pooling:
            raise ValueError("pooler_config is for runner pooling: set runner pooling too")
        return pooling


def _checked_pooler_config(value) -> dict:
    """pooler_config checked against PoolerConfig's keys and values (pooling/params.py)."""
    value = mapping_option("pooler_config", value, tuple(f.name for f in dataclasses.fields(PoolerConfig)))
    PoolerConfig(**value)
    return value
