"""gpt-oss's MXFP4 checkpoint (openai/gpt-oss-20b and -120b: each expert projection X as `X_blocks`, FP4 e2m1 codes
two to a byte, and `X_scales`, a power-of-two scale per 32 inputs; quant_method mxfp4) is served by dequantizing the
experts as they load (model/loader.py's Mxfp4Experts view), and gives what transformers gives from the same folder
with Mxfp4Config(dequantize=True) (scripts/make_quantized_fixtures.py), over one device and two; the engine's
`quantization` int8 / fp8 then quantizes the dequantized experts as a float checkpoint's.
"""

from __future__ import annotations

import json
import os

import jax
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
)
from jaxserve import LLM, SamplingParams
from jaxserve.bench.quantized_checkpoint import quantize_mxfp4
from jaxserve.config import EngineConfig
from jaxserve.model.checkpoint import load_weights
from jaxserve.model.loader import Mxfp4Experts, SafetensorsFolder, TensorMapping, check_source
from jaxserve.model.quantize import quantize_weight
from jaxserve.sharding import make_mesh
from jaxserve.model.registry import load_model_spec, spec_from_hf_config

NAME = "gpt-oss-mxfp4"
OPTIONS = small_engine_args(page_size=8, num_pages=40, max_num_seqs=48, skip_precompile=True)  # test_engine_vs_hf.py's
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
EXPERTS = [f"model.layers.{i}.mlp.experts.{projection}" for i in range(2) for projection in ("gate_up_proj",
                                                                                            "down_proj")]


def reference_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(E, in, out) float64 of MXFP4 `blocks` (E, out, in / 32, 16) and `scales` (E, out, in / 32), written from the
    format's description alone: input j of output row o is the e2m1 code in byte (j % 32) // 2 of block j // 32 (low
    nibble for even j), a sign bit, two exponent bits (bias 1; 0: subnormal, half the mantissa bit) and a mantissa
    bit, times 2 ** (the block's scale byte - 127)."""
    def e2m1(code: int) -> float:
        sign, exponent, mantissa = -1.0 if code & 8 else 1.0, (code >> 1) & 3, code & 1
        return sign * (mantissa / 2 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2))

    table = np.array([e2m1(code) for code in range(16)])
    experts, out, groups, _ = blocks.shape
    result = np.empty((experts, groups * 32, out))
    for j in range(groups * 32):
        byte = blocks[:, :, j // 32, (j % 32) // 2].astype(np.int64)  # (E, out)
        code = byte & 0xF if j % 2 == 0 else byte >> 4
        result[:, j, :] = table[code] * 2.0 ** (scales[:, :, j // 32].astype(np.int64) - 127)
    return result


def fixture_experts() -> dict[str, np.ndarray]:
    """Each expert projection of the fixture as the reference dequantizes it, (E, in, out) float32."""
    stored = SafetensorsFolder(checkpoint(NAME))
    return {name: reference_dequantize(stored.get(name + "_blocks"), stored.get(name + "_scales")).astype(np.float32)
            for name in EXPERTS}


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_an_mxfp4_checkpoint_matches_hugging_face(tensor_parallel_size):
    """The experts dequantized into float32 params (the checkpoint's dtype), each expert split by its inner size over
    two devices (gate_up_proj's columns: each device reads its rows of the blocks; down_proj's rows: its inputs, 16
    of each block of 32); the same tokens as transformers. Over two devices, update_weights then takes the float
    gpt-oss fixture's tensors by name (the view reads a name the source has as stored: its outputs) and the MXFP4
    ones again (the blocks and scales through the view: back to these outputs), checked by name first."""
    llm = LLM(checkpoint(NAME), tensor_parallel_size=tensor_parallel_size, **OPTIONS)
    spec = llm.engine.core.spec
    assert (spec.checkpoint_format, spec.checkpoint_quantization) == ("mxfp4", "none")
    layers = llm.engine.core.runner.params["layers"]
    want = fixture_experts()
    for leaf, projection in (("w_gate_up", "gate_up_proj"), ("w_down", "down_proj")):
        stacked = np.stack([want[f"model.layers.{i}.mlp.experts.{projection}"] for i in range(2)])
        assert layers[leaf].dtype == jnp.float32 and np.array_equal(np.asarray(layers[leaf]), stacked)
    if tensor_parallel_size == 1:
        assert_serves_hf_outputs(llm, NAME)
        return
    assert layers["w_gate_up"].sharding.spec == P(None, None, None, "model")
    assert layers["w_down"].addressable_shards[0].data.shape == (2, 4, 16, 64)
    prompts = [{"prompt_token_ids": p} for p in expected(NAME)["prompts"]]

    def greedy() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    assert greedy() == expected(NAME)["outputs"]
    llm.update_weights(checkpoint_tensors("gpt-oss", None))
    assert greedy() == expected("gpt-oss")["outputs"]
    llm.update_weights(checkpoint_tensors(NAME, None))
    assert greedy() == expected(NAME)["outputs"]


def test_the_engines_int8_and_fp8_quantize_the_dequantized_experts():
    """quantization int8 (served) and fp8 (loaded) quantize the dequantized experts as they would the float
    experts: per output channel of each expert, exactly quantize_weight's result."""
    want = fixture_experts()
    spec, mesh = load_model_spec(checkpoint(NAME)), make_mesh(1)
    for mode in ("int8", "fp8"):
        config = EngineConfig(model=checkpoint(NAME), quantization=mode)
        params, _ = load_weights(config, checkpoint(NAME), spec, mesh, spec.num_kv_heads)
        for leaf, projection in (("w_gate_up", "gate_up_proj"), ("w_down", "down_proj")):
            stacked = np.stack([want[f"model.layers.{i}.mlp.experts.{projection}"] for i in range(2)])
            quantized = jax.tree.map(np.asarray, quantize_weight(jnp.asarray(stacked), mode))
            got = params["layers"][leaf]
            assert got["weight"].dtype == quantized["weight"].dtype and got["scale"].shape == (2, 4, stacked.shape[-1])
            assert np.array_equal(np.asarray(got["weight"]).astype(np.float32),
                                  quantized["weight"].astype(np.float32))
            assert np.array_equal(np.asarray(got["scale"]), quantized["scale"])
    llm = LLM(checkpoint(NAME), quantization="int8", **OPTIONS)
    assert llm.engine.core.runner.params["layers"]["w_down"]["weight"].dtype == jnp.int8
    prompt = expected(NAME)["prompts"][2]
    (result,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4,
                                                                             ignore_eos=True), use_tqdm=False)
    assert len(result.outputs[0].token_ids) == 4


def test_the_view_dequantizes_as_the_format_says():
    """The fixture's experts and random blocks over a wide range of scales read exactly as the reference
    transcription (bfloat16 holds them exactly), whole or any slice: experts, inputs across and within blocks, output
    rows, with steps; names the checkpoint has read as stored."""
    stored = SafetensorsFolder(checkpoint(NAME))
    view = Mxfp4Experts(stored)
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        reference = reference_dequantize(stored.get(name + "_blocks"), stored.get(name + "_scales"))
        got = view.get(name)
        assert name in view and name not in stored and got.dtype == jnp.bfloat16 and view.shape(name) == got.shape
        assert np.array_equal(got.astype(np.float64), reference)
        part = (slice(1, 3), slice(5, 29), slice(3, 17))
        assert np.array_equal(view.get(name, part).astype(np.float64), reference[part])
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 10, 3, 16), dtype=np.uint8)
    scales = rng.integers(0, 253, (3, 10, 3), dtype=np.uint8)  # 2^-127..2^125: 6 * 2^125 is still finite
    scales[0, 0, 0], scales[1, 2, 1] = 0, 252
    view = Mxfp4Experts(TensorMapping({"x_blocks": blocks, "x_scales": scales, "x_bias": np.ones(3)}))
    reference = reference_dequantize(blocks, scales)
    assert view.shape("x") == (3, 96, 10) and np.array_equal(view.get("x").astype(np.float64), reference)
    for part in [(slice(2, 3), slice(40, 90), slice(None)), (slice(None), slice(33, 35), slice(4, 5)),
                 (slice(None, None, 2), slice(7, 80, 3), slice(1, 9, 4)), (slice(1, 2), slice(50, 50), slice(None))]:
        assert np.array_equal(view.get("x", part).astype(np.float64), reference[part]), part
    assert np.array_equal(view.get("x_bias"), np.ones(3)) and "y" not in view


def test_our_writer_picks_the_smallest_scale_that_fits_and_rounds_to_nearest():
    """quantize_mxfp4: each block's scale the smallest power of two under which its largest magnitude is at most 6
    (an exact fit kept; one just above goes up), values rounded to the nearest FP4 value, ties to the even code;
    under OCP's rule the largest magnitude over the scale lies in [4, 8), clamped to 6."""
    weight = np.zeros((1, 64, 2), np.float32)  # (E, in, out): output 0's two blocks, then output 1's
    weight[0, :8, 0] = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]  # the ties, the block's max fitting exactly
    weight[0, 8:12, 0] = [-0.3, -5.2, 2.9, 0.1]
    weight[0, 32:34, 0] = [6.5, -1.0]  # 6.5 > 6: scale 2
    weight[0, :32, 1] = np.linspace(-1.0, 0.9, 32)  # largest 1: scale 2^-2 (1 / 0.25 = 4 <= 6)
    tensors = quantize_mxfp4(weight)
    assert tensors["blocks"].shape == (1, 2, 2, 16) and tensors["scales"].tolist() == [[[127, 128], [125, 0]]]
    got = reference_dequantize(tensors["blocks"], tensors["scales"])
    assert got[0, :12, 0].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.5, -6.0, 3.0, 0.0]
    assert got[0, 32:34, 0].tolist() == [6.0, -1.0]  # over a scale of 2: 3.25 -> 3, -0.5
    assert np.all(np.abs(got[0, :32, 1] - weight[0, :32, 1]) <= 0.5 * 0.25)  # half a step (up to 1) at scale 1/4
    ocp = quantize_mxfp4(weight, "ocp")
    assert ocp["scales"].tolist() == [[[127, 127], [125, 0]]]  # floor(log2(max)) - 2: 0, 0 and -2
    assert reference_dequantize(ocp["blocks"], ocp["scales"])[0, 32, 0] == 6.0  # 6.5 clamped


def _broken_copy(folder, change) -> str:
    """The fixture in `folder` with `change` applied to its tensors (a dict, changed in place; contiguous arrays:
    safetensors' numpy save_file writes an array's memory as it lies, whatever its strides)."""
    tensors = checkpoint_tensors(NAME, str(folder))
    change(tensors)
    save_file(tensors, os.path.join(str(folder), "model.safetensors"))
    return str(folder)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("model.layers.1.mlp.experts.down_proj_scales"),
     "has model.layers.1.mlp.experts.down_proj_blocks but not model.layers.1.mlp.experts.down_proj_scales"),
    (lambda t: t.pop("model.layers.0.mlp.experts.gate_up_proj_blocks"),
     "has model.layers.0.mlp.experts.gate_up_proj_scales but not model.layers.0.mlp.experts.gate_up_proj_blocks"),
    (lambda t: t.update({"model.layers.0.mlp.experts.down_proj_scales":
                         np.ascontiguousarray(t["model.layers.0.mlp.experts.down_proj_scales"][:, :60])}),
     r"model.layers.0.mlp.experts.down_proj_blocks has shape \(4, 64, 1, 16\) and "
     r"model.layers.0.mlp.experts.down_proj_scales \(4, 60, 1\)"),
    (lambda t: t.update({"model.layers.1.mlp.experts.gate_up_proj_blocks":
                         t["model.layers.1.mlp.experts.gate_up_proj_blocks"].reshape(4, 64, 4, 8)}),
     r"model.layers.1.mlp.experts.gate_up_proj_blocks has shape \(4, 64, 4, 8\)"),
    (lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj_blocks":
                         t["model.layers.0.mlp.experts.gate_up_proj_blocks"].view(np.int8)}),
     "model.layers.0.mlp.experts.gate_up_proj_blocks is int8, not uint8"),
], ids=["no-scales", "no-blocks", "scales-shape", "blocks-shape", "blocks-dtype"])
def test_a_broken_mxfp4_checkpoint_is_a_value_error_naming_the_tensor(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        LLM(_broken_copy(tmp_path, change), **OPTIONS)


def test_blocks_of_the_wrong_size_do_not_fit_the_served_model(tmp_path):
    """Blocks and scales that agree but dequantize to the wrong shape (half of gate_up_proj's output rows) fail the
    check made before a weight update reads anything."""
    def halve(tensors: dict) -> None:
        for part in ("_blocks", "_scales"):
            name = "model.layers.1.mlp.experts.gate_up_proj" + part
            tensors[name] = np.ascontiguousarray(tensors[name][:, :32])

    spec = load_model_spec(checkpoint(NAME))
    folder = SafetensorsFolder(_broken_copy(tmp_path, halve))
    with pytest.raises(ValueError, match=r"weight 'model.layers.1.mlp.experts.gate_up_proj' has shape \(4, 64, 32\), "
                                         r"which does not fit the served model \(it needs \(4, 64, 64\)\)"):
        check_source(folder, spec, spec.num_kv_heads, 1)
    check_source(SafetensorsFolder(checkpoint(NAME)), spec, spec.num_kv_heads, 2)


@pytest.mark.parametrize("name", ["llama", "qwen3-moe", "gemma2"])
def test_mxfp4_is_refused_for_other_architectures(name):
    with open(os.path.join(checkpoint(name), "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    with pytest.raises(ValueError, match="quant_method 'mxfp4' .* is read for GptOssForCausalLM only"):
        spec_from_hf_config(config)
