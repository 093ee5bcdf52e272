"""The model interface and registry: what the engine needs from an architecture, by Hugging Face name.

An architecture is a `Model`: how it reads its `config.json` into a `ModelSpec`, the params leaves it declares
(`Weight`: the checkpoint tensor each comes from, its shape, its partition spec over the `model` mesh axis and
how it is stored), and its Flax NNX module, built over the loaded params tree, whose forward runs over a
`BatchDescriptor` with the attention backend injected (model/layers.py's `StepContext`) and whose `logits` is its
LM head. The loader, the random weights of
`load_format: dummy`, orbax restores and `jaxserve check-config` all work from the declarations, so they stay
generic. `register` makes an architecture servable under its `config.json` `architectures` names; the built-in
ones (BUILTIN_MODULES) and those of installed plugins (the `jaxserve.models` entry points) register when their
module is imported, on the registry's first lookup.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from collections.abc import Callable

import jax
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.attention.base import AttentionFn, WriteKVFn
from jaxserve.batch.descriptor import BatchDescriptor
from jaxserve.model.layers import StepContext
from jaxserve.model_spec import (
    CLASSIFIER_SUFFIX,
    TOKEN_CLASSIFIER_SUFFIX,
    ModelSpec,
    causal_architecture,
    classifier_architecture,
    classifier_head,
    read_hf_config,
)


@dataclasses.dataclass(frozen=True)
class Weight:
    """One params leaf: its Hugging Face tensor, shape, sharding and storage."""

    hf_name: str  # the checkpoint tensor's name; "{i}" in a per-layer name (the leaf stacks the layers), and "{j}"
    # in a per-expert one (the layer's slice (E, ...) stacks the experts)
    shape: tuple[int, ...]  # the leaf's shape: (L, ...) for a per-layer leaf
    spec: P  # how the leaf is split over the `model` mesh axis
    transpose: bool = False  # a Linear weight: the checkpoint's (out, in) stored as (in, out)
    kv_heads: bool = False  # the last axis holds KV heads: each repeated when tensor parallelism exceeds them
    ones: bool = False  # random weights (load_format dummy) start at 1 (a norm), not N(0, 0.02^2)
    quantizable: bool = False  # a per-layer projection `quantization` stores as {weight, scale} (model/quantize.py)
    first_layer: int = 0  # a per-layer leaf stacks the checkpoint's layers first_layer .. first_layer + shape[0] - 1

    @property
    def per_layer(self) -> bool:
        """Whether the leaf stacks one checkpoint tensor per layer."""
        return "{i}" in self.hf_name

    def layer_names(self, layer: int) -> str | list[str]:
        """The checkpoint tensor of the leaf's `layer`-th layer (of a per-layer leaf), or one per expert (shape[1]
        of them)."""
        layer += self.first_layer
        if "{j}" in self.hf_name:
            return [self.hf_name.format(i=layer, j=expert) for expert in range(self.shape[1])]
        return self.hf_name.format(i=layer)


@dataclasses.dataclass(frozen=True)
class Model:
    """An architecture as the engine uses it."""

    # (architecture name, config.json, generation_config.json) -> ModelSpec; a ValueError for what it cannot serve
    spec_from_config: Callable[[str, dict, dict], ModelSpec]
    # (spec, KV heads held per layer, tensor parallel size) -> the params tree of `Weight`s
    weights: Callable[[ModelSpec, int, int], dict]
    # the Flax NNX module: module(params, spec) over the params tree (model/layers.py), with
    # __call__(caches, StepContext) -> (logits (R, V) float32, hidden (T, H), caches),
    # logits(hidden (N, H)) -> (N, V) float32, (for pooling) final_states(hidden (N, H)) -> (N, H) and (for EAGLE-3
    # targets) tapped(caches, StepContext, layers) -> __call__'s and the layers' inputs (T, len(layers) * H)
    module: type
    # the module adds LoRA adapters' products (params["layers"]["lora"], model/lora.py) to its dense projections
    lora: bool = False
    # its layers read an fp8 KV cache's scales (params["layers"]'s k_scale, v_scale: one stack of every layer)
    fp8_kv_cache: bool = True
    # its body is served under a score head too (XForSequenceClassification, XForTokenClassification)
    classifiers: bool = True
    # projections the checkpoint stores fused (Phi-3's qkv_proj, gate_up_proj), read apart (model/loader.py's
    # FusedRows): spec -> {a declared tensor's module suffix: (the fused module's suffix, first row, rows)}
    fused: Callable[[ModelSpec], dict[str, tuple[str, int, int]]] | None = None

    def fused_parts(self, spec: ModelSpec) -> dict[str, tuple[str, int, int]]:
        """The projections `spec`'s checkpoint stores fused (`fused`'s map; empty when none are)."""
        return self.fused(spec) if self.fused else {}

    def make_forward(self, spec: ModelSpec, attention: AttentionFn, write_kv: WriteKVFn, mesh: Mesh,
                     tap_layers: tuple[int, ...] = ()) -> Callable:
        """forward(params, caches, batch) -> (logits (R, V) float32, hidden (T, H), caches) with the attention
        backend and the mesh bound: the step's page copies (copy-on-write), then the module. With `tap_layers`
        (EAGLE-3's), also the inputs of those layers (T, len(tap_layers) * H): the module's `tapped`."""

        def forward(params: dict, caches: tuple[jax.Array, ...], batch: BatchDescriptor):
            caches = copy_pages(caches, batch.copy_src, batch.copy_dst)
            module, step = self.module(params, spec), StepContext(batch, attention, write_kv, mesh)
            return module.tapped(caches, step, tap_layers) if tap_layers else module(caches, step)

        return forward

    def token_logits(self, params: dict, hidden: jax.Array, spec: ModelSpec) -> jax.Array:
        """The LM head's logits (N, V) float32 over some tokens' last hidden states (N, H)."""
        return self.module(params, spec).logits(hidden)

    def final_states(self, params: dict, hidden: jax.Array, spec: ModelSpec) -> jax.Array:
        """The final hidden states (N, H) (after the final norm: Hugging Face's `last_hidden_state`) of some tokens'
        last layer outputs (N, H): what pooling (embeddings) reads."""
        return self.module(params, spec).final_states(hidden)


def copy_pages(caches: tuple[jax.Array, ...], src: jax.Array, dst: jax.Array) -> tuple[jax.Array, ...]:
    """Copy whole pages (every layer) before the step writes: copy-on-write of shared pages. Padding
    copies the null page onto itself."""
    # caches: each (L, P, S, heads, D); src, dst: (C,) int32
    return tuple(cache.at[:, dst].set(cache[:, src]) for cache in caches)


_MODELS: dict[str, Model] = {}
# imported on the first lookup (they import this module)
BUILTIN_MODULES = ("jaxserve.model.llama", "jaxserve.model.gemma", "jaxserve.model.moe_llama", "jaxserve.model.phi3",
                   "jaxserve.model.granite", "jaxserve.model.olmo2", "jaxserve.model.gpt_oss",
                   "jaxserve.model.deepseek")
PLUGIN_GROUP = "jaxserve.models"  # entry points (module names) of installed packages that register architectures


def register(architectures: tuple[str, ...], model: Model) -> None:
    """Serve `model` for each Hugging Face architecture name in `architectures`."""
    for name in architectures:
        _MODELS[name] = model


def registered_architectures() -> tuple[str, ...]:
    """Every architecture name a model is registered for, sorted: each XForCausalLM's sequence and token
    classifiers (XForSequenceClassification, XForTokenClassification: its body under a score head,
    ModelSpec.classifier) among them."""
    _import_builtins()
    classifiers = [classifier_architecture(name, per_token) for name, model in _MODELS.items()
                   if name.endswith("ForCausalLM") and model.classifiers for per_token in (False, True)]
    return tuple(sorted([*_MODELS, *classifiers]))


def model_for(architecture: str) -> Model:
    """The model registered for `architecture` (a sequence or token classifier's: its language model's); a
    ValueError listing the registered ones."""
    _import_builtins()
    body = causal_architecture(architecture)
    if body not in _MODELS or (body != architecture and not _MODELS[body].classifiers):
        raise ValueError(f"unsupported architecture {architecture!r}; registered: "
                         f"{', '.join(registered_architectures())}")
    return _MODELS[body]


def load_model_spec(path: str) -> ModelSpec:
    """The spec of a Hugging Face folder: its `config.json` (and `generation_config.json` for EOS ids)."""
    return spec_from_hf_config(*read_hf_config(path))


def spec_from_hf_config(config: dict, generation_config: dict | None = None) -> ModelSpec:
    """A spec from a Hugging Face config dict, by the parser of the first architecture it names that a model is
    registered for; a clear ValueError when there is none, or for anything else unsupported."""
    architectures = config.get("architectures") or []
    registered = registered_architectures()
    arch = next((a for a in architectures if a in registered), None)
    if arch is None:
        raise ValueError(f"unsupported architecture {architectures!r}; registered: {', '.join(registered)}")
    if not arch.endswith((CLASSIFIER_SUFFIX, TOKEN_CLASSIFIER_SUFFIX)):
        return model_for(arch).spec_from_config(arch, config, generation_config or {})
    causal = causal_architecture(arch)  # the classifier's body is this language model's
    spec = model_for(causal).spec_from_config(causal, config, generation_config or {})
    return dataclasses.replace(spec, classifier=classifier_head(config, arch.endswith(TOKEN_CLASSIFIER_SUFFIX)))


def _import_builtins() -> None:
    """Import the built-in architectures' modules and those installed packages name under the `jaxserve.models`
    entry-point group (PLUGIN_GROUP), which register themselves (once: Python caches modules)."""
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    for entry_point in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        entry_point.load()


def map_weights(function: Callable[[str, Weight], object], weights: dict) -> dict:
    """{name: function(name, weight)} for every `Weight` of a declaration tree, in the same tree, called in the
    declaration's order."""
    return map_weights_with(lambda name, weight, _: function(name, weight), weights, {})


def map_weights_with(function: Callable[[str, Weight, object], object], weights: dict, current: dict) -> dict:
    """map_weights with, for each `Weight`, the leaf at its place in the tree `current` (None where it has none)."""
    return {name: map_weights_with(function, node, current.get(name) or {}) if isinstance(node, dict)
            else function(name, node, current.get(name)) for name, node in weights.items()}


def quantizable_paths(spec: ModelSpec) -> tuple[tuple[str, ...], ...]:
    """The params paths (model/quantize.py's LeafPath: ("layers", "wq")) of the leaves of `spec`'s architecture that
    weight quantization applies to, in every stack of layers it has."""
    found = []

    def visit(path: tuple[str, ...], node: dict) -> None:
        for name, child in node.items():
            if isinstance(child, dict):
                visit((*path, name), child)
            elif child.quantizable:
                found.append((*path, name))

    visit((), model_for(spec.architecture).weights(spec, spec.num_kv_heads, 1))
    return tuple(found)


def param_partition_specs(spec: ModelSpec, num_cache_kv_heads: int, tensor_parallel_size: int) -> dict:
    """The PartitionSpec of every params leaf of `spec`'s architecture (the params' tree)."""
    weights = model_for(spec.architecture).weights(spec, num_cache_kv_heads, tensor_parallel_size)
    return map_weights(lambda _, weight: weight.spec, weights)
