"""What a pooling request asks for: the engine's pooler (how a prompt's token states become one vector) and each
request's PoolingParams, with vLLM's names."""

from __future__ import annotations

import dataclasses
import json
import os

from jaxserve.sampling_params import INT32_MAX, check_int

# an embedding model's vector; a sequence classifier's class probabilities; a cross-encoder's (a one-label
# classifier's) score of a text pair; token-wise, every prompt token's embedding, or its class probabilities (a
# reward model's per-token scores: vLLM's LLM.reward)
POOLING_TASKS = ("embed", "classify", "score", "token_embed", "token_classify")
CLASSIFIER_TASKS = ("classify", "score", "token_classify")  # the tasks of a sequence classifier; the rest an embedder's
POOLING_TYPES = ("LAST", "MEAN", "CLS")  # the last prompt token's state, the mean over the prompt, the first token's
DEFAULT_POOLING_TYPE = "LAST"  # a decoder's last token has seen the whole prompt (vLLM's default for decoders)
# sentence-transformers' Pooling module options (its 1_Pooling/config.json) -> our pooling type
_SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                                "pooling_mode_cls_token": "CLS"}


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """How an engine pools: `pooling_type` (POOLING_TYPES) and whether embeddings are L2-normalized by default."""

    pooling_type: str = DEFAULT_POOLING_TYPE
    normalize: bool = True

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config pooling_type must be one of {', '.join(POOLING_TYPES)}; got "
                             f"{self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config normalize must be true or false, got {self.normalize!r}")


def resolve_pooler_config(model_path: str, overrides: dict | None) -> PoolerConfig:
    """The engine's pooler: `overrides` (the pooler_config option) over the pooling type the model folder's
    sentence-transformers files declare (modules.json naming a Pooling module), over LAST with normalization."""
    return PoolerConfig(**{**_sentence_transformers_pooler(model_path), **(overrides or {})})


def _sentence_transformers_pooler(model_path: str) -> dict:
    """{pooling_type, normalize} from a sentence-transformers folder's modules.json and its Pooling module's
    config.json; {} for a folder without them, or one whose pooling mode is none of ours."""
    modules_file = os.path.join(model_path, "modules.json")
    if not os.path.isfile(modules_file):
        return {}
    with open(modules_file) as f:
        modules = json.load(f)
    pooling = [m for m in modules if str(m.get("type", "")).endswith("models.Pooling")]
    if not pooling:
        return {}
    with open(os.path.join(model_path, pooling[0].get("path", ""), "config.json")) as f:
        options = json.load(f)
    types = [kind for key, kind in _SENTENCE_TRANSFORMERS_MODES.items() if options.get(key)]
    if len(types) != 1:
        return {}
    normalize = any(str(m.get("type", "")).endswith("models.Normalize") for m in modules)
    return {"pooling_type": types[0], "normalize": normalize}


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """One pooling request's options (vLLM's PoolingParams): `dimensions` keeps the first that many values (a
    Matryoshka model's shorter embedding; None: all), `normalize` L2-normalizes after that (None: the engine's
    pooler decides), `truncate_prompt_tokens` keeps only the prompt's last that many tokens, and `use_activation`
    (a classifier's: None or true apply its activation, false gives the raw class logits, e.g. a reward model's
    score)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None

    def __post_init__(self):
        for name in ("dimensions", "truncate_prompt_tokens"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1, INT32_MAX)
        for name in ("normalize", "use_activation"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true, false or None, got {getattr(self, name)!r}")

    def check_task(self, task: str) -> None:
        """ValueError naming the field this request sets that `task` (POOLING_TASKS) has no use for."""
        if task in CLASSIFIER_TASKS:
            for name in ("dimensions", "normalize"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is for embeddings; a classification leaves it unset")
        elif self.use_activation is not None:
            raise ValueError("use_activation is for a sequence classifier's classes; an embedding leaves it unset "
                             "(normalize is its counterpart)")


def matryoshka_dimensions(model_path: str, hidden_size: int) -> tuple[int, ...] | None:
    """The embedding sizes a Matryoshka model was trained to be cut to (config.json's `matryoshka_dimensions`, or
    any size when it says `is_matryoshka`); None for any other model."""
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    if config.get("matryoshka_dimensions"):
        return tuple(int(size) for size in config["matryoshka_dimensions"])
    return tuple(range(1, hidden_size + 1)) if config.get("is_matryoshka") else None


def check_dimensions(dimensions: int | None, allowed: tuple[int, ...] | None) -> None:
    """ValueError unless a request's `dimensions` is None or one of the model's Matryoshka sizes `allowed` (None:
    the model has none, so a shorter embedding would mean nothing)."""
    if dimensions is None:
        return
    if allowed is None:
        raise ValueError("dimensions: this model was not trained for shorter (Matryoshka) embeddings; leave "
                         "dimensions unset")
    if dimensions not in allowed:
        contiguous = allowed == tuple(range(1, len(allowed) + 1))
        shown = f"1 to {len(allowed)}" if contiguous else ", ".join(map(str, allowed))
        raise ValueError(f"dimensions must be one of {shown}, got {dimensions}")
