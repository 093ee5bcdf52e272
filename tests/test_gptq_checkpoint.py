"""A GPTQ checkpoint (AutoGPTQ's and GPTQModel's "gptq" format: `qweight` packed along the inputs, `qzeros` stored
less one, float16 `scales`, `g_idx`) is served as it is stored, read through the GptqPacked view as
compressed-tensors' int4 form, and gives what transformers gives from the float model with each linear weight
replaced by what AutoGPTQ's own QuantLinear computes from the stored tensors (scripts/make_quantized_fixtures.py):
asymmetric groups (zero points 0 wrapped to 16 as GPTQ's kernels read them), symmetric groups in a mixture of
experts, and symmetric per output channel.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

from helpers import (
    assert_serves_hf_outputs,
    checkpoint,
    checkpoint_tensors,
    expected,
    small_engine_args,
    tiny_llama_config,
)
from jaxserve import LLM, SamplingParams
from jaxserve.bench.quantized_checkpoint import quantize_gptq, quantize_int4
from jaxserve.model.loader import GptqPacked, TensorMapping, _group_zero_points
from jaxserve.model.registry import spec_from_hf_config

ASYMMETRIC, MOE, CHANNEL = "qwen2-gptq-asym", "qwen3-moe-gptq", "qwen3-gptq-channel"
ACT_ORDER, ACT_ORDER_MOE, INT8 = "qwen2-gptq-act-order", "qwen3-moe-gptq-act-order", "llama-gptq-int8"
OPTIONS = small_engine_args(num_pages=40, page_size=8, max_num_seqs=16, skip_precompile=True)


@pytest.mark.parametrize("name, tensor_parallel_size, fields", [
    (ASYMMETRIC, 2, (True, (1, 8), False)),
    (MOE, 2, (False, (1, 16), False)),
    (CHANNEL, 1, (False, None, False)),
    (ACT_ORDER, 2, (False, (1, 16), True)),
    (INT8, 2, (False, (1, 16), False)),
])
def test_a_gptq_checkpoint_matches_hugging_face(name, tensor_parallel_size, fields):
    """qwen2 asymmetric in groups of 8 over two devices (o_proj's and down_proj's groups split with their rows);
    the MoE's experts symmetric in groups of 16 over two devices; qwen3 symmetric per output channel; qwen2 with
    act-order over two devices (each row's group split with the rows, every group's scales on both); llama in 8
    bits over two devices (int8 weights, one per byte). A symmetric checkpoint's zero points (all 8, or 128) are
    checked and left out; update_weights takes the act-order and 8-bit arrays by name through the same view."""
    llm = LLM(checkpoint(name), tensor_parallel_size=tensor_parallel_size, **OPTIONS)
    spec = llm.engine.core.spec
    assert (spec.checkpoint_format, spec.checkpoint_zero_points, spec.checkpoint_weight_block,
            spec.checkpoint_act_order) == ("gptq", *fields)
    up = llm.engine.core.runner.params["layers"]["w_up"]
    assert ("zero" in up) == fields[0] and ("row_groups" in up) == fields[2]
    assert (up["weight"].dtype, up["weight"].shape[-2]) == ((jnp.int8, 64) if name == INT8 else (jnp.uint8, 32))
    assert_serves_hf_outputs(llm, name)
    if name in (ACT_ORDER, INT8):
        want = expected(name)
        llm.update_weights(checkpoint_tensors(name, None))
        greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in want["prompts"]], greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == want["outputs"]


@pytest.mark.parametrize("enable_expert_parallel", [False, True])
def test_an_act_order_mixture_of_experts_matches_hugging_face(enable_expert_parallel):
    """Every expert's projections asymmetric with act-order, each expert split over two devices by its inner size
    (down_proj's rows and their groups split, its scales and zero points whole), or the experts split whole."""
    llm = LLM(checkpoint(ACT_ORDER_MOE), tensor_parallel_size=2, enable_expert_parallel=enable_expert_parallel,
              **OPTIONS)
    down = llm.engine.core.runner.params["layers"]["w_down"]
    assert down["row_groups"].shape == (2, 8, 32) and down["zero"].shape == down["scale"].shape == (2, 8, 2, 64)
    experts, rows = ("model", None) if enable_expert_parallel else (None, "model")
    assert down["row_groups"].sharding.spec == P(None, experts, rows)
    assert down["scale"].sharding.spec == down["zero"].sharding.spec == P(None, experts, None, None)
    assert_serves_hf_outputs(llm, ACT_ORDER_MOE)


def test_the_gptq_view_reads_gptq_tensors_as_compressed_tensors_form():
    """GPTQ's words (packed along the inputs, unsigned) read as compressed-tensors' packed words of the same weight
    (any slice), the zero points as written, a zero point 0 (stored 15) as 16: what GPTQ's kernels read; 8-bit
    words read as int8 weights (any slice), within half a step of the original (and the float16 scale's rounding)."""
    weight = np.random.default_rng(2).standard_normal((32, 64)).astype(np.float32) + 0.3
    weight[:8, :16] = np.abs(weight[:8, :16])  # a group of eight output channels whose zero point is 0
    for symmetric in (True, False):
        gptq, compressed = quantize_gptq(weight, 16, symmetric), quantize_int4(weight, 16, symmetric)
        assert gptq["qweight"].shape == (8, 32) and gptq["qzeros"].shape == (4, 4) and gptq["g_idx"].shape == (64,)
        view = GptqPacked(TensorMapping({"x." + key: value for key, value in gptq.items()}), 4, symmetric)
        assert np.array_equal(view.get("x.weight_packed"), compressed["weight_packed"])
        assert np.array_equal(view.get("x.weight_packed", (slice(3, 19), slice(1, 5))),
                              compressed["weight_packed"][3:19, 1:5])
        assert np.array_equal(view.get("x.weight_scale"),
                              compressed["weight_scale"].astype(np.float16).astype(np.float32))
        assert list(view.get("x.weight_shape")) == [32, 64] and view.shape("x.weight_packed") == (32, 8)
    zero = _group_zero_points(view, ("x.weight", 32, 64), "x.weight_zero_point", (1, 16), stored_less=1)
    written = _group_zero_points(TensorMapping({"z": compressed["weight_zero_point"]}), ("x.weight", 32, 64), "z",
                                 (1, 16))  # (groups, out)
    assert written[0, 0] == -8 and zero[0, 0] == 8  # written 0, read 16
    assert np.array_equal(zero[written != -8], written[written != -8])
    eight_bit_tensors = quantize_gptq(weight, 16, bits=8)
    eight_bits = GptqPacked(TensorMapping({"x." + key: value for key, value in eight_bit_tensors.items()}), 8, True)
    values = eight_bits.get("x.weight")  # (out, in) int8
    steps = np.repeat(eight_bits.get("x.weight_scale"), 16, axis=1)  # (out, in)
    assert values.dtype == np.int8 and eight_bits.shape("x.weight") == (32, 64) and "x.weight_packed" not in eight_bits
    assert np.all(np.abs(values * steps - weight) <= 0.6 * steps)  # half a step, and 127 float16 roundings of one
    assert np.array_equal(eight_bits.get("x.weight", (slice(3, 19), slice(5, 30))), values[3:19, 5:30])


def test_unexpected_act_order_bad_groups_and_inconsistent_zero_points_are_named(tmp_path):
    """A permuted g_idx under desc_act false, a symmetric checkpoint's zero point other than 8, and an act-order
    g_idx naming a group the weight does not have."""
    tensors = checkpoint_tensors(MOE, str(tmp_path))
    order = tensors["model.layers.0.self_attn.o_proj.g_idx"]
    tensors["model.layers.0.self_attn.o_proj.g_idx"] = order[np.random.default_rng(0).permutation(order.size)]
    save_file(tensors, os.path.join(str(tmp_path), "model.safetensors"))
    with pytest.raises(ValueError, match="o_proj.g_idx does not put input row i in group i // group_size"):
        LLM(str(tmp_path), **OPTIONS)
    tensors["model.layers.0.self_attn.o_proj.g_idx"] = order
    tensors["model.layers.1.self_attn.q_proj.qzeros"] = tensors["model.layers.1.self_attn.q_proj.qzeros"] + 1
    save_file(tensors, os.path.join(str(tmp_path), "model.safetensors"))
    with pytest.raises(ValueError, match="q_proj.qzeros holds zero points other than 8 but the checkpoint says sym"):
        LLM(str(tmp_path), **OPTIONS)
    act_order = tmp_path / "act-order"
    os.makedirs(act_order)
    tensors = checkpoint_tensors(ACT_ORDER, str(act_order))
    tensors["model.layers.1.mlp.down_proj.g_idx"][5] = 8  # 128 rows in 8 groups of 16: no group 8
    save_file(tensors, os.path.join(str(act_order), "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj.weight_g_idx must give each of .*'s 128 input rows one of its 8"):
        LLM(str(act_order), **OPTIONS)


def _gptq(**fields) -> dict:
    return {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False, **fields}


@pytest.mark.parametrize("quantization_config, message", [
    (_gptq(bits=3), "GPTQ bits 3"),
    (_gptq(bits=8, sym=False), "GPTQ bits 8 with sym false"),
    (_gptq(checkpoint_format="gptq_v2"), "checkpoint_format 'gptq_v2'"),
    (_gptq(group_size=0), "group_size must be a positive integer or -1"),
    (_gptq(group_size=-1, sym=False), "sym false with group_size -1"),
    (_gptq(lm_head=True), "quantized LM head"),
    (_gptq(dynamic={"-:.*mlp.*": {}}), "dynamic"),
    (_gptq(modules_to_not_convert=["model.layers.0.mlp.down_proj"]), "modules_to_not_convert lists layers"),
])
def test_gptq_settings_jaxserve_does_not_read_are_refused(quantization_config, message):
    with pytest.raises(ValueError, match=message):
        spec_from_hf_config(tiny_llama_config(quantization_config=quantization_config))
