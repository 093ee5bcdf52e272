"""The model interface and registry (issue 17, first part): jaxserve/model/registry.py.

Architectures are looked up by their Hugging Face name; an unknown one is refused with the registered names; a
model registered under a new name is served without any engine change; every weight a model declares is in its
checkpoint with the declared shape, and the loader builds exactly the declared tree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

from helpers import ARCHITECTURES, checkpoint, expected, small_engine_args
from jaxserve import LLM, SamplingParams
from jaxserve.model import registry
from jaxserve.model.loader import load_params, tensor_source
from jaxserve.model.registry import (
    Weight, map_weights, model_for, quantizable_paths, registered_architectures,
)
from jaxserve.sharding import cache_kv_heads, make_mesh
from jaxserve.model_spec import LLAMA_FAMILY
from jaxserve.model.registry import load_model_spec


def test_the_llama_family_is_registered_and_an_unknown_architecture_is_refused():
    assert set(LLAMA_FAMILY) <= set(registered_architectures())
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'; registered: "
                                         "DeepseekV3ForCausalLM, Gemma2ForCausalLM, "
                                         "Gemma2ForSequenceClassification, Gemma2ForTokenClassification, "
                                         "Gemma3ForCausalLM"):
        model_for("GPT2LMHeadModel")
    for head in ("GPT2ForSequenceClassification", "GPT2ForTokenClassification"):
        with pytest.raises(ValueError, match=f"unsupported architecture '{head}'; registered:"):
            model_for(head)
    # weight quantization takes the leaves the model declares quantizable: the seven projections
    projections = {("layers", name) for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
    assert set(quantizable_paths(load_model_spec(checkpoint("qwen2")))) == projections
    # a mixture of experts: the experts (L, E, in, out) too, never the router
    assert set(quantizable_paths(load_model_spec(checkpoint("mixtral")))) == projections
    assert "router" in model_for("MixtralForCausalLM").weights(
        load_model_spec(checkpoint("mixtral")), 2, 1)["layers"]


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.parametrize("tp", [1, 2])
def test_every_declared_weight_is_in_the_checkpoint_and_loads_as_declared(name, tp):
    spec = load_model_spec(checkpoint(name))
    kv_heads = cache_kv_heads(spec, tp)
    declared = model_for(spec.architecture).weights(spec, kv_heads, tp)
    folder = tensor_source(checkpoint(name), spec)  # as the loader reads it (Phi-3's fused parts apart)
    for weight in jax.tree_util.tree_leaves(declared, is_leaf=lambda node: isinstance(node, Weight)):
        first = weight.layer_names(0) if weight.per_layer else weight.hf_name
        stored = folder.shape(first[0] if isinstance(first, list) else first)
        want = weight.shape[1:] if weight.per_layer else weight.shape
        if isinstance(first, list):  # one tensor per expert
            assert len(first) == want[0] and all(folder.shape(name) == stored for name in first)
            want = want[1:]
        if weight.transpose:
            stored = stored[::-1]
        repeat = kv_heads // spec.num_kv_heads if weight.kv_heads else 1
        assert (*stored[:-1], stored[-1] * repeat) == want, weight
    params = load_params(checkpoint(name), spec, make_mesh(tp), np.float32, kv_heads)
    shapes = map_weights(lambda _, weight: weight.shape, declared)
    assert jax.tree_util.tree_map(lambda leaf: leaf.shape, params) == shapes
    specs = map_weights(lambda _, weight: weight.spec, declared)
    assert jax.tree_util.tree_map(lambda leaf: leaf.sharding.spec, params) == specs


def test_a_model_registered_under_a_new_name_is_served_without_an_engine_change(tmp_path, monkeypatch):
    """A copy of the llama checkpoint that calls itself MyLlamaForCausalLM, served by a model registered under
    that name (the Llama family's functions, its forward counted): the same greedy tokens as the original."""
    folder = str(tmp_path / "my-llama")
    shutil.copytree(checkpoint("llama"), folder)
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["architectures"] = ["MyLlamaForCausalLM"]
    with open(config_path, "w") as f:
        json.dump(config, f)
    llama = model_for("LlamaForCausalLM")
    traced = []

    class CountedLlama(llama.module):
        def __call__(self, *args):
            traced.append(self.spec.architecture)
            return super().__call__(*args)

    monkeypatch.setitem(registry._MODELS, "MyLlamaForCausalLM", dataclasses.replace(llama, module=CountedLlama))
    args = small_engine_args(max_num_seqs=4, max_num_batched_tokens=32, num_pages=32, skip_precompile=True)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in expected("llama")["prompts"][:4]]
    mine = [o.outputs[0].token_ids for o in LLM(folder, **args).generate(prompts, params, use_tqdm=False)]
    assert traced and set(traced) == {"MyLlamaForCausalLM"}
    original = [o.outputs[0].token_ids for o in LLM(checkpoint("llama"), **args).generate(prompts, params,
                                                                                       use_tqdm=False)]
    assert mine == original
