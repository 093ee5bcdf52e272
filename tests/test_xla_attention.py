"""The tiled XLA attention path against the plain-jnp reference (pallas_kernels/ragged_paged_attention/
reference.py), the GPU's dense prefill glue run through XLA's dense attention (cuDNN's stand-in on the
CPU), the engine's greedy tokens against today's path, and the temporary memory of the 8B config's largest
bucket.

Every case is one mixed batch: fresh prompts, chunks continuing a cached prefix, decodes (one at a page
boundary), an empty padded row and padded tokens. For the path under test every slot no query may read is
NaN (pages no row owns, the null page, other layers, the tail of each row's last page); the reference reads
whole pages and gets zeros there. A read of a slot a query must not see shows up as NaN in the output.
"""

import dataclasses
import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from helpers import checkpoint, expected, small_engine_args

from jaxserve import LLM, SamplingParams
from jaxserve.runner import runner
from jaxserve.attention import cudnn, xla
from jaxserve.attention.base import LayerAttention
from jaxserve.batch.builder import BucketLadders
from jaxserve.batch.descriptor import BatchDescriptor
from jaxserve.bench.models import SHAPES
from jaxserve.model.registry import load_model_spec
from pallas_kernels.ragged_paged_attention import reference

NUM_LAYERS, LAYER = 2, 1
# (cached tokens before this step, query tokens this step) per row
MIXED = [(0, 13), (21, 11), (16, 1), (30, 1), (0, 2), (0, 0), (40, 17), (5, 1)]
FRESH_AND_DECODES = [(0, 13), (16, 1), (0, 2), (30, 1), (0, 9), (0, 0), (7, 1), (0, 0)]
CONFIG_8B = os.path.join(os.path.dirname(__file__), "..", "jaxserve", "configs", "llama-3.1-8b-1xh200.yaml")


def _case(rows, page_size, num_kv_heads, group, head_dim, dtype, seed=0):
    """Random q, poisoned and clean caches, and a BatchDescriptor for `rows` plus three padded tokens."""
    rng = np.random.default_rng(seed)
    seq_lens = np.array([c + n for c, n in rows], np.int32)  # (R,)
    query_start_loc = np.concatenate([[0], np.cumsum([n for _, n in rows])]).astype(np.int32)  # (R + 1,)
    pages_per_row = -(-seq_lens // page_size)
    num_pages = int(pages_per_row.sum()) + 4
    free = list(rng.permutation(np.arange(1, num_pages)))
    page_table = np.zeros((len(rows), int(pages_per_row.max()) + 1), np.int32)  # (R, W): a spare null column
    for row, count in enumerate(pages_per_row):
        page_table[row, :count] = [free.pop() for _ in range(count)]
    shape = (NUM_LAYERS, num_pages, page_size, num_kv_heads, head_dim)
    k_clean = rng.standard_normal(shape).astype(np.float32)  # (L, P, S, Hkv, D)
    v_clean = rng.standard_normal(shape).astype(np.float32)
    readable = np.zeros(shape[:3], bool)  # (L, P, S): slots some query may read
    for row, seq_len in enumerate(seq_lens):
        for position in range(seq_len):
            readable[LAYER, page_table[row, position // page_size], position % page_size] = True
    k_cache, v_cache = k_clean.copy(), v_clean.copy()
    k_cache[~readable] = np.nan
    v_cache[~readable] = np.nan
    num_tokens = int(query_start_loc[-1]) + 3
    positions = np.zeros(num_tokens, np.int32)  # (T,)
    for row, (cached, count) in enumerate(rows):
        positions[query_start_loc[row]:query_start_loc[row + 1]] = cached + np.arange(count)
    q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)).astype(np.float32)  # (T, Hq, D)
    zeros = jnp.zeros(len(rows), jnp.int32)
    batch = BatchDescriptor(
        input_ids=jnp.zeros(num_tokens, jnp.int32), device_token_index=jnp.full(num_tokens, -1, jnp.int32),
        positions=jnp.asarray(positions),
        slot_mapping=jnp.zeros(num_tokens, jnp.int32), query_start_loc=jnp.asarray(query_start_loc),
        seq_lens=jnp.asarray(seq_lens), page_table=jnp.asarray(page_table), logits_indices=zeros,
        copy_src=zeros, copy_dst=zeros, lora_slots=jnp.full(num_tokens, -1, jnp.int32), num_seqs=jnp.int32(len(rows)),
    )
    arrays = {name: jnp.asarray(value, dtype) for name, value in
              dict(q=q, k_cache=k_cache, v_cache=v_cache, k_clean=k_clean, v_clean=v_clean).items()}
    return arrays, batch


def _reference(arrays, batch, window):
    attend = functools.partial(reference.ragged_paged_attention, layer=LAYER, sm_scale=arrays["q"].shape[-1] ** -0.5,
                               sliding_window=window)
    return jax.jit(attend)(arrays["q"], arrays["k_clean"], arrays["v_clean"], positions=batch.positions,
                           query_start_loc=batch.query_start_loc, page_table=batch.page_table)  # one compile


def _assert_matches(out, ref, batch, dtype):
    real = int(batch.query_start_loc[-1])
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert not np.isnan(out[:real]).any(), "a query read a slot it must not see"
    tolerance = 1e-5 if dtype == jnp.float32 else 1e-2
    assert np.abs(out[:real] - ref[:real]).max() / np.abs(ref[:real]).max() < tolerance
    assert (out[real:] == 0).all(), "padded tokens get zeros"


def _tiled(arrays, batch, window, tiles):
    token_rows, positions = xla.step_tokens(batch, arrays["q"].shape[0])
    return jax.jit(lambda q, k, v, p, r, t: xla.tiled_attention(
        q, k, v, LAYER, p, r, t, how=LayerAttention(q.shape[-1] ** -0.5, window), tiles=tiles,
    ))(arrays["q"], arrays["k_cache"], arrays["v_cache"], positions, token_rows, batch.page_table)


def _spec(window, head_dim=16):
    return dataclasses.replace(load_model_spec(checkpoint("llama")), head_dim=head_dim,
                               sliding_window=window)


TILED_CASES = [
    pytest.param("cpu", 1, jnp.float32, None, id="cpu-tiles-mha"),
    pytest.param("tpu", 4, jnp.bfloat16, None, id="accelerator-tiles-gqa4-bf16"),
    pytest.param(xla.Tiles(queries=4, pages=1), 2, jnp.float32, None, id="chunk-loop"),
    pytest.param(xla.Tiles(queries=4, pages=1), 3, jnp.float32, 6, id="chunk-loop-window"),
    pytest.param(xla.Tiles(queries=8, pages=2, row_pages=3), 2, jnp.float32, None, id="one-row-tiles"),
    pytest.param(xla.Tiles(queries=8, pages=2, row_pages=3), 2, jnp.bfloat16, 9, id="one-row-tiles-window-bf16"),
]


@pytest.mark.parametrize("tiles,group,dtype,window", TILED_CASES)
def test_tiled_path_matches_the_reference(tiles, group, dtype, window):
    arrays, batch = _case(MIXED, 4, 2, group, 16, dtype)
    if isinstance(tiles, str):  # the sizes a bucket of this shape gets on that platform
        tiles = xla.tile_sizes(arrays["q"].shape[0], batch.page_table.shape[1], 4, 2 * group, 2, 16,
                               arrays["k_cache"].dtype.itemsize, tiles)
    _assert_matches(_tiled(arrays, batch, window, tiles), _reference(arrays, batch, window), batch, dtype)


def test_tokens_are_taken_by_row_length_with_rows_whole_and_padding_last():
    """Rows of like lengths share tiles; a row's tokens stay together and in order; padding goes last."""
    positions = jnp.asarray([7, 8, 9, 3, 20, 0, 1, -1, -1], jnp.int32)  # (T,): rows of 3, 1, 1 and 2 tokens
    token_rows = jnp.asarray([0, 0, 0, 1, 2, 3, 3, 3, 3], jnp.int32)  # (T,): padding maps to the last row
    order = xla._length_order(positions, token_rows, num_rows=4)  # (T,)
    assert order.tolist() == [5, 6, 3, 0, 1, 2, 4, 7, 8]


@pytest.mark.parametrize("window", [None, 5])
def test_dense_prefill_glue_takes_fresh_prompts_and_matches_the_reference(window):
    """The GPU's glue with XLA's dense attention in cuDNN's place: fresh prompts go dense, the rest tiled."""
    arrays, batch = _case(FRESH_AND_DECODES, 4, 2, 2, 16, jnp.float32)
    backend = xla.make_backend("cpu", prefill_implementation="xla")
    out = jax.jit(backend.attention, static_argnums=4)(arrays["q"], (arrays["k_cache"], arrays["v_cache"]), LAYER,
                                                         batch, LayerAttention(16**-0.5, window))
    _assert_matches(out, _reference(arrays, batch, window), batch, jnp.float32)

    def poisoned_tiled(q, *args):
        return jnp.full_like(q, jnp.nan)  # (N, Hq, D): marks every token the tiled path computes

    token_rows, positions = xla.step_tokens(batch, arrays["q"].shape[0])
    split = cudnn.prefill_or_tiled(
        arrays["q"], arrays["k_cache"], arrays["v_cache"], LAYER, positions, token_rows, batch, tiled=poisoned_tiled,
        sm_scale=0.25, sliding_window=window, implementation="xla")
    fresh = np.asarray(cudnn._fresh_tokens(batch.query_start_loc, positions, token_rows))  # (T,)
    real = np.asarray(positions) >= 0
    assert fresh.sum() == 13 + 2 + 9
    assert not np.isnan(np.asarray(split)[fresh]).any() and np.isnan(np.asarray(split)[real & ~fresh]).all()


def test_a_step_with_too_many_other_tokens_runs_the_tiled_path_whole():
    arrays, batch = _case(MIXED, 4, 2, 2, 16, jnp.float32)  # 46 tokens of continued chunks and decodes, R = 8
    token_rows, positions = xla.step_tokens(batch, arrays["q"].shape[0])
    out = cudnn.prefill_or_tiled(
        arrays["q"], arrays["k_cache"], arrays["v_cache"], LAYER, positions, token_rows, batch,
        tiled=lambda q, *args: jnp.full_like(q, jnp.nan), sm_scale=0.25, sliding_window=None, implementation="xla")
    assert np.isnan(np.asarray(out)).all()


def test_without_cudnn_a_gpu_backend_warns_once_and_takes_the_tiled_path(caplog):
    cudnn._warn_once.cache_clear()
    arrays, batch = _case(FRESH_AND_DECODES, 4, 2, 2, 16, jnp.bfloat16)
    backend = xla.make_backend("gpu")  # this host has no cuDNN: a trace-time error
    other, other_batch = _case(MIXED, 4, 2, 2, 16, jnp.bfloat16)  # another shape: traced again
    attend = jax.jit(functools.partial(backend.attention, how=LayerAttention(16**-0.5)))
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        out = attend(arrays["q"], (arrays["k_cache"], arrays["v_cache"]), LAYER, batch)
        attend(other["q"], (other["k_cache"], other["v_cache"]), LAYER, other_batch)
    assert [r.getMessage() for r in caplog.records if "cudnn is unavailable" in r.getMessage()] != []
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    _assert_matches(out, _reference(arrays, batch, None), batch, jnp.bfloat16)


def test_engine_greedy_tokens_equal_todays_path(monkeypatch):
    """The tiled path and the dense prefill glue (XLA's dense attention in cuDNN's place) give the greedy
    tokens of today's path, which are Hugging Face's (tests/test_engine_vs_hf.py, every architecture), on the
    checkpoint with a sliding window and grouped KV heads; prompts up to 70 tokens in steps of 16 mix fresh
    prompts, continued chunks and decodes."""
    want = expected("mistral")
    prompts = [{"prompt_token_ids": ids} for ids in want["prompts"]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for prefill in (None, "xla"):
        monkeypatch.setattr(runner, "make_attention",
                            lambda spec, *args, prefill=prefill, **kwargs: xla.make_backend("cpu", prefill))
        llm = LLM(checkpoint("mistral"), **small_engine_args(max_num_batched_tokens=16, max_num_seqs=8))
        tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        assert tokens == [output[:12] for output in want["outputs"]], f"prefill_implementation={prefill}"


def _largest_8b_bucket():
    """(T, R, W) of the shipped Llama-3.1-8B config's largest bucket."""
    with open(CONFIG_8B) as f:
        config = yaml.safe_load(f)
    ladders = BucketLadders.build(config["max_num_batched_tokens"], config["max_num_seqs"], config["max_model_len"],
                                  config["page_size"], config["min_token_bucket"], max_aux_extra=0)
    num_tokens = ladders.tokens[-1]
    return num_tokens, ladders.rows_for(num_tokens), ladders.page_widths[-1], config["page_size"]


def _attention_temp_bytes(spec, platform, num_tokens, num_rows, width, page_size, num_pages, cache_dtype):
    """Temporary bytes of one layer's attention, compiled for abstract 8B-shaped inputs."""
    backend = xla.make_backend(platform)
    how = LayerAttention(spec.head_dim**-0.5, spec.sliding_window)

    def ints(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    batch = BatchDescriptor(
        input_ids=ints(num_tokens), device_token_index=ints(num_tokens), positions=ints(num_tokens),
        slot_mapping=ints(num_tokens),
        query_start_loc=ints(num_rows + 1), seq_lens=ints(num_rows), page_table=ints(num_rows, width),
        logits_indices=ints(num_rows), copy_src=ints(num_rows), copy_dst=ints(num_rows),
        lora_slots=ints(num_tokens), num_seqs=ints())
    q = jax.ShapeDtypeStruct((num_tokens, spec.num_heads, spec.head_dim), jnp.bfloat16)  # (T, Hq, D)
    cache = jax.ShapeDtypeStruct((1, num_pages, page_size, spec.num_kv_heads, spec.head_dim), cache_dtype)
    attend = jax.jit(lambda q, k, v, b: backend.attention(q, (k, v), 0, b, how))
    compiled = attend.lower(q, cache, cache, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_peak_temporary_memory_of_the_8b_largest_bucket_is_bounded():
    """Under 2 GB on every platform's tile sizes (the gather is bounded by the tiles, not by T or W), and
    independent of the pool. (bfloat16 pools on the CPU are converted to float32 whole, an artifact of
    the CPU compiler, so the pool-size check uses float32 pools.)"""
    shape = SHAPES["llama-3.1-8b"]
    spec = dataclasses.replace(_spec(None, shape.head_dim), num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads)
    num_tokens, num_rows, width, page_size = _largest_8b_bucket()
    assert (num_tokens, width, spec.num_kv_heads, spec.head_dim) == (8192, 2048, 8, 128)
    bucket = (num_tokens, num_rows, width, page_size)
    for platform in ("gpu", "tpu", "cpu"):  # no cuDNN here: 'gpu' compiles the tiled path alone
        assert _attention_temp_bytes(spec, platform, *bucket, 256, jnp.bfloat16) < 2 * 10**9
    small, large = (_attention_temp_bytes(spec, "tpu", *bucket, pages, jnp.float32) for pages in (256, 4096))
    assert small == large
