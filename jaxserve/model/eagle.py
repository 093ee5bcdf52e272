"""EAGLE draft heads: one Llama decoder layer over the target's own features. EAGLE-1 (speculative_config method
"eagle"; e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B) and EAGLE-3 (method "eagle3"; e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B),
in the forms vLLM reads.

EAGLE-1.

At a position p the head takes the token that follows p (x_{p+1}) and the target's FEATURE at p, its final hidden
state after the final norm: h = fc(concat(embed(x_{p+1}), feature_p)) (+ fc.bias when the head has one, as EAGLE's
own model does), then the Llama layer without a norm before its attention (EAGLE-1's first layer has none), and the
target's LM head over its output (no final norm) predicts x_{p+2}. Proposing further, the head's own output at a
position stands in for the target's feature there.

The head's folder: a Llama config.json (one layer) and tensors named without "model.": fc.weight (H, 2H), fc.bias,
layers.0.{self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}.weight, embed_tokens.weight
(when it has none, a copy of the target's embedding is used).

Params:
    embed (V, H)   fc (2H, H)   fc_bias (H,) optional   layers/...: the Llama layer's without input_norm (L = 1)
and, given at each call, the target's LM head `lm_head` (H, V) (its embedding's transpose when tied).

EAGLE-3. A target's FEATURE at p is the inputs of three of its layers there side by side, in layer order (3H;
`TargetFeatures`): the head combines it, g = fc(feature_p), takes the embedding e of x_{p+1}, and runs one layer
whose attention reads concat(input_norm(e), hidden_norm(g)) (2H wide) with g as the residual; its own final norm
and LM head over a draft vocabulary (the `d2t` offsets map a draft id d to the target's d + d2t[d]) predict x_{p+2}.
Proposing further, the layer's output (before the final norm) stands in for g. The folder (SpecForge's and EAGLE's
own form): a config `LlamaForCausalLMEagle3` (one layer; `draft_vocab_size`; the target's layers
`eagle_aux_hidden_state_layer_ids`, else vLLM's (2, L // 2, L - 3) of the target's L) and tensors fc.weight (H, 3H),
midlayer.{input_layernorm, hidden_norm, post_attention_layernorm, self_attn.{q,k,v}_proj (2H in), self_attn.o_proj,
mlp.*}.weight (or layers.0.*), norm.weight, lm_head.weight, d2t, embed_tokens.weight optional. A head in the
speculators format (vllm-project/speculators; `speculators_model_type: "eagle3"`, its layer's config under
`transformer_layer_config`, tensors `layers.0.*`) is read as vLLM reads it; with `norm_before_residual` (that
format's default in vLLM) the layer's residual is hidden_norm(g), not g.

Params:
    embed (V, H)   fc (3H, H)   final_norm (H,)   lm_head (H, V_draft)   draft_tokens (V_draft,) int32 target ids
    layers/...: the Llama layer's with wq, wk, wv (1, 2H, heads * D), and hidden_norm (1, H)
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.attention.base import AttentionFn, WriteKVFn
from jaxserve.batch.descriptor import BatchDescriptor
from jaxserve.model import llama
from jaxserve.model.layers import StepContext, optional_param, rope_cos_sin, scan_layers
from jaxserve.model.registry import Weight, copy_pages, model_for, spec_from_hf_config
from jaxserve.model_spec import ModelSpec

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # an EAGLE-3 head's config names these
# a speculators head's options that change its math and are not implemented (newer speculators releases' norms)
SPECULATORS_UNSUPPORTED = ("norm_before_fc", "fc_norm", "norm_output")


@dataclasses.dataclass(frozen=True)
class Eagle3Spec(ModelSpec):
    """An EAGLE-3 head's layer, and where its residual comes from."""

    norm_before_residual: bool = False  # the residual is the normed hidden state (speculators' heads), not the raw


@dataclasses.dataclass(frozen=True)
class TargetFeatures:
    """What the target keeps of each computed token for an EAGLE head: its final hidden state after the final norm
    (EAGLE-1: `layers` empty), or the inputs of `layers` (ascending) side by side (EAGLE-3)."""

    hidden_size: int
    layers: tuple[int, ...] = ()

    @property
    def width(self) -> int:
        """A token's feature width."""
        return self.hidden_size * max(1, len(self.layers))


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """An EAGLE head's folder as the engine reads it."""

    spec: ModelSpec  # its layer's (a one-layer LlamaForCausalLM)
    version: int  # 1 or 3
    features: TargetFeatures  # what the target keeps for it
    draft_vocab_size: int  # the vocabulary of its LM head (EAGLE-1's is the target's)


def read_head_config(path: str, method: str, target_spec: ModelSpec) -> HeadConfig:
    """The head that speculative_config method `method` ("eagle" or "eagle3") names at `path`, for `target_spec`'s
    model; a ValueError saying what does not fit."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"no config.json in the EAGLE head folder {path!r}")
    with open(config_path) as f:
        config = json.load(f)
    if "speculators_model_type" in config:
        config = speculators_config(config, path)
    version = 3 if set(config.get("architectures") or ()) & set(EAGLE3_ARCHITECTURES) else 1
    if version != (3 if method == "eagle3" else 1):
        other = "eagle3" if version == 3 else "eagle"
        raise ValueError(f"{path!r} is an EAGLE-{version} head: use speculative_config method {other}")
    if version == 3:
        config = {**config, "architectures": ["LlamaForCausalLM"]}  # its layer is a Llama layer's
    spec = spec_from_hf_config(config)
    if spec.architecture != "LlamaForCausalLM" or spec.num_layers != 1:
        raise ValueError(f"the EAGLE head {path!r} must be a one-layer Llama head, got {spec.architecture} with "
                         f"{spec.num_layers} layers")
    target_hidden = config.get("target_hidden_size", spec.hidden_size)
    if (spec.hidden_size, target_hidden, spec.vocab_size) != (target_spec.hidden_size,) * 2 + (
            target_spec.vocab_size,):
        raise ValueError(f"the EAGLE head {path!r} has hidden_size {spec.hidden_size} (for a target's "
                         f"{target_hidden}) and vocab_size {spec.vocab_size}; the target has "
                         f"{target_spec.hidden_size} and {target_spec.vocab_size}: a head is trained for one target")
    if version == 1:
        return HeadConfig(spec, 1, TargetFeatures(spec.hidden_size), spec.vocab_size)
    if not (config.get("eagle_config") or {}).get("use_aux_hidden_state", True):
        raise ValueError(f"the EAGLE-3 head {path!r} sets use_aux_hidden_state false: such heads are not supported")
    if not hasattr(model_for(target_spec.architecture).module, "tapped"):
        raise ValueError(f"{target_spec.architecture} does not give its layers' hidden states: EAGLE-3 cannot "
                         f"serve it")
    num_layers = target_spec.num_layers
    # the target's layers whose inputs the head reads: taken in the target's layer order, as vLLM collects them
    layers = config.get("eagle_aux_hidden_state_layer_ids") or (2, num_layers // 2, num_layers - 3)
    if not all(isinstance(layer, int) and 0 <= layer < num_layers for layer in layers) or len(set(layers)) != 3:
        raise ValueError(f"the EAGLE-3 head {path!r} reads the inputs of the target's layers {list(layers)}: it "
                         f"needs three distinct layers of the target's {num_layers} (set "
                         f"eagle_aux_hidden_state_layer_ids in its config.json)")
    draft_vocab_size = config.get("draft_vocab_size") or spec.vocab_size
    if not 0 < draft_vocab_size <= spec.vocab_size:
        raise ValueError(f"the EAGLE-3 head {path!r} has draft_vocab_size {draft_vocab_size}: at most the target's "
                         f"{spec.vocab_size}")
    spec = spec.extended(Eagle3Spec, norm_before_residual=bool(config.get("norm_before_residual", False)))
    return HeadConfig(spec, 3, TargetFeatures(spec.hidden_size, tuple(sorted(layers))), draft_vocab_size)


def speculators_config(config: dict, path: str) -> dict:
    """A head in the speculators format (vllm-project/speculators' `speculators_model_type`, RedHatAI's
    *.speculator.eagle3 heads) as an EAGLE-3 head's config, as vLLM reads it: its layer's config
    (`transformer_layer_config`, filled in with transformers' Llama defaults, which speculators leaves out) with
    the head's own fields; `norm_before_residual` true unless the head says otherwise (vLLM's default). A
    ValueError for what the head does not implement."""
    kind = config["speculators_model_type"]
    if kind != "eagle3":
        raise ValueError(f"{path!r} is a speculators {kind!r} head: only eagle3 heads are served")
    refused = [name for name in SPECULATORS_UNSUPPORTED if config.get(name)]
    if refused:
        raise ValueError(f"the EAGLE-3 head {path!r} sets {', '.join(refused)}: such heads are not supported")
    layer = dict(config.get("transformer_layer_config") or {})
    if layer.get("model_type", "llama") != "llama":
        raise ValueError(f"the EAGLE-3 head {path!r} has a {layer['model_type']} layer: only Llama layers are served")
    from transformers import LlamaConfig

    head = {name: config[name] for name in ("draft_vocab_size", "target_hidden_size",
                                            "eagle_aux_hidden_state_layer_ids") if config.get(name) is not None}
    return {**LlamaConfig(**layer).to_dict(), **head, "architectures": [EAGLE3_ARCHITECTURES[0]],
            "norm_before_residual": config.get("norm_before_residual", True)}


def eagle_weights(spec: ModelSpec, num_cache_kv_heads: int, tensor_parallel_size: int, has_embed: bool,
                  has_bias: bool) -> dict:
    """Every params leaf of an EAGLE-1 head (the module docstring's) with its tensor in the head's folder: the
    Llama layer's (split as the Llama family's), fc and its bias whole, the embedding when the head has one."""
    tree = llama.weights(spec, num_cache_kv_heads, tensor_parallel_size)
    layers = {name: dataclasses.replace(weight, hf_name=weight.hf_name.removeprefix("model."), quantizable=False)
              for name, weight in tree["layers"].items() if name != "input_norm"}
    hidden = spec.hidden_size
    declared = {"fc": Weight("fc.weight", (2 * hidden, hidden), P(None, None), transpose=True), "layers": layers}
    if has_bias:
        declared["fc_bias"] = Weight("fc.bias", (hidden,), P(None))
    if has_embed:
        declared["embed"] = Weight("embed_tokens.weight", (spec.vocab_size, hidden), P(None, None))
    return declared


class EagleLayer(llama.LlamaLayer):
    """The Llama layer without a norm before its attention."""

    def __call__(self, x: jax.Array, caches: tuple[jax.Array, ...], layer: jax.Array, rope: tuple[jax.Array, ...],
                 step: StepContext) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """The layer over the step's tokens: (x, caches) after it."""
        # x: (T, H); rope: cos, sin (T, rotary dims // 2) each
        attn, caches = self.self_attention(x, caches, layer, rope, step)  # (T, H)
        x = x + attn
        return x + self.feed_forward(self.norm(x, self.post_norm), step), caches  # (T, H)


class EagleHead(nnx.Module):
    """An EAGLE-1 head over the params tree (the module docstring's, `lm_head` included)."""

    def __init__(self, params: dict, spec: ModelSpec):
        self.spec = spec
        self.embed, self.fc, self.lm_head = (nnx.Param(params[name]) for name in ("embed", "fc", "lm_head"))
        self.fc_bias = optional_param(params, "fc_bias")
        self.layers = EagleLayer(params["layers"], spec)

    def __call__(self, caches: tuple[jax.Array, ...], step: StepContext, features: jax.Array
                 ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
        """One step over the padded batch, each token with the feature of its position: (logits (R, V) float32 of
        each row's last token, every token's output (T, H), caches)."""
        # features: (T, H)
        batch, rope_spec = step.batch, self.spec.rope
        embeddings = self.embed[...][batch.input_ids]  # (T, H)
        x = jnp.concatenate([embeddings, features.astype(embeddings.dtype)], axis=-1) @ self.fc[...]  # (T, H)
        if self.fc_bias is not None:
            x = x + self.fc_bias[...]
        rope = rope_cos_sin(batch.positions, rope_spec.inv_freq(), rope_spec.attention_factor)

        def layer_step(layer: EagleLayer, carry, index):
            return layer(*carry, index, rope, step)

        x, caches = scan_layers(self.layers, (x, caches), layer_step)
        logits = jnp.dot(x[batch.logits_indices], self.lm_head[...], preferred_element_type=jnp.float32)  # (R, V)
        return logits, x, caches




def eagle3_weights(spec: ModelSpec, num_cache_kv_heads: int, tensor_parallel_size: int, has_embed: bool,
                   draft_vocab_size: int) -> dict:
    """Every params leaf of an EAGLE-3 head but `draft_tokens` (read apart: model/eagle.py's docstring), with its
    tensor in the head's folder (its layer's as `layers.0.*`: SpecForge's `midlayer.*` read through
    `MidlayerNames`)."""
    hidden = spec.hidden_size
    layers = {name: dataclasses.replace(weight, hf_name=weight.hf_name.removeprefix("model."), quantizable=False)
              for name, weight in llama.weights(spec, num_cache_kv_heads, tensor_parallel_size)["layers"].items()}
    for name in ("wq", "wk", "wv"):  # the attention reads the embedding and the hidden state side by side
        layers[name] = dataclasses.replace(layers[name], shape=(1, 2 * hidden, layers[name].shape[-1]))
    layers["hidden_norm"] = Weight("layers.{i}.hidden_norm.weight", (1, hidden), P(None, None), ones=True)
    declared = {"fc": Weight("fc.weight", (3 * hidden, hidden), P(None, None), transpose=True), "layers": layers,
                "final_norm": Weight("norm.weight", (hidden,), P(None), ones=True),
                "lm_head": Weight("lm_head.weight", (hidden, draft_vocab_size), P(None, None), transpose=True)}
    if has_embed:
        declared["embed"] = Weight("embed_tokens.weight", (spec.vocab_size, hidden), P(None, None))
    return declared


class MidlayerNames:
    """A view of an EAGLE-3 head's tensors in which `layers.0.X` reads SpecForge's and EAGLE's `midlayer.X`."""

    def __init__(self, source):
        self.source = source

    def _stored(self, name: str) -> str:
        """The stored tensor `name` reads."""
        if name.startswith("layers.0.") and name not in self.source:
            return "midlayer." + name.removeprefix("layers.0.")
        return name

    def __contains__(self, name: str) -> bool:
        return self._stored(name) in self.source

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape."""
        return self.source.shape(self._stored(name))

    def get(self, name: str, index: tuple[slice, ...] | None = None):
        """One tensor, or only its `index` part."""
        return self.source.get(self._stored(name), index)


class Eagle3Layer(llama.LlamaLayer):
    """EAGLE-3's layer: attention over the normed embedding and normed hidden state side by side, the hidden state
    its residual (the normed one under `norm_before_residual`)."""

    def __init__(self, params: dict, spec: ModelSpec):
        super().__init__(params, spec)
        self.hidden_norm = nnx.Param(params["hidden_norm"])

    def __call__(self, x: jax.Array, caches: tuple[jax.Array, ...], layer: jax.Array, rope: tuple[jax.Array, ...],
                 step: StepContext, embeddings: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """The layer over the step's tokens (x: each one's hidden state; embeddings: its token's): (x, caches)
        after it."""
        # x, embeddings: (T, H); rope: cos, sin (T, rotary dims // 2) each
        hidden = self.norm(x, self.hidden_norm)  # (T, H)
        both = jnp.concatenate([self.norm(embeddings, self.input_norm), hidden], axis=-1)  # (T, 2H)
        attn, caches = self.self_attention(both, caches, layer, rope, step)  # (T, H)
        x = (hidden if self.spec.norm_before_residual else x) + attn
        return x + self.feed_forward(self.norm(x, self.post_norm), step), caches  # (T, H)


class Eagle3Head(nnx.Module):
    """An EAGLE-3 head over the params tree (the module docstring's)."""

    def __init__(self, params: dict, spec: ModelSpec):
        self.spec = spec
        self.embed, self.fc, self.final_norm, self.lm_head = (
            nnx.Param(params[name]) for name in ("embed", "fc", "final_norm", "lm_head"))
        self.draft_tokens = optional_param(params, "draft_tokens")  # absent: the draft vocabulary is the target's
        self.layers = Eagle3Layer(params["layers"], spec)

    def __call__(self, caches: tuple[jax.Array, ...], step: StepContext, features: jax.Array
                 ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
        """One step over the padded batch, each token with the target's feature of its position (3H wide, combined
        by fc) or the head's own output (H wide): (logits (R, V) float32 of each row's last token over the
        target's vocabulary (-inf outside the draft's), every token's output before the final norm (T, H),
        caches)."""
        # features: (T, 3H) or (T, H)
        batch, rope_spec = step.batch, self.spec.rope
        embeddings = self.embed[...][batch.input_ids]  # (T, H)
        x = features.astype(embeddings.dtype)
        if x.shape[-1] != embeddings.shape[-1]:
            x = x @ self.fc[...]  # (T, H)
        rope = rope_cos_sin(batch.positions, rope_spec.inv_freq(), rope_spec.attention_factor)

        def layer_step(layer: Eagle3Layer, carry, index):
            return layer(*carry, index, rope, step, embeddings)

        x, caches = scan_layers(self.layers, (x, caches), layer_step)
        normed = self.layers.norm(x[batch.logits_indices], self.final_norm)  # (R, H)
        logits = jnp.dot(normed, self.lm_head[...], preferred_element_type=jnp.float32)  # (R, V_draft)
        if self.draft_tokens is not None:  # onto the target's vocabulary
            full = jnp.full((logits.shape[0], self.spec.vocab_size), -jnp.inf, jnp.float32)  # (R, V)
            logits = full.at[:, self.draft_tokens[...]].set(logits)
        return logits, x, caches


def eagle_forward(version: int, spec: ModelSpec, attention: AttentionFn, write_kv: WriteKVFn, mesh: Mesh
                  ) -> Callable:
    """forward(params, caches, batch, features (T, F)) -> (logits (R, V) float32, outputs (T, H), caches) of an
    EAGLE-`version` head, the step's page copies made first."""
    head = Eagle3Head if version == 3 else EagleHead

    def forward(params: dict, caches: tuple[jax.Array, ...], batch: BatchDescriptor, features: jax.Array):
        caches = copy_pages(caches, batch.copy_src, batch.copy_dst)
        return head(params, spec)(caches, StepContext(batch, attention, write_kv, mesh), features)

    return forward
