"""Weight-only quantization (issue 16, first part): jaxserve/model/quantize.py and bench/quality.py.

The formats' rounding is checked per element; a quantized matmul against the dequantized weight; the
teacher-forced scorer against Hugging Face's logits; then quality against the unquantized model, per mode,
on a test checkpoint (random weights, 64 wide: the worst case) and the bundled model (trained), with
thresholds from what the formats should reach:

- int8 with a scale per output channel rounds each weight to within 1/254 of its channel's largest: on a
  trained model that is lossless in practice (top-1 agreement >= 97%, mean KL <= 1e-3 nats);
- fp8 e4m3 keeps 3 mantissa bits (rounding up to 1/16 of a weight), about 16x coarser: top-1 >= 93%,
  mean KL <= 1e-2 on the trained model;
- a random 64-wide model has no redundancy to absorb the noise: 10x looser KL and a lower top-1 bar (int8
  90%, fp8 75%).

The engine runs quantized weights end to end (greedy close to the float engine, nothing compiled after
warm-up) and shards them like the float weights under tensor parallelism (TP 2 gives TP 1's tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    checkpoint,
    checkpoint_tensors,
    expected,
    greedy_outputs_compiling_nothing,
    small_engine_args,
    tiny_llama_config,
)

from jaxserve import LLM, SamplingParams
from jaxserve.bench.quality import compare_distributions, next_token_logprobs, scoring_runner, source_prompts
from jaxserve.engine.llm_engine import default_model_path
from jaxserve.model.loader import load_params
from jaxserve.model.quantize import FORMATS, dequantize, linear, quantize_params, quantize_weight, weight_bytes
from jaxserve.model.registry import load_model_spec, quantizable_paths, spec_from_hf_config
from jaxserve.sharding import cache_kv_heads, make_mesh

THRESHOLDS = {  # (model, mode) -> (least top-1 agreement, largest mean KL in nats)
    ("llama", "int8"): (0.90, 1e-2), ("llama", "fp8"): (0.75, 1e-1),
    ("llama", "fp8-kv"): (0.75, 1e-1), ("llama", "fp8+fp8-kv"): (0.70, 2e-1),
    ("bundled", "int8"): (0.97, 1e-3), ("bundled", "fp8"): (0.93, 1e-2),
    ("bundled", "fp8-kv"): (0.93, 1e-2), ("bundled", "fp8+fp8-kv"): (0.90, 2e-2),
}
MODES = {  # mode -> (weight quantization, kv_cache_dtype)
    "none": ("none", "auto"), "int8": ("int8", "auto"), "fp8": ("fp8", "auto"), "fp8-kv": ("none", "fp8"),
    "fp8+fp8-kv": ("fp8", "fp8"),
}


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_each_weight_rounds_to_within_the_formats_step(mode):
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(3, 64, 48)).astype(np.float32) * rng.uniform(0.01, 3.0, size=(3, 1, 48))  # (L, in, out)
    weight[1, :, 5] = 0.0  # an all-zero channel
    quantized = quantize_weight(jnp.asarray(weight), mode)
    dtype, largest = FORMATS[mode]
    assert quantized["weight"].dtype == dtype and quantized["scale"].shape == (3, 48)
    scale = np.asarray(quantized["scale"])
    np.testing.assert_allclose(scale, np.where(weight.max(1) > 0, np.abs(weight).max(1) / largest, 1.0), rtol=1e-6)
    error = np.abs(np.asarray(dequantize(quantized, jnp.float32)) - weight)
    if mode == "int8":  # half a step of the channel's scale
        assert np.all(error <= scale[:, None, :] * 0.5 * (1 + 1e-5))
    else:  # e4m3: 3 mantissa bits (half a step: 1/16 of the value), subnormals spaced 2^-9 of the scale
        assert np.all(error <= np.maximum(np.abs(weight) / 16, scale[:, None, :] * 2.0**-10) * (1 + 1e-5))
    assert np.all(np.asarray(dequantize(quantized, jnp.float32))[1, :, 5] == 0)


@pytest.mark.parametrize("mode", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_quantized_matmul_is_the_matmul_with_the_dequantized_weight(mode, dtype):
    rng = np.random.default_rng(1)
    quantized = quantize_weight(jnp.asarray(rng.normal(size=(64, 32)), jnp.float32), mode)
    x = jnp.asarray(rng.normal(size=(5, 64)), dtype)
    got = linear(x, quantized)
    want = jnp.dot(x.astype(jnp.float32), dequantize(quantized, jnp.float32))
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want),
                               rtol=2e-2 if dtype == jnp.bfloat16 else 1e-5,
                               atol=2e-2 if dtype == jnp.bfloat16 else 1e-5)


@pytest.fixture(scope="module")
def scored():
    """model -> mode -> next-token log-probabilities over its prompt set."""
    models = {"llama": (checkpoint("llama"), expected("llama")["prompts"]),
              "bundled": (default_model_path(), source_prompts(default_model_path(), 6, 100))}
    return {name: {mode: next_token_logprobs(scoring_runner(path, *MODES[mode]), prompts) for mode in MODES}
            for name, (path, prompts) in models.items()}


def test_the_scorer_gives_hugging_faces_next_token_distribution(scored):
    want = expected("llama")["logits"]  # (12, V): HF's logits after each whole prompt
    for logprobs, logits in zip(scored["llama"]["none"], want):
        hf = logits - np.logaddexp.reduce(logits.astype(np.float64))
        np.testing.assert_allclose(logprobs[-1], hf, atol=1e-4)


@pytest.mark.parametrize("model, mode", sorted(THRESHOLDS))
def test_quantized_quality_against_the_float_model(scored, model, mode):
    least_top1, most_kl = THRESHOLDS[model, mode]
    quality = compare_distributions(scored[model]["none"], scored[model][mode])
    assert quality["top1_agreement"] >= least_top1, quality
    assert quality["mean_kl"] <= most_kl, quality


def test_linear_weights_take_half_the_bytes_of_bfloat16():
    spec = load_model_spec(checkpoint("llama"))
    params = load_params(checkpoint("llama"), spec, make_mesh(1), jnp.bfloat16, cache_kv_heads(spec, 1))
    linear_bytes = weight_bytes({name: params["layers"][name] for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up",
                                                                          "w_down")})
    for mode in ("int8", "fp8"):
        quantized = quantize_params(jax.tree_util.tree_map(jnp.copy, params), mode, quantizable_paths(spec))["layers"]
        scales = sum(quantized[name]["scale"].nbytes for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
        assert weight_bytes({name: quantized[name]["weight"] for name in quantized if isinstance(quantized[name], dict)}
                            ) == linear_bytes // 2
        assert scales * 32 <= linear_bytes  # one float32 per output channel: 2 / in of the bf16 bytes, in >= 64


@pytest.fixture(scope="module")
def engines():
    args = small_engine_args(max_num_seqs=8, max_num_batched_tokens=32, num_pages=32, skip_precompile=False)
    return {(mode, tp): LLM(checkpoint("llama"), quantization=mode, tensor_parallel_size=tp, **args)
            for mode, tp in (("none", 1), ("int8", 1), ("fp8", 1), ("int8", 2))}


def test_the_engine_serves_quantized_weights(engines):
    outputs = greedy_outputs_compiling_nothing(engines)
    first = {key: np.mean([a[0] == b[0] for a, b in zip(out, outputs["none", 1])]) for key, out in outputs.items()}
    assert first["int8", 1] >= 0.75 and first["fp8", 1] >= 0.5, first
    assert outputs["int8", 2] == outputs["int8", 1], "TP 2 must give TP 1's tokens"


def test_an_unknown_quantization_is_refused():
    from jaxserve.config import EngineConfig

    with pytest.raises(ValueError, match="quantization must be one of none, int8, fp8"):
        EngineConfig(quantization="awq")


def _write_fp8_checkpoint(folder, strategy: str, name: str = "llama") -> None:
    """A test checkpoint in compressed-tensors fp8 form: every linear weight (each expert's too) float8_e4m3fn
    (out, in) with a float32 `weight_scale`, (out, 1) per channel (the recipe quantize_weight uses) or one per
    tensor."""
    import json
    import os

    import ml_dtypes
    from safetensors.numpy import save_file

    weights = checkpoint_tensors(name, folder)
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for tensor in [n for n in weights if n.split(".")[-2] in projections]:
        weight = weights[tensor].astype(np.float32)  # (out, in)
        absmax = np.abs(weight).max(axis=1, keepdims=True) if strategy == "channel" else np.abs(weight).max()
        scale = np.where(absmax > 0, absmax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
        weights[tensor] = np.clip(weight / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        weights[tensor + "_scale"] = np.asarray(scale, np.float32).reshape(-1, 1) if strategy == "channel" else (
            np.asarray([scale], np.float32))
    save_file(weights, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(checkpoint(name), "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {"type": "float", "num_bits": 8, "strategy": strategy}}}}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def test_an_fp8_checkpoint_is_served_as_it_is(engines, tmp_path):
    """Read as-is, a compressed-tensors fp8 checkpoint made with quantize_weight's recipe gives the tokens of the
    float checkpoint quantized to fp8 at load time; with one scale per tensor it loads too."""
    channel, tensor = tmp_path / "channel", tmp_path / "tensor"
    channel.mkdir(), tensor.mkdir()
    _write_fp8_checkpoint(str(channel), "channel")
    _write_fp8_checkpoint(str(tensor), "tensor")
    prompts = [{"prompt_token_ids": p} for p in expected("llama")["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(channel), **small_engine_args(max_num_seqs=8, max_num_batched_tokens=32, num_pages=32,
                                                skip_precompile=True))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in engines["fp8", 1].generate(prompts, params, use_tqdm=False)]
    assert got == want
    spec = load_model_spec(str(tensor))
    layers = load_params(str(tensor), spec, make_mesh(1), jnp.float32, cache_kv_heads(spec, 1))["layers"]
    scale = np.asarray(layers["wq"]["scale"])  # (L, out): one value per layer, broadcast over the channels
    assert layers["wq"]["weight"].dtype == jnp.float8_e4m3fn and np.all(scale == scale[:, :1])
    with pytest.raises(ValueError, match="already fp8"):
        LLM(str(channel), quantization="int8", **small_engine_args())
    from jaxserve.model.checkpoint import convert

    assert convert(str(channel), str(tmp_path / "converted"))["quantization"] == "fp8"  # kept fp8 as loaded


def test_an_fp8_mixture_of_experts_checkpoint_is_served_as_it_is(tmp_path):
    """Every expert's projections in compressed-tensors fp8 (one scale per channel) give the tokens of the float
    checkpoint quantized to fp8 at load time, the experts split over two devices too."""
    _write_fp8_checkpoint(str(tmp_path), "channel", "qwen3-moe")
    prompts = [{"prompt_token_ids": p} for p in expected("qwen3-moe")["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    options = small_engine_args(max_num_seqs=16, max_num_batched_tokens=32, num_pages=40, skip_precompile=True)
    loaded = LLM(checkpoint("qwen3-moe"), quantization="fp8", **options)
    want = [o.outputs[0].token_ids for o in loaded.generate(prompts, params, use_tqdm=False)]
    for tensor_parallel_size in (1, 2):
        llm = LLM(str(tmp_path), tensor_parallel_size=tensor_parallel_size, **options)
        assert llm.engine.core.runner.params["layers"]["w_up"]["scale"].shape == (2, 8, 32)  # (L, E, I)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want


@pytest.mark.parametrize("quantization_config, message", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),  # AWQ and GPTQ are read
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8,
                                                                                "strategy": "channel"}}}},
     "has weights"),  # int8 weights (W8A16); int4 ones are read (tests/test_int4_checkpoint.py)
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4,
                                                                                "strategy": "group"}}}},
     "int4 weights in format None"),  # packed is the form read
])
def test_unsupported_checkpoint_quantization_is_refused(quantization_config, message):
    with pytest.raises(ValueError, match=message):
        spec_from_hf_config(tiny_llama_config(quantization_config=quantization_config))
