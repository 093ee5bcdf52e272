"""Phi-3 / Phi-4 (Phi3ForCausalLM) against Hugging Face transformers: fused qkv_proj and gate_up_proj read apart
(each tensor-parallel shard only its rows), LongRoPE's short factors for a max_model_len within the original
context and its long ones (with the attention factor) beyond it, a partial rotary embedding and a sliding window."""

import dataclasses

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.model.loader import FusedRows, TensorMapping
from jaxserve.model.phi3 import fused_parts
from jaxserve.model.registry import load_model_spec, spec_from_hf_config
from helpers import checkpoint, expected, small_engine_args

ORIGINAL_CONTEXT = 32  # the fixture's original_max_position_embeddings
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _check_prompts(llm, indices: list[int]) -> None:
    """HF's 20 greedy tokens and first-token log-probabilities (1e-4) for the fixture's prompts `indices`, and every
    page back."""
    want = expected("phi3")
    prompts = [{"prompt_token_ids": want["prompts"][i]} for i in indices]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [want["outputs"][i] for i in indices]
    first = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)
    for result, i in zip(first, indices):
        logits = want["logits"][i]
        hf_logprobs = logits - np.logaddexp.reduce(logits.astype(np.float64))  # (V,)
        for token_id, logprob in result.outputs[0].logprobs[0].items():
            assert logprob.logprob == pytest.approx(hf_logprobs[token_id], abs=1e-4)
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_short_context_serves_hf_outputs_on_the_short_factors():
    # HF recomputes the whole sequence on the short factors while it is within the original context: the prompts
    # that stay within it with their 20 tokens, and every first token of a prompt shorter than it.
    llm = LLM(checkpoint("phi3"), **small_engine_args(max_model_len=ORIGINAL_CONTEXT, page_size=8, num_pages=40,
                                                      skip_precompile=True))
    assert not llm.engine.core.spec.rope.long_context
    prompts = expected("phi3")["prompts"]
    within = [i for i, p in enumerate(prompts) if len(p) + 20 <= ORIGINAL_CONTEXT]
    assert len(within) == 5
    _check_prompts(llm, within)
    first_only = [i for i, p in enumerate(prompts) if len(p) < ORIGINAL_CONTEXT]
    want = expected("phi3")
    params = SamplingParams(temperature=0, max_tokens=1)
    outputs = llm.generate([{"prompt_token_ids": prompts[i]} for i in first_only], params, use_tqdm=False)
    assert [o.outputs[0].token_ids[0] for o in outputs] == [want["outputs"][i][0] for i in first_only]


def test_long_context_at_tp2_serves_hf_outputs_on_the_long_factors():
    # Beyond the original context HF runs every position on the long factors: the prompts longer than it (the
    # 70-token one also past the sliding window of 48), with q/k/v and gate/up each split over two devices.
    llm = LLM(checkpoint("phi3"), tensor_parallel_size=2,
              **small_engine_args(max_model_len=128, page_size=16, num_pages=24, skip_precompile=True))
    runner = llm.engine.core.runner
    assert llm.engine.core.spec.rope.long_context and llm.engine.core.spec.sliding_window == 48
    for leaf in ("wq", "wk", "w_gate", "w_up"):
        weight = runner.params["layers"][leaf]
        assert weight.addressable_shards[0].data.shape[-1] == weight.shape[-1] // 2
    longer = [i for i, p in enumerate(expected("phi3")["prompts"]) if len(p) > ORIGINAL_CONTEXT]
    assert len(longer) == 3
    _check_prompts(llm, longer)


def test_fused_rows_read_each_part_from_the_fused_tensor():
    spec = load_model_spec(checkpoint("phi3"))
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((128, 64)).astype(np.float32)  # q 64 rows, k 32, v 32
    gate_up = rng.standard_normal((256, 64)).astype(np.float32)
    view = FusedRows(TensorMapping({"model.layers.3.self_attn.qkv_proj.weight": qkv,
                                    "model.layers.3.mlp.gate_up_proj.weight": gate_up,
                                    "model.norm.weight": np.ones(64, np.float32)}), fused_parts(spec))
    k = "model.layers.3.self_attn.k_proj.weight"
    assert k in view and "model.layers.3.self_attn.qkv_proj.weight" in view
    assert "model.layers.4.self_attn.k_proj.weight" not in view
    assert view.shape(k) == (32, 64) and view.shape("model.layers.3.mlp.up_proj.weight") == (128, 64)
    np.testing.assert_array_equal(view.get(k), qkv[64:96])
    np.testing.assert_array_equal(view.get(k, (slice(8, 24), slice(1, 5))), qkv[72:88, 1:5])
    np.testing.assert_array_equal(view.get("model.layers.3.self_attn.v_proj.weight"), qkv[96:])
    np.testing.assert_array_equal(view.get("model.layers.3.mlp.up_proj.weight", (slice(None), slice(0, 3))),
                                  gate_up[128:, :3])
    np.testing.assert_array_equal(view.get("model.norm.weight"), np.ones(64))


# Phi-3.5-mini-instruct's config.json as published (transformers 4 layout), shortened to 4 factors a side
HUB_CONFIG = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 32064, "hidden_size": 3072, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 8192, "hidden_act": "silu",
              "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
              "rms_norm_eps": 1e-05, "sliding_window": 262144, "tie_word_embeddings": False,
              "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.02, 1.05, 1.1],
                               "long_factor": [1.0, 1.5, 8.0, 40.0]}}


def test_published_config_layout():
    config = {**HUB_CONFIG, "partial_rotary_factor": 1 / 12}  # 8 of the 96 head dims rotate: 4 factors
    rope = spec_from_hf_config(config).rope
    assert (rope.rope_type, rope.rotary_dim, rope.original_max_position_embeddings) == ("longrope", 8, 4096)
    assert rope.attention_factor == pytest.approx(np.sqrt(1 + np.log(32) / np.log(4096)))
    base = 1 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    np.testing.assert_allclose(rope.inv_freq(), base / np.array([1.0, 1.02, 1.05, 1.1]))
    np.testing.assert_allclose(rope.for_max_model_len(8192).inv_freq(), base / np.array([1.0, 1.5, 8.0, 40.0]))
    assert not rope.for_max_model_len(4096).long_context
    su = {**config, "rope_scaling": {**config["rope_scaling"], "type": "su"}}  # Phi-3's first name for it
    assert spec_from_hf_config(su).rope == rope
    phi4 = {**HUB_CONFIG, "rope_scaling": None, "max_position_embeddings": 16384}  # Phi-4: plain rope
    spec = spec_from_hf_config(phi4)
    assert dataclasses.astuple(spec.rope)[:3] == (10000.0, 96, "default") and spec.rope.rotary_dim == 0


@pytest.mark.parametrize("change,message", [
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 4}}, "short_factor"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4}}, "long_factor"),
    ({"partial_rotary_factor": 0.001}, "partial_rotary_factor"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantized Phi-3"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_refusals(change, message):
    config = {**HUB_CONFIG, "partial_rotary_factor": 1 / 12, **change}
    with pytest.raises(ValueError, match=message):
        spec_from_hf_config(config)
