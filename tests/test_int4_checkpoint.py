"""An int4 checkpoint in compressed-tensors' pack-quantized W4A16 form (llm-compressor's: 4-bit weights packed
eight to an int32, a scale per group of input columns) is served as it is stored, two weights to a byte on the
device, and gives
what Hugging Face transformers gives from the same folder (scripts/make_quantized_fixtures.py: compressed-tensors
unpacks and dequantizes it); tensor parallelism splits the packed columns and the group scales together.
The asymmetric form (llm-compressor's W4A16_ASYM: a zero point per group, packed along the outputs) gives what
transformers gives from compressed-tensors' own decompression of the stored tensors, and so does AutoAWQ's GEMM
form (read through the AwqGemm view as the asymmetric form; the reference converts it with compressed-tensors'
own AutoAWQ converter first).
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
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
from jaxserve.bench.quantized_checkpoint import quantize_awq, quantize_int4
from jaxserve.model.loader import AwqGemm, PackedInt4, SafetensorsFolder, TensorMapping, _group_zero_points
from jaxserve.model.quantize import unpack_int4, weight_bytes
from jaxserve.model.registry import load_model_spec, spec_from_hf_config

NAME, MOE = "llama-int4", "qwen3-moe-int4"
ASYMMETRIC, ASYMMETRIC_MOE, AWQ, AWQ_MOE = "qwen3-int4-asym", "qwen3-moe-int4-asym", "qwen2-awq", "qwen3-moe-awq"
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
OPTIONS = small_engine_args(num_pages=40, page_size=8, max_num_seqs=16, skip_precompile=True)


def _prompts(want: dict) -> list[dict]:
    return [{"prompt_token_ids": p} for p in want["prompts"]]


@pytest.fixture(scope="module")
def llm():
    return LLM(checkpoint(NAME), **OPTIONS)


def test_greedy_tokens_and_first_logprobs_match_hugging_face(llm):
    layers = llm.engine.core.runner.params["layers"]
    assert layers["w_down"]["weight"].dtype == jnp.uint8 and layers["w_down"]["weight"].shape == (2, 64, 64)
    assert layers["w_down"]["scale"].shape == (2, 8, 64)  # (L, 128 inputs / groups of 16, out)
    assert_serves_hf_outputs(llm, NAME)


def test_the_linear_layers_take_a_quarter_of_bfloat16_plus_their_scales(llm):
    spec = load_model_spec(checkpoint(NAME))
    leaves = {name: llm.engine.core.runner.params["layers"][name] for name in ("wq", "wk", "wv", "wo", "w_gate",
                                                                                "w_up", "w_down")}
    weights = sum(2 * leaf["weight"].size for leaf in leaves.values())  # two to a byte
    share = weight_bytes(leaves) / (2 * weights)  # over bfloat16
    assert share == pytest.approx((0.5 + 4 / 16) / 2)  # half a byte each, and a float32 scale per 16 weights
    assert spec.checkpoint_quantization == "int4" and spec.checkpoint_weight_block == (1, 16)


def test_tensor_parallelism_splits_packed_columns_with_their_groups():
    """Four devices: each reads a quarter of o_proj's and down_proj's packed input columns and their groups' scales;
    the 2 KV heads are repeated to 4, packed columns and scales alike."""
    want = expected(NAME)
    other = LLM(checkpoint(NAME), tensor_parallel_size=4, **OPTIONS)
    outputs = other.generate(_prompts(want), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want["outputs"]


@pytest.mark.parametrize("tensor_parallel_size, enable_expert_parallel", [(1, False), (2, False), (2, True)])
def test_a_mixture_of_experts_checkpoint_matches_hugging_face(tensor_parallel_size, enable_expert_parallel):
    """Every expert's projections in int4 groups of 16 (the routers in float), alone, with each expert split over
    two devices (one group of down_proj's 32 inputs each), and with the experts split whole."""
    llm = LLM(checkpoint(MOE), tensor_parallel_size=tensor_parallel_size,
              enable_expert_parallel=enable_expert_parallel, **OPTIONS)
    down = llm.engine.core.runner.params["layers"]["w_down"]
    assert down["weight"].shape == (2, 8, 16, 64) and down["scale"].shape == (2, 8, 2, 64)  # (L, E, 32 / 2, H)
    assert_serves_hf_outputs(llm, MOE)


def test_the_packed_view_reads_any_slice_and_weight_updates_read_it_too(llm):
    """Columns that start and end inside a word unpack to the same values as the whole tensor; update_weights takes
    the checkpoint's packed arrays by name."""
    view = PackedInt4(SafetensorsFolder(checkpoint(NAME)))
    name = "model.layers.0.mlp.down_proj.weight"
    whole = view.get(name)  # (64, 128 / 2) bytes
    assert view.shape(name) == (64, 64) and whole.dtype == np.uint8
    assert np.array_equal(view.get(name, (slice(3, 9), slice(5, 30))), whole[3:9, 5:30])
    weight = np.random.default_rng(0).standard_normal((8, 32)).astype(np.float32)
    packed = quantize_int4(weight, 16)
    mapping = PackedInt4(TensorMapping({"w.weight_packed": packed["weight_packed"],
                                        "w.weight_shape": packed["weight_shape"]}))
    values = np.asarray(unpack_int4(jnp.asarray(mapping.get("w.weight").T), jnp.float32)).T  # (8, 32)
    assert values.min() >= -8 and values.max() <= 7
    scales = np.repeat(packed["weight_scale"], 16, axis=1)  # (8, 32)
    assert np.abs(values * scales - weight).max() <= scales.max() / 2 + 1e-6  # within half a step of the original
    want = expected(NAME)
    llm.update_weights(checkpoint_tensors(NAME, None))
    outputs = llm.generate(_prompts(want), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want["outputs"]


def _int4_config(**weights) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
                **weights}}}}


@pytest.mark.parametrize("quantization_config, message", [
    (_int4_config(symmetric=False, strategy="channel"), "asymmetric \\(zero points\\) per channel"),
    ({**_int4_config(), "format": "naive-quantized"}, "format 'naive-quantized'"),
    (_int4_config(group_size=0), "group_size must be a positive integer"),
    ({**_int4_config(), "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                                  "group_size": 128},
                                                      "input_activations": {"num_bits": 8, "type": "int"}}}},
     "quantizes the activations too"),
    ({**_int4_config(), "ignore": ["lm_head", "model.layers.0.self_attn.q_proj"]}, "ignore lists layers"),
])
def test_int4_forms_jaxserve_does_not_read_are_refused(quantization_config, message):
    with pytest.raises(ValueError, match=message):
        spec_from_hf_config(tiny_llama_config(quantization_config=quantization_config))


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_an_asymmetric_checkpoint_matches_hugging_face(tensor_parallel_size):
    """qwen3 with a zero point per group of 16 (int8 (L, groups, out), split like the scales): alone, and over two
    devices (the packed zero points read whole and split along the outputs, o_proj's and down_proj's groups)."""
    llm = LLM(checkpoint(ASYMMETRIC), tensor_parallel_size=tensor_parallel_size, **OPTIONS)
    spec = llm.engine.core.spec
    assert spec.checkpoint_zero_points and spec.checkpoint_weight_block == (1, 16)
    up = llm.engine.core.runner.params["layers"]["w_up"]
    assert up["zero"].dtype == jnp.int8 and up["zero"].shape == up["scale"].shape == (2, 4, 128)
    assert int(np.abs(np.asarray(up["zero"])).max()) > 0  # the zero points are not all 0: they are read
    assert_serves_hf_outputs(llm, ASYMMETRIC)


@pytest.mark.parametrize("tensor_parallel_size, enable_expert_parallel", [(1, False), (2, False), (2, True)])
def test_an_asymmetric_mixture_of_experts_matches_hugging_face(tensor_parallel_size, enable_expert_parallel):
    llm = LLM(checkpoint(ASYMMETRIC_MOE), tensor_parallel_size=tensor_parallel_size,
              enable_expert_parallel=enable_expert_parallel, **OPTIONS)
    down = llm.engine.core.runner.params["layers"]["w_down"]
    assert down["zero"].shape == down["scale"].shape == (2, 8, 2, 64)  # (L, E, 32 inputs / 16, H)
    assert_serves_hf_outputs(llm, ASYMMETRIC_MOE)


def test_asymmetric_zero_points_unpack_as_written_and_updates_and_conversions_keep_them(tmp_path):
    """The writer's zero points (packed eight output channels to a word) read back as written, and (q - zero) *
    scale is the original within half a step; update_weights reads them anew, a converted folder keeps them."""
    from jaxserve.model.checkpoint import convert

    weight = np.random.default_rng(1).standard_normal((16, 32)).astype(np.float32) + 0.5  # skewed: zeros matter
    packed = quantize_int4(weight, 16, symmetric=False)
    assert packed["weight_zero_point"].shape == (2, 2)  # (16 outputs / 8, 2 groups)
    source = PackedInt4(TensorMapping({"w." + key: value for key, value in packed.items()}))
    zero = _group_zero_points(source, ("w.weight", 16, 32), "w.weight_zero_point", (1, 16))  # (groups, out)
    assert zero.dtype == np.int8 and np.abs(zero).max() > 0
    values = np.asarray(unpack_int4(jnp.asarray(source.get("w.weight").T), jnp.float32)).T  # (16, 32)
    steps = np.repeat(packed["weight_scale"], 16, axis=1)  # (16, 32)
    restored = (values - np.repeat(zero.T, 16, axis=1)) * steps
    assert np.abs(restored - weight).max() <= steps.max() / 2 + 1e-6
    with pytest.raises(ValueError, match="has shape \\(2, 2\\); .* need \\(1, 2\\)"):
        _group_zero_points(source, ("w.weight", 8, 32), "w.weight_zero_point", (1, 16))
    want = expected(ASYMMETRIC)
    llm = LLM(checkpoint(ASYMMETRIC), **OPTIONS)
    llm.update_weights(checkpoint_tensors(ASYMMETRIC, None))
    assert [o.outputs[0].token_ids for o in llm.generate(_prompts(want), GREEDY, use_tqdm=False)] == want["outputs"]
    convert(checkpoint(ASYMMETRIC), str(tmp_path / "converted"))
    converted = LLM(str(tmp_path / "converted"), **OPTIONS)
    assert converted.engine.core.runner.params["layers"]["wq"]["zero"].dtype == jnp.int8
    outputs = converted.generate(_prompts(want), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want["outputs"]
    os.makedirs(tmp_path / "missing")
    tensors = checkpoint_tensors(ASYMMETRIC, str(tmp_path / "missing"))
    del tensors["model.layers.1.mlp.up_proj.weight_zero_point"]
    save_file(tensors, os.path.join(str(tmp_path / "missing"), "model.safetensors"))
    with pytest.raises(ValueError, match="asymmetric int4 but the checkpoint has no .*up_proj.weight_zero_point"):
        LLM(str(tmp_path / "missing"), **OPTIONS)


@pytest.mark.parametrize("tensor_parallel_size", [1, 4])
def test_an_awq_checkpoint_matches_hugging_face(tensor_parallel_size):
    """qwen2 (Qwen2.5's architecture, q/k/v biases in float) in AutoAWQ's GEMM form, groups of 16: alone, and over
    four devices (the 2 KV heads repeated to 4 with their scales and zero points)."""
    llm = LLM(checkpoint(AWQ), tensor_parallel_size=tensor_parallel_size, **OPTIONS)
    spec = llm.engine.core.spec
    assert (spec.checkpoint_format, spec.checkpoint_zero_points, spec.checkpoint_weight_block) == ("awq", True,
                                                                                                      (1, 16))
    wk = llm.engine.core.runner.params["layers"]["wk"]  # KV heads' columns: their zero points repeated as theirs
    assert wk["zero"].shape == wk["scale"].shape == (2, 4, wk["weight"].shape[-1])
    assert_serves_hf_outputs(llm, AWQ)


def test_an_awq_mixture_of_experts_matches_hugging_face():
    """Every expert's projections in AWQ's form, the experts split over two devices by their inner size."""
    llm = LLM(checkpoint(AWQ_MOE), tensor_parallel_size=2, **OPTIONS)
    assert llm.engine.core.runner.params["layers"]["w_up"]["zero"].shape == (2, 8, 4, 32)  # (L, E, 64 / 16, I)
    assert_serves_hf_outputs(llm, AWQ_MOE)


def test_the_awq_view_reads_awq_tensors_as_the_asymmetric_form():
    """AWQ's words (packed along the outputs in AWQ's order, unsigned) read as compressed-tensors' asymmetric form of
    the same weight: the same packed bytes (any slice) and zero points, the float16 scales as float32."""
    weight = np.random.default_rng(2).standard_normal((32, 64)).astype(np.float32) + 0.3
    awq, asymmetric = quantize_awq(weight, 16), quantize_int4(weight, 16, symmetric=False)
    assert awq["qweight"].shape == (64, 4) and awq["qzeros"].shape == (4, 4) and awq["scales"].dtype == np.float16
    view = AwqGemm(TensorMapping({"x." + key: value for key, value in awq.items()}))
    assert np.array_equal(view.get("x.weight_packed"), asymmetric["weight_packed"])
    assert np.array_equal(view.get("x.weight_packed", (slice(3, 19), slice(1, 5))),
                          asymmetric["weight_packed"][3:19, 1:5])
    assert np.array_equal(view.get("x.weight_zero_point"), asymmetric["weight_zero_point"])
    assert np.array_equal(view.get("x.weight_scale"), asymmetric["weight_scale"].astype(np.float16).astype(np.float32))
    assert list(view.get("x.weight_shape")) == [32, 64] and "x.weight_zero_point" in view and "x.bias" not in view
    assert PackedInt4(view).shape("x.weight") == (32, 32)


@pytest.mark.parametrize("quantization_config, message", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "AWQ bits 8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point false"),
    ({"quant_method": "awq", "bits": 4, "group_size": -1}, "group_size must be a positive integer"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "modules_to_not_convert": ["visual"]},
     "modules_to_not_convert lists layers"),
])
def test_awq_settings_jaxserve_does_not_read_are_refused(quantization_config, message):
    with pytest.raises(ValueError, match=message):
        spec_from_hf_config(tiny_llama_config(quantization_config=quantization_config))


def test_a_missing_scale_is_named(tmp_path):
    tensors = checkpoint_tensors(NAME, str(tmp_path))
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, os.path.join(str(tmp_path), "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj.weight_scale"):
        LLM(str(tmp_path), **OPTIONS)
    with open(os.path.join(checkpoint(NAME), "config.json")) as f:
        assert json.load(f)["quantization_config"]["ignore"] == ["lm_head"]


def test_a_converted_folder_keeps_the_packed_weights(tmp_path):
    """`jaxserve convert` saves the packed bytes and group scales as loaded; the folder serves the same tokens."""
    from jaxserve.model.checkpoint import convert

    want = expected(NAME)
    assert convert(checkpoint(NAME), str(tmp_path / "converted"))["quantization"] == "int4"
    converted = LLM(str(tmp_path / "converted"), **OPTIONS)
    assert converted.engine.core.runner.params["layers"]["wq"]["weight"].dtype == jnp.uint8
    outputs = converted.generate(_prompts(want), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want["outputs"]
