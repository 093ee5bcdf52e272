"""An fp8 checkpoint with block-wise scales (Qwen3-FP8's and DeepSeek's form: `weight_block_size`, a float32
`weight_scale_inv` per block of each float8_e4m3fn weight) is served as it is stored, and gives what Hugging Face
transformers gives from the same folder (scripts/make_quantized_fixtures.py: it dequantizes the blocks at load).
compressed-tensors' block strategy reads the same; tensor parallelism splits the scales with the weights.
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
from jaxserve.model.loader import load_params
from jaxserve.model.quantize import dequantize, linear
from jaxserve.sharding import cache_kv_heads, make_mesh
from jaxserve.model.registry import load_model_spec, spec_from_hf_config

NAME, MOE = "qwen3-fp8-block", "qwen3-moe-fp8-block"
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _prompts(want: dict) -> list[dict]:
    return [{"prompt_token_ids": p} for p in want["prompts"]]


@pytest.fixture(scope="module")
def llm():
    return LLM(checkpoint(NAME), **small_engine_args(num_pages=40, page_size=8, max_num_seqs=16,
                                                     skip_precompile=True))


def test_greedy_tokens_and_first_logprobs_match_hugging_face(llm):
    layers = llm.engine.core.runner.params["layers"]
    assert layers["wq"]["weight"].dtype == jnp.float8_e4m3fn
    assert layers["wo"]["scale"].shape == (2, 2, 64)  # (L, in / 64 columns, out): grouped, not one per channel
    assert_serves_hf_outputs(llm, NAME)


def test_a_weight_update_reads_the_blocks_again(llm):
    """update_weights (reinforcement learning's rollouts) takes the checkpoint's fp8 weights and block scales by
    their names, in place: new scales change the tokens, the stored ones bring them back."""
    want = expected(NAME)
    tensors = checkpoint_tensors(NAME, None)
    doubled = {name: tensor * 2 if name.endswith("down_proj.weight_scale_inv") else tensor
               for name, tensor in tensors.items()}
    for source, same in ((doubled, False), (tensors, True)):
        llm.update_weights(source)
        outputs = llm.generate(_prompts(want), GREEDY, use_tqdm=False)
        assert ([o.outputs[0].token_ids for o in outputs] == want["outputs"]) is same


def _compressed_tensors_copy(folder: str) -> None:
    """The fixture in compressed-tensors' FP8_BLOCK form: `weight_scale` for `weight_scale_inv`, strategy block."""
    tensors = checkpoint_tensors(NAME, folder)
    renamed = {name.replace("_scale_inv", "_scale"): tensor for name, tensor in tensors.items()}
    save_file(renamed, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    block = config["quantization_config"]["weight_block_size"]
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "type": "float", "num_bits": 8, "strategy": "block", "block_structure": block}}}}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def test_compressed_tensors_blocks_and_tensor_parallelism_give_the_same_tokens(llm, tmp_path):
    want = expected(NAME)
    _compressed_tensors_copy(str(tmp_path))
    options = small_engine_args(num_pages=40, page_size=8, max_num_seqs=16, skip_precompile=True)
    for path, tensor_parallel_size in ((str(tmp_path), 1), (checkpoint(NAME), 2)):
        other = LLM(path, tensor_parallel_size=tensor_parallel_size, **options)
        outputs = other.generate(_prompts(want), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == want["outputs"], (path, tensor_parallel_size)
        del other


def test_blocks_that_do_not_split_over_the_devices_are_refused():
    """o_proj's 128 input rows are 2 blocks of 64: 4 devices cannot each take whole blocks."""
    spec = load_model_spec(checkpoint(NAME))
    with pytest.raises(ValueError, match="2 blocks of 64 input rows do not split over 4 devices"):
        load_params(checkpoint(NAME), spec, make_mesh(4), jnp.float32, cache_kv_heads(spec, 4))


def test_partial_row_blocks_scale_their_own_rows(tmp_path):
    """A weight whose output size is not a multiple of the block rows (DeepSeek's kernels allow it; the fixture's
    shapes divide evenly): the last, short block of rows takes its own scale."""
    tensors = checkpoint_tensors(NAME, str(tmp_path))
    name = "model.layers.0.self_attn.k_proj.weight"  # (64, 64): rows 48 + 16 with blocks of (48, 64)
    weight = np.asarray(tensors[name], np.float32)
    scales = np.array([[0.5], [2.0]], np.float32)  # (ceil(64 / 48), 64 / 64)
    tensors[name + "_scale_inv"] = scales
    with open(os.path.join(str(tmp_path), "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["weight_block_size"] = [48, 64]
    for layer in range(2):  # every other weight's scales: all 1, in blocks of (48, 64)
        for module, rows, columns in (("self_attn.q_proj", 128, 64), ("self_attn.v_proj", 64, 64),
                                      ("self_attn.o_proj", 64, 128), ("mlp.gate_proj", 128, 64),
                                      ("mlp.up_proj", 128, 64), ("mlp.down_proj", 64, 128),
                                      ("self_attn.k_proj", 64, 64)):
            key = f"model.layers.{layer}.{module}.weight_scale_inv"
            if key != name + "_scale_inv":
                tensors[key] = np.ones((-(-rows // 48), columns // 64), np.float32)
    save_file(tensors, os.path.join(str(tmp_path), "model.safetensors"))
    with open(os.path.join(str(tmp_path), "config.json"), "w") as f:
        json.dump(config, f)
    spec = load_model_spec(str(tmp_path))
    layers = load_params(str(tmp_path), spec, make_mesh(1), jnp.float32, cache_kv_heads(spec, 1))["layers"]
    wk = {"weight": layers["wk"]["weight"][0], "scale": layers["wk"]["scale"][0]}  # (in, out), (1, out)
    row_scales = np.where(np.arange(64) < 48, 0.5, 2.0).astype(np.float32)  # (out,)
    want = weight.T * row_scales[None, :]  # (in, out)
    np.testing.assert_array_equal(np.asarray(dequantize(wk, jnp.float32)), want)
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), wk)), x @ want, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("quantization_config, message", [
    ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
    ({"quant_method": "compressed-tensors", "config_groups": {
        "a": {"weights": {"type": "float", "num_bits": 8, "strategy": "block", "block_structure": [128, 128]}},
        "b": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}}, "mix block sizes"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128],
      "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate", "model.layers.0.self_attn.q_proj"]},
     r"modules_to_not_convert lists layers other than lm_head and the routers \(\['model.layers.0.self_attn"),
])
def test_malformed_block_configs_are_refused(quantization_config, message):
    with pytest.raises(ValueError, match=message):
        spec_from_hf_config(tiny_llama_config(quantization_config=quantization_config))


def test_scales_of_the_wrong_shape_are_refused(tmp_path):
    tensors = checkpoint_tensors(NAME, str(tmp_path))
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    tensors[name] = np.ones((1, 1), np.float32)
    save_file(tensors, os.path.join(str(tmp_path), "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj.weight_scale_inv has shape \(1, 1\)"):
        LLM(str(tmp_path), **small_engine_args(skip_precompile=True))


def test_a_converted_folder_keeps_the_block_scales(tmp_path):
    """`jaxserve convert` saves the fp8 weights and grouped scales as loaded; the folder serves the same tokens."""
    from jaxserve.model.checkpoint import convert

    want = expected(NAME)
    assert convert(checkpoint(NAME), str(tmp_path / "converted"))["quantization"] == "fp8"
    converted = LLM(str(tmp_path / "converted"), **small_engine_args(num_pages=40, page_size=8, max_num_seqs=16,
                                                                      skip_precompile=True))
    assert converted.engine.core.runner.params["layers"]["w_down"]["scale"].shape == (2, 2, 64)
    outputs = converted.generate(_prompts(want), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want["outputs"]


@pytest.mark.parametrize("tensor_parallel_size, enable_expert_parallel", [(1, False), (2, False), (2, True)])
def test_a_mixture_of_experts_checkpoint_matches_hugging_face(tensor_parallel_size, enable_expert_parallel):
    """Qwen3-30B-A3B-FP8's form: every expert's projections in blocks (of 16 here) with their scales, the router
    in float; alone, with each expert split over two devices (one block of down_proj's input rows each), and
    with the experts split whole (expert parallelism)."""
    want = expected(MOE)
    llm = LLM(checkpoint(MOE), tensor_parallel_size=tensor_parallel_size,
              enable_expert_parallel=enable_expert_parallel,
              **small_engine_args(num_pages=40, page_size=8, max_num_seqs=16, skip_precompile=True))
    down = llm.engine.core.runner.params["layers"]["w_down"]
    assert down["weight"].dtype == jnp.float8_e4m3fn and down["scale"].shape == (2, 8, 2, 64)  # (L, E, groups, H)
    outputs = llm.generate(_prompts(want), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want["outputs"]
