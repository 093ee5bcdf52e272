"""DeepSeek-V3 (model/deepseek.py) beyond the token-for-token checks against transformers (test_engine_vs_hf.py,
test_tensor_parallel.py): what its spec reads, a KV pool that holds the latent (one KV head of r + dr), the
routing against a plain re-statement of transformers' router, clear errors for what it does not serve, and its
weights quantized in both stacks of layers: the releases' fp8 blocks served as stored (against transformers,
which dequantizes them), or a float checkpoint quantized at load (against the float model)."""

from __future__ import annotations

import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helpers import assert_serves_hf_outputs, checkpoint, checkpoint_tensors, expected, small_engine_args
from jaxserve import LLM, SamplingParams
from jaxserve.bench.quality import compare_distributions, next_token_logprobs, scoring_runner
from jaxserve.model import moe
from jaxserve.model.checkpoint import convert
from jaxserve.model.quantize import dequantize, leaf_at, replace_at
from jaxserve.model.registry import quantizable_paths
from jaxserve.model.registry import load_model_spec, spec_from_hf_config

FP8 = "deepseek-v3-fp8-block"  # deepseek-v3 as DeepSeek-V3's release stores it: fp8 in blocks (of 16 x 8 here)
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _config(name: str = "deepseek-v3") -> dict:
    with open(os.path.join(checkpoint(name), "config.json")) as f:
        return json.load(f)


def test_the_spec_reads_latent_attention_and_routing():
    spec = load_model_spec(checkpoint("deepseek-v3"))
    assert (spec.head_dim, spec.num_kv_heads, spec.num_heads) == (24 + 8, 1, 4)  # the cache: latent + rotary key
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_nope_head_dim, spec.v_head_dim) == (32, 24, 16, 12)
    assert (spec.first_dense_layers, spec.dense_intermediate_size, spec.intermediate_size) == (1, 128, 32)
    assert (spec.num_experts, spec.num_experts_per_tok, spec.num_groups, spec.top_groups) == (8, 2, 2, 1)
    assert spec.shared_expert_size == 32 and spec.routed_scaling_factor == 2.5 and spec.rope_interleave
    assert spec.rope.rope_type == "yarn" and spec.rope.head_dim == 8
    assert spec.softmax_scale == pytest.approx((16 + 8) ** -0.5 * (0.1 * math.log(2.0) + 1) ** 2)
    plain = load_model_spec(checkpoint("deepseek-v3-q-proj"))
    assert plain.q_lora_rank is None and plain.first_dense_layers == 0 and plain.shared_expert_size == 64
    assert plain.softmax_scale == pytest.approx(24 ** -0.5)  # no YaRN: no mscale


def test_the_kv_pool_holds_the_latent_and_the_tokens_are_hfs():
    llm = LLM(checkpoint("deepseek-v3"), **small_engine_args(num_pages=16, max_num_seqs=4, skip_precompile=True))
    caches = llm.engine.core.runner.kv_caches
    assert all(cache.shape[3:] == (1, 24 + 8) for cache in caches), [cache.shape for cache in caches]
    want = expected("deepseek-v3")
    outputs = llm.generate([{"prompt_token_ids": p} for p in want["prompts"][-3:]],
                           SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want["outputs"][-3:]
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]


def _reference_routing(logits: np.ndarray, bias: np.ndarray, top_k: int, groups: int, top_groups: int,
                       normalize: bool, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """transformers' DeepseekV3TopkRouter, token by token in numpy: (weights (T, k), experts (T, k)) with each
    token's experts sorted by expert id."""
    weights, experts = [], []
    for row in logits.astype(np.float64):
        scores = 1 / (1 + np.exp(-row))
        biased = scores + bias
        per_group = biased.reshape(groups, -1)
        group_scores = np.sort(per_group, axis=1)[:, -2:].sum(axis=1)
        kept = np.argsort(-group_scores, kind="stable")[:top_groups]
        allowed = np.full_like(biased, -np.inf).reshape(groups, -1)
        allowed[kept] = per_group[kept]
        chosen = np.sort(np.argsort(-allowed.reshape(-1), kind="stable")[:top_k])
        w = scores[chosen]
        if normalize:
            w = w / (w.sum() + 1e-20)
        weights.append(w * scale)
        experts.append(chosen)
    return np.array(weights), np.array(experts)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), groups=st.sampled_from([1, 2, 4]), normalize=st.booleans())
def test_routing_keeps_the_best_groups_then_the_best_experts_in_them(seed, groups, normalize):
    rng = np.random.default_rng(seed)
    hidden, num_experts, top_k = 8, 8, 2
    top_groups = int(rng.integers(1, groups + 1))
    x = rng.normal(size=(5, hidden)).astype(np.float32)
    router = rng.normal(size=(hidden, num_experts)).astype(np.float32)
    bias = (0.3 * rng.normal(size=num_experts)).astype(np.float32)
    chosen = moe.grouped_sigmoid_routing(jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias), top_k=top_k,
                                         num_groups=groups, top_groups=top_groups, normalize_top_k=normalize,
                                         scale=2.5)
    order = np.argsort(np.asarray(chosen.experts), axis=1)
    got_experts = np.take_along_axis(np.asarray(chosen.experts), order, axis=1)
    got_weights = np.take_along_axis(np.asarray(chosen.weights), order, axis=1)
    want_weights, want_experts = _reference_routing(x.astype(np.float64) @ router, bias, top_k, groups, top_groups,
                                                    normalize, 2.5)
    np.testing.assert_array_equal(got_experts, want_experts)
    np.testing.assert_allclose(got_weights, want_weights, rtol=1e-5)


@pytest.mark.parametrize("changes, message", [
    ({"scoring_func": "softmax"}, "routes with sigmoid scores"),
    ({"topk_method": "group_limited_greedy"}, "topk_method noaux_tc"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"first_k_dense_replace": 3}, "leaves none of the 3 layers sparse"),
    ({"n_group": 3}, "must split into n_group 3 equal groups"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_configs_it_does_not_serve_are_value_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        spec_from_hf_config({**_config(), **changes})


@pytest.mark.parametrize("options, message", [
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype fp8 is not supported for DeepseekV3ForCausalLM"),
    ({"enable_lora": True}, "takes no LoRA adapters"),
])
def test_engine_options_it_does_not_serve_are_value_errors(options, message):
    with pytest.raises(ValueError, match=message):
        LLM(checkpoint("deepseek-v3"), **small_engine_args(num_pages=16, skip_precompile=True, **options))


def test_its_classifiers_are_not_registered():
    from jaxserve.model.registry import model_for, registered_architectures

    assert "DeepseekV3ForCausalLM" in registered_architectures()
    for head in ("DeepseekV3ForSequenceClassification", "DeepseekV3ForTokenClassification"):
        assert head not in registered_architectures()
        with pytest.raises(ValueError, match=f"unsupported architecture '{head}'"):
            model_for(head)


# ---- quantized weights ----------------------------------------------------------------------------------------


def _engine(name: str, **options) -> LLM:
    return LLM(checkpoint(name), **small_engine_args(num_pages=40, page_size=8, max_num_seqs=16, skip_precompile=True,
                                                     **options))


def _greedy(llm: LLM, name: str) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in expected(name)["prompts"]]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def fp8_llm():
    return _engine(FP8)


def test_every_projection_of_both_stacks_is_quantizable_the_router_is_not():
    paths = set(quantizable_paths(load_model_spec(checkpoint("deepseek-v3"))))
    attention = {"wq_a", "wq_b", "wkv_a", "wkv_b", "wo"}
    assert paths == {*(("dense_layers", name) for name in attention | {"w_gate", "w_up", "w_down"}),
                     *(("layers", name) for name in attention | {"w_gate", "w_up", "w_down", "shared_w_gate",
                                                                 "shared_w_up", "shared_w_down"})}


def test_the_releases_fp8_blocks_are_served_as_stored_and_give_hugging_faces_tokens(fp8_llm):
    spec = load_model_spec(checkpoint(FP8))
    assert spec.checkpoint_quantization == "fp8" and spec.checkpoint_weight_block == (16, 8)
    params = fp8_llm.engine.core.runner.params
    for path in quantizable_paths(spec):
        leaf = leaf_at(params, path)
        assert leaf["weight"].dtype == jnp.float8_e4m3fn and leaf["scale"].ndim == leaf["weight"].ndim, path
    assert params["layers"]["wkv_b"]["scale"].shape == (2, 24 // 8, 4 * (16 + 12))  # (L, in / 8 columns, out)
    assert params["layers"]["router"].dtype == jnp.float32  # the router stays float
    assert_serves_hf_outputs(fp8_llm, FP8)


def test_kv_b_projs_block_scales_reach_the_absorbed_attention(fp8_llm):
    """kv_b_proj is dequantized where the step splits it into keys and values: doubled scales change the tokens
    (update_weights, in place), the stored ones bring them back."""
    tensors = checkpoint_tensors(FP8, None)
    doubled = {name: tensor * 2 if name.endswith("kv_b_proj.weight_scale_inv") else tensor
               for name, tensor in tensors.items()}
    want = expected(FP8)["outputs"]
    for source, same in ((doubled, False), (tensors, True)):
        fp8_llm.update_weights(source)
        assert (_greedy(fp8_llm, FP8) == want) is same


def test_fp8_blocks_split_over_devices_with_the_experts_whole_give_the_same_tokens():
    llm = _engine(FP8, tensor_parallel_size=2, enable_expert_parallel=True)
    assert _greedy(llm, FP8) == expected(FP8)["outputs"]


def test_a_converted_fp8_folder_keeps_both_stacks_blocks(tmp_path):
    assert convert(checkpoint(FP8), str(tmp_path / "converted"))["quantization"] == "fp8"
    llm = LLM(str(tmp_path / "converted"), **small_engine_args(num_pages=40, page_size=8, max_num_seqs=16,
                                                                skip_precompile=True))
    assert llm.engine.core.runner.params["dense_layers"]["w_down"]["scale"].shape == (1, 128 // 8, 64)
    assert _greedy(llm, FP8) == expected(FP8)["outputs"]


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantized_at_load_it_computes_the_model_its_weights_stand_for(mode):
    """The quantized engine's next-token log-probabilities equal, to float32 rounding, those of the float model
    whose every projection (both stacks) is replaced by what its quantized form stands for (weight times scale)."""
    prompts = expected("deepseek-v3")["prompts"]
    runner = scoring_runner(checkpoint("deepseek-v3"), mode)
    paths = quantizable_paths(runner.spec)
    assert all(isinstance(leaf_at(runner.params, path), dict) for path in paths)
    quantized = next_token_logprobs(runner, prompts)
    runner.params = replace_at(runner.params, paths, lambda leaf: dequantize(leaf, jnp.float32))
    for got, want in zip(quantized, next_token_logprobs(runner, prompts)):
        np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("mode, least_top1, most_kl", [("int8", 0.85, 0.15), ("fp8", 0.6, 0.4)])
def test_quantized_at_load_it_stays_near_the_float_model(mode, least_top1, most_kl):
    """Looser bars than test_quantization.py's dense models': this random fixture's router margins (2e-4 on sigmoid
    scores) let the rounding flip an expert or a group choice, and each flip moves the later layers (measured:
    int8 top-1 0.91, mean KL 0.073; fp8 0.67, 0.22; Mixtral's fixture gives int8 0.91, 0.027)."""
    prompts = expected("deepseek-v3")["prompts"]
    reference = next_token_logprobs(scoring_runner(checkpoint("deepseek-v3")), prompts)
    quality = compare_distributions(reference, next_token_logprobs(scoring_runner(checkpoint("deepseek-v3"), mode),
                                                                   prompts))
    assert quality["top1_agreement"] >= least_top1 and quality["mean_kl"] <= most_kl, quality


def test_a_weight_update_quantizes_both_stacks_again():
    """update_weights over weights quantized at load reads the float tensors and quantizes them again, in the dense
    stack too: the same tokens as before; doubled dense down_proj weights change them."""
    llm = _engine("deepseek-v3", quantization="int8")
    assert llm.engine.core.runner.params["dense_layers"]["w_down"]["weight"].dtype == jnp.int8
    before = _greedy(llm, "deepseek-v3")
    tensors = checkpoint_tensors("deepseek-v3", None)
    doubled = {name: tensor * 2 if name == "model.layers.0.mlp.down_proj.weight" else tensor
               for name, tensor in tensors.items()}
    for source, same in ((doubled, False), (tensors, True)):
        llm.update_weights(source)
        assert llm.engine.core.runner.params["dense_layers"]["w_down"]["weight"].dtype == jnp.int8
        assert (_greedy(llm, "deepseek-v3") == before) is same
