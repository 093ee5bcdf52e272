"""ModelSpec: the hyper-parameters every architecture has, parsed from a checkpoint's config.json (an architecture
with more subclasses it: model/gemma.py, model/moe_llama.py), and the Llama family's parser."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

LLAMA_FAMILY = (  # the architectures model/llama.py serves
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
_ROPE_TYPE_ALIASES = {"su": "longrope"}  # Phi-3's first name for LongRoPE
CLASSIFIER_SUFFIX = "ForSequenceClassification"  # XForSequenceClassification: XForCausalLM's body under a score head
TOKEN_CLASSIFIER_SUFFIX = "ForTokenClassification"  # XForTokenClassification: the same, every token classified
# a sentence-transformers cross-encoder's activation (config.json `sentence_transformers.activation_fn` or
# `sbert_ce_default_activation_function`) -> ours
_CROSS_ENCODER_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid",
                              "torch.nn.modules.linear.Identity": "identity",
                              "torch.nn.modules.activation.Softmax": "softmax"}


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding settings; `inv_freq()` gives the per-pair frequencies."""

    theta: float
    head_dim: int
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rotary_dim: int = 0  # partial rotary (Phi-4-mini's partial_rotary_factor): the first dims of each head; 0: all
    # LongRoPE (Phi-3): each frequency's divisor for contexts up to original_max_position_embeddings and beyond it
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    long_context: bool = False  # LongRoPE's long factors: max_model_len exceeds original_max_position_embeddings
    attention_factor: float = 1.0  # cos and sin scaled by it (LongRoPE's, YaRN's)
    beta_fast: float = 32.0  # YaRN: the frequencies kept (more rotations than beta_fast over the original context)
    beta_slow: float = 1.0  # ... and those interpolated by `factor` (fewer than beta_slow), a ramp between
    truncate: bool = True  # YaRN: the ramp's bounds rounded outwards to whole dims

    def inv_freq(self) -> np.ndarray:
        """Inverse frequencies, as Hugging Face computes them for this rope type."""
        # inv_freq: (rotary dims // 2,) float64
        dim = self.rotary_dim or self.head_dim
        inv_freq = 1.0 / (self.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            return _llama3_inv_freq(inv_freq, self)
        if self.rope_type == "longrope":
            return inv_freq / np.asarray(self.long_factor if self.long_context else self.short_factor)
        if self.rope_type == "yarn":
            return _yarn_inv_freq(inv_freq, dim, self)
        return inv_freq

    def context_length(self, max_position_embeddings: int) -> int:
        """The longest context the embedding serves: YaRN's original context times its factor (as vLLM derives it;
        Qwen's configs keep the pretrained max_position_embeddings), else `max_position_embeddings`."""
        if self.rope_type == "yarn":
            return max(max_position_embeddings, int(self.original_max_position_embeddings * self.factor))
        return max_position_embeddings

    def for_max_model_len(self, max_model_len: int) -> "RopeSpec":
        """The rotary embedding served for contexts of up to `max_model_len` tokens: LongRoPE's long factors at every
        position when it exceeds original_max_position_embeddings, else its short ones (vLLM's choice: one set for
        the whole context, so no cached key goes stale when a sequence crosses the boundary)."""
        long_context = self.rope_type == "longrope" and max_model_len > self.original_max_position_embeddings
        return dataclasses.replace(self, long_context=long_context)


def _llama3_inv_freq(inv_freq: np.ndarray, rope: RopeSpec) -> np.ndarray:
    """Llama 3.1's frequency-dependent scaling: long wavelengths slowed by `factor`, smooth in between."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: np.ndarray, dim: int, rope: RopeSpec) -> np.ndarray:
    """YaRN: the high frequencies kept, the low ones divided by `factor`, a linear ramp over the dims between."""

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over the original context
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(
            rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)  # 0: kept, 1: interpolated
    return inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)


@dataclasses.dataclass(frozen=True)
class ClassifierHead:
    """A sequence classifier's head (Hugging Face's `XForSequenceClassification`): `score.weight` (labels, H) over
    the final hidden state of the last prompt token, in place of the LM head; a token classifier's
    (`XForTokenClassification`, `per_token`): `score.weight` and `score.bias` (labels,) over every token's."""

    labels: tuple[str, ...]  # each class's name (config.json's id2label, in id order)
    activation: str  # softmax, sigmoid or identity: what classification applies to the logits
    score_activation: str  # what scoring a text pair (a cross-encoder) applies to its one logit
    per_token: bool = False  # a token classifier: it classifies every token (token_classify) and nothing else

    @property
    def num_labels(self) -> int:
        """How many classes the head scores."""
        return len(self.labels)

    @property
    def counted(self) -> str:
        """'1 label', '3 labels': for messages."""
        return f"{self.num_labels} label{'' if self.num_labels == 1 else 's'}"


def classifier_head(config: dict, per_token: bool = False) -> ClassifierHead:
    """A classifier config's head: its labels from `id2label` (or `num_labels`, named LABEL_i, transformers'
    default of 2), the classification activation of its `problem_type` (regression: none, multi-label: sigmoid,
    else sigmoid for one label and softmax for more) and the cross-encoder activation its sentence-transformers
    settings name (else the classification one); a ValueError for what is malformed."""
    id2label = config.get("id2label")
    if id2label:
        try:
            named = sorted((int(index), str(label)) for index, label in id2label.items())
        except (AttributeError, TypeError, ValueError):
            raise ValueError(f"config.json id2label must map label ids 0..N-1 to names, got {id2label!r}") from None
        if [index for index, _ in named] != list(range(len(named))):
            raise ValueError(f"config.json id2label must map label ids 0..N-1 to names, got {id2label!r}")
        labels = tuple(label for _, label in named)
    else:
        num_labels = config.get("num_labels", 2)
        if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(f"config.json num_labels must be a positive int, got {num_labels!r}")
        labels = tuple(f"LABEL_{index}" for index in range(num_labels))
    problem_type = config.get("problem_type")
    if problem_type == "regression":
        activation = "identity"
    elif problem_type == "multi_label_classification":
        activation = "sigmoid"
    elif problem_type in (None, "single_label_classification"):
        activation = "sigmoid" if len(labels) == 1 else "softmax"
    else:
        raise ValueError(f"config.json problem_type must be regression, single_label_classification or "
                         f"multi_label_classification, got {problem_type!r}")
    function = (config.get("sentence_transformers") or {}).get("activation_fn") or config.get(
        "sbert_ce_default_activation_function")
    if function is not None and function not in _CROSS_ENCODER_ACTIVATIONS:
        raise ValueError(f"unsupported cross-encoder activation {function!r}; supported: "
                         f"{', '.join(_CROSS_ENCODER_ACTIVATIONS)}")
    return ClassifierHead(labels, activation, _CROSS_ENCODER_ACTIVATIONS.get(function, activation), per_token)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Everything the forward pass needs to know about an architecture instance."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # "fp8": the checkpoint's linear layers are float8_e4m3fn, each with its float32 scales in the tensor named
    # weight + `checkpoint_scale_suffix` (its quantization_config: compressed-tensors float-quantized, or quant_method
    # "fp8"); "int4": symmetric 4-bit integers packed eight to an int32 (compressed-tensors pack-quantized, W4A16),
    # `weight_packed` with its `weight_scale`; "int8": 8-bit integers (GPTQ's 8 bits, symmetric); else "none". The
    # scales are one per output channel or per tensor, or
    # with `checkpoint_weight_block` (rows, columns) one per block of the stored (out, in) weight (DeepSeek's and
    # Qwen3-FP8's `weight_block_size`; an int4 group of `group_size` input columns is a block of (1, group_size)).
    checkpoint_quantization: str = "none"
    checkpoint_weight_block: tuple[int, int] | None = None
    checkpoint_scale_suffix: str = "_scale"
    # int4 groups that are asymmetric: each group's zero point too, `weight_zero_point` (llm-compressor's W4A16_ASYM)
    checkpoint_zero_points: bool = False
    # how the quantized tensors are named and packed: "compressed-tensors" (and quant_method fp8's weights with their
    # scales), "awq" (AutoAWQ's GEMM tensors `qweight`, `qzeros`, `scales`) or "gptq" (GPTQ's `qweight`, `qzeros`
    # stored less one, `scales`, `g_idx`), the last two read through model/loader.py's AwqGemm and GptqPacked views
    # as the first); or "mxfp4": gpt-oss's MXFP4 experts (`X_blocks`, `X_scales`: quant_method mxfp4), dequantized
    # as they load by model/loader.py's Mxfp4Experts view, so checkpoint_quantization stays "none" (the experts are
    # served in float, or quantized by the engine's `quantization` as a float checkpoint's are)
    checkpoint_format: str = "compressed-tensors"
    # GPTQ's act-order (`desc_act` without `static_groups`): each weight's `g_idx` puts its input rows in any group
    checkpoint_act_order: bool = False
    # A mixture of experts' experts split whole over the `model` mesh axis (expert parallelism) instead of each
    # expert split like a dense MLP: the enable_expert_parallel option, vLLM's flag (model/moe_llama.py).
    expert_parallel: bool = False
    # Each attention head has a learned sink logit in its softmax's denominator (gpt-oss): the attention backend must
    # take `sinks` (JAX's TPU kernel does not)
    attention_sinks: bool = False
    # The reasoning parser its replies need when the engine names none (gpt-oss: openai_gptoss, as vLLM always reads
    # gpt-oss's replies as harmony); applied when the tokenizer has the parser's markers
    reasoning_parser: str | None = None
    # A sequence classifier (`XForSequenceClassification`, served under `architecture` XForCausalLM's module): its
    # score head replaces the LM head, so the model pools and classifies and never generates. None: a language model.
    classifier: ClassifierHead | None = None

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def for_max_model_len(self, max_model_len: int) -> "ModelSpec":
        """The spec as served for contexts of up to `max_model_len` tokens (LongRoPE's factors,
        `RopeSpec.for_max_model_len`)."""
        return dataclasses.replace(self, rope=self.rope.for_max_model_len(max_model_len))

    def extended(self, cls: type, **fields) -> "ModelSpec":
        """This spec as an instance of the subclass `cls` (an architecture's own spec) with `fields` set: ModelSpec's
        fields taken from this spec unless `fields` gives them."""
        base = {field.name: getattr(self, field.name) for field in dataclasses.fields(ModelSpec)}
        return cls(**{**base, **fields})


def read_hf_config(path: str) -> tuple[dict, dict]:
    """A Hugging Face folder's `config.json` and `generation_config.json` (empty when absent) as dicts."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"no config.json in model folder {path!r}: is this a Hugging Face checkpoint folder?")
    with open(config_path) as f:
        config = json.load(f)
    generation_config = {}
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            generation_config = json.load(f)
    return config, generation_config

# Sequence classifiers whose name is not their language model's with the suffix swapped (transformers' Gemma 3 text
# classifier: its Gemma3ForSequenceClassification is the image-text model's)
_CLASSIFIER_NAMES = {"Gemma3ForCausalLM": "Gemma3TextForSequenceClassification"}


def classifier_architecture(causal: str, per_token: bool = False) -> str:
    """The sequence classifier architecture over a language model architecture XForCausalLM's body:
    XForSequenceClassification (`per_token`: the token classifier's, XForTokenClassification)."""
    if per_token:
        return causal.removesuffix("ForCausalLM") + TOKEN_CLASSIFIER_SUFFIX
    return _CLASSIFIER_NAMES.get(causal, causal.removesuffix("ForCausalLM") + CLASSIFIER_SUFFIX)


def causal_architecture(classifier: str) -> str:
    """The language model architecture whose body a sequence or token classifier architecture has
    (classifier_architecture's inverse); any other name as it is."""
    named = {name: causal for causal, name in _CLASSIFIER_NAMES.items()}
    if classifier in named:
        return named[classifier]
    for suffix in (CLASSIFIER_SUFFIX, TOKEN_CLASSIFIER_SUFFIX):
        if classifier.endswith(suffix):
            return classifier.removesuffix(suffix) + "ForCausalLM"
    return classifier


def llama_family_spec(arch: str, config: dict, generation_config: dict) -> ModelSpec:
    """The spec of a Llama-family config (LLAMA_FAMILY): Llama, Mistral (sliding window), Qwen2 (qkv bias), Qwen3
    (q/k norm); a ValueError for a feature the family's forward does not have."""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config['hidden_act']!r}: only 'silu' is supported")
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    if arch == "LlamaForCausalLM" and config.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported for LlamaForCausalLM")
    num_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    rope = parse_rope(config, head_dim)
    return ModelSpec(
        architecture=arch,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        intermediate_size=config["intermediate_size"],
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope=rope,
        max_position_embeddings=rope.context_length(config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM",
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=_parse_sliding_window(arch, config),
        torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=parse_eos(config, generation_config),
        **checkpoint_quantization_fields(config.get("quantization_config")),
    )


def parse_rope(config: dict, head_dim: int, parameters: dict | None = None) -> RopeSpec:
    """The rotary embedding of `parameters` (default: the config's own), in either transformers 4 (`rope_theta` +
    `rope_scaling`) or 5 (`rope_parameters`) layout."""
    params = dict(config.get("rope_parameters") or {}) if parameters is None else parameters
    scaling = (config.get("rope_scaling") or {}) if parameters is None else {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor {partial} gives {rotary_dim} rotary dims of the head's {head_dim}: "
                         "it must give an even number, at least 2")
    original = params.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    extra = {}  # the rope type's own fields
    if rope_type == "longrope":
        extra = _longrope_fields(config, params, rotary_dim, original)
    elif rope_type == "yarn":
        original = original or config.get("max_position_embeddings")
        extra = _yarn_fields(config, params, original)
    fields = dict(
        theta=float(theta),
        head_dim=head_dim,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original or 8192),
        rotary_dim=rotary_dim if rotary_dim < head_dim else 0,
    )
    return RopeSpec(**{**fields, **extra})


def _context_factor(rope_type: str, config: dict, params: dict, original: int | None) -> float:
    """How far a scaled rope stretches the original context: its `factor`, else max_position_embeddings over
    original_max_position_embeddings (as transformers reads them); a ValueError without an original context."""
    if not original:
        raise ValueError(f"a {rope_type} rope_scaling needs original_max_position_embeddings")
    return params.get("factor") or config.get("max_position_embeddings", original) / original


def _yarn_fields(config: dict, params: dict, original: int | None) -> dict:
    """YaRN's factor, ramp and attention factor, as transformers reads them (the attention factor by default
    0.1 ln(factor) + 1, or DeepSeek's ratio of two such with `mscale` and `mscale_all_dim`)."""
    factor = _context_factor("yarn", config, params, original)

    def mscale(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        scale, all_dims = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(scale) / mscale(all_dims) if scale and all_dims else mscale(1)
    return {"factor": float(factor), "attention_factor": float(attention_factor),
            "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
            "truncate": bool(params.get("truncate", True))}


def _longrope_fields(config: dict, params: dict, rotary_dim: int, original: int | None) -> dict:
    """LongRoPE's short and long factors and attention factor, as transformers reads them (the attention factor by
    default from the ratio of max_position_embeddings to original_max_position_embeddings)."""
    factors = {}
    for name in ("short_factor", "long_factor"):
        values = params.get(name)
        if not isinstance(values, list) or len(values) != rotary_dim // 2:
            raise ValueError(f"a longrope rope_scaling needs {name}: a list of {rotary_dim // 2} numbers (one per "
                             f"pair of rotary dims), got {values!r}")
        factors[name] = tuple(float(value) for value in values)
    factor = _context_factor("longrope", config, params, original)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return {**factors, "attention_factor": float(attention_factor)}


def _parse_sliding_window(arch: str, config: dict) -> int | None:
    """Mistral uses `sliding_window` when set; Qwen only when `use_sliding_window` is true."""
    window = config.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if config.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported for Qwen models")
        return None
    if arch == "LlamaForCausalLM":
        return None
    return int(window) if window else None


def parse_eos(config: dict, generation_config: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json (preferred) or config.json; an int or a list."""
    eos = generation_config.get("eos_token_id", config.get("eos_token_id"))
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)


def checkpoint_quantization_fields(quantization_config: dict | None, mxfp4_experts: bool = False) -> dict:
    """The ModelSpec fields (checkpoint_quantization, checkpoint_weight_block, checkpoint_scale_suffix,
    checkpoint_zero_points, checkpoint_format, checkpoint_act_order) of the quantized checkpoint forms jaxserve
    reads, lm_head left
    alone: 8-bit float linear weights with a scale per output channel, per tensor or per block; 4-bit integer
    weights (compressed-tensors pack-quantized) with a scale per output channel or per group, or asymmetric with a
    scale and a zero point per group, as AutoAWQ's GEMM checkpoints and GPTQ's (AutoGPTQ, GPTQModel: groups of
    consecutive input rows, symmetric or not) also store them; with `mxfp4_experts` (an architecture that reads
    them: gpt-oss), MXFP4 experts (quant_method mxfp4, gpt-oss's release), dequantized at load. "none" without a
    quantization_config; a ValueError naming any other form."""
    if not quantization_config:
        return {"checkpoint_quantization": "none"}
    method = quantization_config.get("quant_method")
    supported = ("jaxserve reads fp8 checkpoints whose linear weights are 8-bit floats with a scale per output "
                 "channel, per tensor or per block (compressed-tensors float-quantized, or quant_method fp8), and int4 "
                 "ones (compressed-tensors pack-quantized, a scale per channel or group, or asymmetric with a zero "
                 "point per group; 16-bit activations: W4A16; or AutoAWQ's GEMM form; or GPTQ's, 4 bits, or 8 bits "
                 "symmetric), and gpt-oss's MXFP4 experts (quant_method mxfp4)")
    if method == "mxfp4":
        if not mxfp4_experts:
            raise ValueError("quantization_config quant_method 'mxfp4' (MXFP4 experts, as openai/gpt-oss's release "
                             "stores them) is read for GptOssForCausalLM only, not for this architecture")
        return {"checkpoint_quantization": "none", "checkpoint_format": "mxfp4"}
    if method == "fp8":
        kept = [name for name in quantization_config.get("modules_to_not_convert") or [] if not _stays_float(name)]
        if kept:
            raise ValueError(f"quant_method fp8 modules_to_not_convert lists layers other than lm_head and the "
                             f"routers ({sorted(kept)[:4]}): {supported}")
        block = quantization_config.get("weight_block_size")
        if not block:
            return {"checkpoint_quantization": "fp8"}
        return {"checkpoint_quantization": "fp8", "checkpoint_weight_block": _block(block, "weight_block_size"),
                "checkpoint_scale_suffix": "_scale_inv"}  # DeepSeek's name; it multiplies the weight all the same
    if method == "awq":
        return _awq_fields(quantization_config, supported)
    if method == "gptq":
        return _gptq_fields(quantization_config, supported)
    if method != "compressed-tensors":
        raise ValueError(f"quantization_config quant_method {method!r} is not supported: {supported}")
    forms = set()  # (quantization, block, zero points) of each group
    for name, group in (quantization_config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        form = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
        if form == ("float", 8, "block"):
            where = f"compressed-tensors group {name!r} block_structure"
            forms.add(("fp8", _block(weights.get("block_structure"), where), False))
        elif form in (("float", 8, "channel"), ("float", 8, "tensor")):
            forms.add(("fp8", None, False))
        elif form in (("int", 4, "group"), ("int", 4, "channel")):
            block = _int4_group(quantization_config, name, group, supported)
            forms.add(("int4", block, not weights.get("symmetric", True)))
        else:
            raise ValueError(f"compressed-tensors group {name!r} has weights {weights}: {supported}")
    ignored = [name for name in quantization_config.get("ignore") or [] if not _stays_float(name)]
    if ignored:
        raise ValueError(f"compressed-tensors ignore lists layers other than lm_head and the routers "
                         f"({sorted(ignored)[:4]}): {supported}")
    if len(forms) > 1:
        raise ValueError(f"compressed-tensors groups mix block sizes or strategies: {supported} with one form")
    quantization, block, zero_points = forms.pop() if forms else ("fp8", None, False)
    return {"checkpoint_quantization": quantization, "checkpoint_weight_block": block,
            "checkpoint_zero_points": zero_points}


def _awq_fields(quantization_config: dict, supported: str) -> dict:
    """The fields of an AutoAWQ checkpoint: 4-bit weights with a scale and a zero point per group of `group_size`
    input rows, in the GEMM layout; a ValueError for its other versions and settings."""
    version = str(quantization_config.get("version", "gemm")).lower()
    size = quantization_config.get("group_size")
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r}: jaxserve reads AutoAWQ's GEMM checkpoints ({supported})")
    if quantization_config.get("bits", quantization_config.get("w_bit", 4)) != 4:
        raise ValueError(f"AWQ bits {quantization_config.get('bits')!r}: jaxserve reads 4-bit AWQ weights")
    if not quantization_config.get("zero_point", True):
        raise ValueError("AWQ zero_point false (symmetric AWQ) is not read: jaxserve reads AWQ with zero points")
    if not _positive_int(size):
        raise ValueError(f"AWQ group_size must be a positive integer, got {size!r}")
    kept = [name for name in quantization_config.get("modules_to_not_convert") or [] if not _stays_float(name)]
    if kept:
        raise ValueError(f"AWQ modules_to_not_convert lists layers other than lm_head and the routers "
                         f"({sorted(kept)[:4]}): {supported}")
    return {"checkpoint_quantization": "int4", "checkpoint_weight_block": (1, size), "checkpoint_zero_points": True,
            "checkpoint_format": "awq"}


def _gptq_fields(quantization_config: dict, supported: str) -> dict:
    """The fields of a GPTQ checkpoint (AutoGPTQ's and GPTQModel's `checkpoint_format` "gptq"): 4-bit weights with
    a scale per group of `group_size` input rows (-1: per output channel) and, unless `sym`, a zero point per group,
    or symmetric 8-bit ones, the rows in any group under act-order (`desc_act` without `static_groups`: each
    weight's `g_idx` says which); a ValueError for its other settings. Without act-order the groups must be
    consecutive rows, which is checked as each weight loads."""
    size = quantization_config.get("group_size")
    symmetric = quantization_config.get("sym", True)
    bits = quantization_config.get("bits")
    if bits not in (4, 8):
        raise ValueError(f"GPTQ bits {bits!r}: jaxserve reads 4-bit and 8-bit GPTQ weights")
    if bits == 8 and not symmetric:
        raise ValueError(f"GPTQ bits 8 with sym false (8-bit zero points) is not read: {supported}")
    if quantization_config.get("checkpoint_format", "gptq") != "gptq":
        raise ValueError(f"GPTQ checkpoint_format {quantization_config['checkpoint_format']!r}: jaxserve reads "
                         "the \"gptq\" format (zero points stored less one), which GPTQModel saves by default")
    if size != -1 and not _positive_int(size):
        raise ValueError(f"GPTQ group_size must be a positive integer or -1 (per channel), got {size!r}")
    if size == -1 and not symmetric:
        raise ValueError(f"GPTQ sym false with group_size -1 (a zero point per channel): {supported}")
    if quantization_config.get("lm_head"):
        raise ValueError("GPTQ lm_head true (a quantized LM head): jaxserve serves the LM head in float")
    if quantization_config.get("dynamic"):
        raise ValueError(f"GPTQ dynamic (per-module settings) is not read: {supported} with one form")
    kept = [name for name in quantization_config.get("modules_to_not_convert") or [] if not _stays_float(name)]
    if kept:
        raise ValueError(f"GPTQ modules_to_not_convert lists layers other than lm_head and the routers "
                         f"({sorted(kept)[:4]}): {supported}")
    act_order = bool(quantization_config.get("desc_act")) and not quantization_config.get("static_groups") \
        and size != -1  # (one group per channel: every row in it, whatever the order)
    return {"checkpoint_quantization": f"int{bits}", "checkpoint_weight_block": None if size == -1 else (1, size),
            "checkpoint_zero_points": not symmetric, "checkpoint_format": "gptq",
            "checkpoint_act_order": act_order}


def _int4_group(quantization_config: dict, name: str, group: dict, supported: str) -> tuple[int, int] | None:
    """The block (1, group_size) of a compressed-tensors int4 group (None: one scale per output channel); a
    ValueError for the int4 forms jaxserve does not read."""
    weights = group.get("weights") or {}
    if quantization_config.get("format") != "pack-quantized":
        raise ValueError(f"compressed-tensors int4 weights in format {quantization_config.get('format')!r}: "
                         f"{supported}")
    if not weights.get("symmetric", True) and weights.get("strategy") != "group":
        raise ValueError(f"compressed-tensors group {name!r} is asymmetric (zero points) per channel: {supported}")
    if group.get("input_activations"):
        raise ValueError(f"compressed-tensors group {name!r} quantizes the activations too: {supported}")
    if weights.get("strategy") == "channel":
        return None
    size = weights.get("group_size")
    if not _positive_int(size):
        raise ValueError(f"compressed-tensors group {name!r} group_size must be a positive integer, got {size!r}")
    return 1, size


def _stays_float(module: str) -> bool:
    """Whether a module a quantized checkpoint leaves unquantized is one jaxserve serves in float anyway: the LM
    head, a mixture of experts' router (by name, or a `re:` pattern ending in `mlp.gate$`)."""
    return module == "lm_head" or module.endswith(("mlp.gate", "mlp.gate$"))


def _block(value, where: str) -> tuple[int, int]:
    """A (rows, columns) block size from a checkpoint's config; a ValueError unless two positive ints."""
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(map(_positive_int, value))):
        raise ValueError(f"quantization_config {where} must be two positive integers [rows, columns], got {value!r}")
    return int(value[0]), int(value[1])


def _positive_int(value) -> bool:
    """Whether a config value is an int >= 1 (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


