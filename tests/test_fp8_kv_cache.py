"""The fp8 KV cache (issue 16, `kv_cache_dtype: fp8`): jaxserve/attention/fp8.py and every attention backend.

- e4m3 rounding per element (within 1/16 of the value, or the subnormal step of the scale), saturation
  instead of NaN;
- every backend (the XLA path, its dense prefill glue, our Pallas kernels and JAX's TPU kernel, the last two
  in interpret mode) reading an fp8 pool with per-head scales gives what it gives over a float pool holding
  the dequantized K/V (the scales folded into q and the output are exact algebra): three steps of prefill,
  mixed and pure decode;
- the engine: twice the pages of a bf16 pool in the same memory, served with nothing compiled after warm-up
  and every page back, greedy tokens close to the float cache's, TP 2 giving TP 1's tokens;
- the checkpoint's k_scale / v_scale (one per layer or one per KV head) are read and repeated like the KV
  heads; a converted orbax folder keeps them; bad scales and bad values are refused.
Quality against the float cache (teacher-forced, per mode) is in tests/test_quantization.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import checkpoint, checkpoint_tensors, expected, greedy_outputs_compiling_nothing, small_engine_args
from safetensors.numpy import save_file

from jaxserve import LLM, SamplingParams
from jaxserve.attention import fp8, make_attention, xla
from jaxserve.attention.base import LayerAttention
from jaxserve.batch.builder import padded_batch_arrays
from jaxserve.batch.descriptor import BatchDescriptor
from jaxserve.config import EngineConfig
from jaxserve.model.checkpoint import convert, load_weights
from jaxserve.model.registry import load_model_spec
from jaxserve.model_spec import ModelSpec
from jaxserve.sharding import cache_kv_heads, make_mesh

PAGE_SIZE, NUM_PAGES, NUM_LAYERS, LAYER = 8, 16, 2, 1
# Three steps over three rows: (cached tokens, new tokens) per row: prefill, a mixed step, pure decode.
STEPS = [[(0, 11), (0, 5), (0, 17)], [(11, 1), (5, 6), (17, 1)], [(12, 1), (11, 1), (18, 1)]]


def test_each_value_rounds_to_within_e4m3s_step_and_saturates():
    rng = np.random.default_rng(0)
    scale = jnp.asarray([0.01, 0.5, 3.0], jnp.float32)  # (Hkv,)
    x = rng.normal(size=(64, 3, 16)) * np.asarray(scale)[None, :, None] * rng.uniform(0.001, 300, size=(64, 1, 16))
    x[0, :, 0] = 1e6  # far beyond 448 scales: saturates
    stored = fp8.quantize(jnp.asarray(x, jnp.float32), scale)
    assert stored.dtype == jnp.float8_e4m3fn
    back = np.asarray(stored, np.float32) * np.asarray(scale)[None, :, None]  # (T, Hkv, D)
    assert np.all(np.isfinite(back))
    np.testing.assert_allclose(back[0, :, 0], 448 * np.asarray(scale))
    inside = np.abs(x) <= 448 * np.asarray(scale)[None, :, None]
    error = np.abs(back - x)[inside]
    bound = np.maximum(np.abs(x) / 16, np.broadcast_to(np.asarray(scale)[None, :, None], x.shape) * 2.0**-10)[inside]
    assert np.all(error <= bound * (1 + 1e-5))


def test_scale_heads_multiplies_each_query_head_by_its_kv_heads_scale():
    q = jnp.ones((2, 6, 4), jnp.float32)  # (T, Hq, D): 3 query heads per KV head
    out = np.asarray(fp8.scale_heads(q, jnp.asarray([2.0, 5.0])))
    np.testing.assert_array_equal(out[0, :, 0], [2, 2, 2, 5, 5, 5])


def _spec(num_kv_heads: int = 2, group: int = 2, head_dim: int = 16) -> ModelSpec:
    base = load_model_spec(checkpoint("llama"))
    return dataclasses.replace(base, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               num_layers=NUM_LAYERS)


def _batch(rows: list[tuple[int, int]], num_tokens: int) -> BatchDescriptor:
    """A step over `rows` ((cached, new) tokens each), row r owning pages 1 + 4r .. 4 + 4r."""
    width = 4
    arrays = padded_batch_arrays(num_tokens, len(rows), width, PAGE_SIZE)
    start = 0
    for row, (cached, new) in enumerate(rows):
        pages = 1 + width * row + np.arange(width, dtype=np.int32)  # (W,)
        positions = cached + np.arange(new, dtype=np.int32)
        arrays["positions"][start:start + new] = positions
        arrays["slot_mapping"][start:start + new] = pages[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        arrays["page_table"][row] = pages
        arrays["seq_lens"][row] = cached + new
        start += new
        arrays["query_start_loc"][row + 1] = start
    arrays["num_seqs"] = np.asarray(len(rows), np.int32)
    return BatchDescriptor(**{name: jnp.asarray(value) for name, value in arrays.items()})


def _backends(spec: ModelSpec, cache_dtype):
    mesh = make_mesh(1)
    named = {name: make_attention(spec, name, mesh, PAGE_SIZE, platform="cpu", cache_dtype=cache_dtype)
             for name in ("xla", "pallas-interpret", "pallas-tpu-interpret")}
    named["xla dense prefill"] = xla.make_backend("cpu", prefill_implementation="xla")
    return named


@pytest.mark.parametrize("backend_name", ["xla", "xla dense prefill", "pallas-interpret", "pallas-tpu-interpret"])
def test_every_backend_reads_fp8_pages_as_the_dequantized_values(backend_name):
    spec = _spec()
    rng = np.random.default_rng(1)
    k_scale = jnp.asarray([0.02, 0.3], jnp.float32)  # (Hkv,)
    v_scale = jnp.asarray([0.5, 0.01], jnp.float32)
    quantized = _backends(spec, fp8.FP8_DTYPE)[backend_name]
    plain = _backends(spec, jnp.float32)[backend_name]
    shapes = quantized.cache_shapes(NUM_LAYERS, NUM_PAGES, PAGE_SIZE, spec.num_kv_heads, spec.head_dim)
    storage = quantized.storage_dtype(fp8.FP8_DTYPE)  # uint8 bits, or float8 on the TPU kernel's layout
    fp8_caches = tuple(jnp.zeros(shape, storage) for shape in shapes)
    float_caches = tuple(jnp.zeros(shape, jnp.float32) for shape in shapes)

    how = (LayerAttention(spec.head_dim**-0.5, spec.sliding_window),)

    def step(backend, kv_scales):
        return jax.jit(lambda c, q, k, v, b: fp8.write_and_attend(
            q, k, v, c, jnp.int32(LAYER), b, how, 0, kv_scales, attention=backend.attention,
            write_kv=backend.write_kv,
        ))

    run = {"fp8": step(quantized, (k_scale, v_scale)),
           "float": step(plain, None)}  # each compiles once: one shape for all steps
    num_tokens = max(sum(new for _, new in rows) for rows in STEPS) + 3  # at least three padded tokens
    for rows in STEPS:
        batch = _batch(rows, num_tokens)
        q = jnp.asarray(rng.normal(size=(num_tokens, spec.num_heads, spec.head_dim)), jnp.float32)  # (T, Hq, D)
        k = jnp.asarray(rng.normal(size=(num_tokens, 2, spec.head_dim)) * 40 * np.asarray(k_scale)[:, None],
                        jnp.float32)  # (T, Hkv, D)
        v = jnp.asarray(rng.normal(size=(num_tokens, 2, spec.head_dim)) * 40 * np.asarray(v_scale)[:, None],
                        jnp.float32)
        got, fp8_caches = run["fp8"](fp8_caches, q, k, v, batch)
        k_back = fp8.quantize(k, k_scale).astype(jnp.float32) * k_scale[:, None]  # what the pages stand for
        v_back = fp8.quantize(v, v_scale).astype(jnp.float32) * v_scale[:, None]
        want, float_caches = run["float"](float_caches, q, k_back, v_back, batch)
        real = int(batch.query_start_loc[-1])
        got, want = np.asarray(got), np.asarray(want)
        assert np.abs(got[:real] - want[:real]).max() <= 1e-5 * np.abs(want[:real]).max()
        assert (got[real:] == 0).all()
    assert all(cache.dtype == storage and cache.dtype.itemsize == 1 for cache in fp8_caches)


def test_tpu_kernel_refuses_an_odd_kv_head_count_in_fp8():
    with pytest.raises(ValueError, match="KV heads per device in a float8_e4m3fn cache"):
        make_attention(_spec(num_kv_heads=1, group=4), "pallas-tpu-interpret", make_mesh(1), PAGE_SIZE,
                       cache_dtype=fp8.FP8_DTYPE)


@pytest.fixture(scope="module")
def engines():
    args = small_engine_args(max_num_seqs=8, max_num_batched_tokens=32, num_pages=None, cpu_kv_cache_gib=2**-10,
                             dtype="bfloat16", skip_precompile=False)
    return {(kv, tp): LLM(checkpoint("llama"), kv_cache_dtype=kv, tensor_parallel_size=tp, **args)
            for kv, tp in (("auto", 1), ("fp8", 1), ("fp8", 2))}


def test_the_pool_holds_twice_the_pages_of_bfloat16_in_the_same_memory(engines):
    bf16, fp8_pool = engines["auto", 1].engine.core, engines["fp8", 1].engine.core
    assert bf16.runner.kv_caches[0].dtype == jnp.bfloat16 and fp8_pool.runner.cache_dtype == fp8.FP8_DTYPE
    assert fp8_pool.runner.kv_caches[0].dtype == jnp.uint8  # the e4m3 values' bits (attention/fp8.py)
    assert fp8_pool.runner.page_bytes() * 2 == bf16.runner.page_bytes()
    assert fp8_pool.num_pages in (2 * bf16.num_pages, 2 * bf16.num_pages + 1)


def test_the_engine_serves_an_fp8_cache(engines):
    outputs = greedy_outputs_compiling_nothing(engines)
    first = np.mean([a[0] == b[0] for a, b in zip(outputs["fp8", 1], outputs["auto", 1])])
    assert first >= 0.75, first
    assert outputs["fp8", 2] == outputs["fp8", 1], "TP 2 must give TP 1's tokens"


def _with_kv_scales(folder: str, k_scale, v_scale) -> None:
    """Add self_attn.k_scale / v_scale tensors (the same for every layer) to a copy of the llama checkpoint (a
    file of their own, named in the index)."""
    scales = {}
    for i in range(NUM_LAYERS):
        scales[f"model.layers.{i}.self_attn.k_scale"] = np.asarray(k_scale, np.float32)
        scales[f"model.layers.{i}.self_attn.v_scale"] = np.asarray(v_scale, np.float32)
    save_file(scales, os.path.join(folder, "kv-scales.safetensors"))
    index_path = os.path.join(folder, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"].update(dict.fromkeys(scales, "kv-scales.safetensors"))
    with open(index_path, "w") as f:
        json.dump(index, f)


def _load(folder: str, tp: int = 1, kv_cache_dtype: str = "fp8") -> dict:
    spec = load_model_spec(folder)
    config = EngineConfig(model=folder, kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tp)
    params, _ = load_weights(config, folder, spec, make_mesh(tp), cache_kv_heads(spec, tp))
    return params["layers"]


@pytest.mark.parametrize("k_scale, v_scale", [(0.05, 0.2), ([0.05, 0.07], [0.2, 0.3])])
def test_checkpoint_scales_are_read_and_repeated_like_the_kv_heads(tmp_path, k_scale, v_scale):
    folder = str(tmp_path / "model")
    shutil.copytree(checkpoint("llama"), folder)
    _with_kv_scales(folder, k_scale, v_scale)
    layers = _load(folder)
    np.testing.assert_allclose(np.asarray(layers["k_scale"]), np.broadcast_to(k_scale, (NUM_LAYERS, 2)))
    np.testing.assert_allclose(np.asarray(layers["v_scale"]), np.broadcast_to(v_scale, (NUM_LAYERS, 2)))
    assert "k_scale" not in _load(folder, kv_cache_dtype="auto")
    # four devices hold the two KV heads twice each: their scales repeat as the heads do
    repeated = np.asarray(_load(folder, tp=4)["k_scale"])
    np.testing.assert_allclose(repeated, np.repeat(np.broadcast_to(k_scale, (NUM_LAYERS, 2)), 2, axis=1))


def test_a_converted_folder_keeps_the_scales_and_gives_the_same_tokens(tmp_path):
    folder, converted = str(tmp_path / "model"), str(tmp_path / "converted")
    shutil.copytree(checkpoint("llama"), folder)
    _with_kv_scales(folder, [0.05, 0.07], [0.2, 0.3])
    metadata = convert(folder, converted, kv_cache_dtype="fp8")
    assert metadata["kv_cache_dtype"] == "fp8"
    np.testing.assert_allclose(np.asarray(_load(converted)["k_scale"]), np.asarray(_load(folder)["k_scale"]))
    args = small_engine_args(max_num_seqs=4, max_num_batched_tokens=32, num_pages=32, skip_precompile=True)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in expected("llama")["prompts"][:4]]
    tokens = [[o.outputs[0].token_ids for o in LLM(path, kv_cache_dtype="fp8", **args).generate(prompts, params,
                                                                                                use_tqdm=False)]
              for path in (folder, converted)]
    assert tokens[0] == tokens[1]


def test_bad_scales_and_values_are_refused(tmp_path):
    folder = str(tmp_path / "model")
    shutil.copytree(checkpoint("llama"), folder)
    _with_kv_scales(folder, [0.1, 0.2, 0.3], 0.1)
    with pytest.raises(ValueError, match="must hold one positive scale or one per KV head"):
        _load(folder)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        EngineConfig(kv_cache_dtype="int4")


def _rescaled_checkpoint(folder: str, factor: float) -> None:
    """The llama checkpoint with K and V `factor` times smaller and the queries and output projection `factor`
    times larger: the same model in float (scores and attention output unchanged), but K and V far below e4m3's
    smallest subnormal at scale 1.0."""
    tensors = checkpoint_tensors("llama", folder)
    for name in list(tensors):
        projection = name.split(".")[-2]
        if projection in ("k_proj", "v_proj"):
            tensors[name] = tensors[name] / factor
        elif projection in ("q_proj", "o_proj"):
            tensors[name] = tensors[name] * factor
    save_file(tensors, os.path.join(folder, "model.safetensors"))


def test_calibrated_scales_rescue_kv_outside_e4m3s_range(tmp_path):
    from jaxserve.bench.quality import compare_distributions, next_token_logprobs, scoring_runner

    folder = str(tmp_path / "tiny-kv")
    os.makedirs(folder)
    _rescaled_checkpoint(folder, 1e4)
    prompts = expected("llama")["prompts"]
    reference = next_token_logprobs(scoring_runner(checkpoint("llama")), prompts)
    plain = compare_distributions(reference, next_token_logprobs(scoring_runner(folder), prompts))
    assert plain["top1_agreement"] >= 0.99 and plain["mean_kl"] <= 1e-6, plain  # the same model in float
    unit = compare_distributions(reference, next_token_logprobs(scoring_runner(folder, kv_cache_dtype="fp8"),
                                                                prompts))
    calibrated = compare_distributions(reference, next_token_logprobs(
        scoring_runner(folder, kv_cache_dtype="fp8", calculate_kv_scales=True), prompts))
    assert unit["mean_kl"] > 10 * calibrated["mean_kl"], (unit, calibrated)
    assert calibrated["top1_agreement"] >= 0.75 and calibrated["mean_kl"] <= 1e-1, calibrated  # fp8 KV's bar
    layers = _load(folder)
    assert "k_scale" in layers and np.all(np.asarray(layers["k_scale"]) == 1.0)
    scales = np.asarray(_load_calibrated(folder)["k_scale"])  # (L, Hkv): the largest |K| lands at 448 / 2
    assert np.all((scales > 0) & (scales < 1e-3)), scales


def _load_calibrated(folder: str) -> dict:
    spec = load_model_spec(folder)
    config = EngineConfig(model=folder, kv_cache_dtype="fp8", calculate_kv_scales=True)
    params, _ = load_weights(config, folder, spec, make_mesh(1), cache_kv_heads(spec, 1))
    return params["layers"]


def test_calculate_kv_scales_needs_an_fp8_cache():
    with pytest.raises(ValueError, match="set kv_cache_dtype fp8 too"):
        EngineConfig(calculate_kv_scales=True)


def test_a_gpu_without_fp8_conversions_takes_the_xla_path(monkeypatch):
    """Triton converts e4m3 only from compute capability 8.9: an older GPU's `auto` takes the XLA path for an
    fp8 cache (and keeps the kernels for a bf16 one), and `pallas` is refused with the reason."""
    import jaxserve.attention as attention

    spec = _spec(head_dim=16)
    monkeypatch.setattr(attention, "gpu_compute_capability", lambda: 8.0)
    assert attention.resolve_backend("auto", spec, 16, "gpu", cache_dtype=fp8.FP8_DTYPE) == "xla"
    assert attention.resolve_backend("auto", spec, 16, "gpu", cache_dtype=jnp.bfloat16) == "pallas"
    with pytest.raises(ValueError, match="fp8 KV cache from compute capability 8.9"):
        attention.resolve_backend("pallas", spec, 16, "gpu", cache_dtype=fp8.FP8_DTYPE)
    monkeypatch.setattr(attention, "gpu_compute_capability", lambda: 9.0)  # an H100 / H200
    assert attention.resolve_backend("auto", spec, 16, "gpu", cache_dtype=fp8.FP8_DTYPE) == "pallas"
