"""The TPU route (attention/tpu.py): JAX's Mosaic ragged paged attention over the fused KV layout, run by
JAX's TPU interpreter on the CPU. Against the plain-jnp reference on one mixed batch, end to end against
`xla`, its backend choice, and its lowering for a TPU from the CPU.

The mixed batch: a prefill chunk continuing a cached prefix, a chunk ending on a page boundary, decodes (one
at a page boundary), a fresh prompt, empty padded rows and padded tokens after the last real one. Every
slot the step must not read (other layers, pages no row owns, slots past each row's length, the slots the
step writes before it writes them) is NaN in the fused cache, so a wrong read or a missed write shows up.
"""

import dataclasses
import logging
import re

import jax
import numpy as np
import pytest
from helpers import check_greedy_tokens_are_hfs, checkpoint
from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import get_min_heads_per_blk

import jax.numpy as jnp

from jaxserve.attention import make_attention, resolve_backend, tpu
from jaxserve.attention.base import LayerAttention
from jaxserve.batch.descriptor import BatchDescriptor
from jaxserve.sharding import make_mesh
from jaxserve.model_spec import ModelSpec
from jaxserve.model.registry import load_model_spec
from pallas_kernels.ragged_paged_attention import reference

ROWS = [(20, 7), (0, 16), (31, 1), (15, 1), (0, 5), (0, 0), (0, 0)]  # (cached, query) tokens; two padded rows
NUM_LAYERS, LAYER = 2, 1


def _spec(num_kv_heads: int, group: int, head_dim: int, window: int | None = None) -> ModelSpec:
    """The llama fixture's spec with other attention shapes."""
    return dataclasses.replace(load_model_spec(checkpoint("llama")), num_layers=NUM_LAYERS,
                               num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               sliding_window=window)


def _batch(page_size: int, num_pages: int, rng) -> tuple[BatchDescriptor, np.ndarray]:
    """The step's BatchDescriptor for ROWS (three padded tokens) and, per pool slot of the layer, whether it
    holds a cached token (L = 1 view: (P, S) bool)."""
    num_real = sum(count for _, count in ROWS)
    num_tokens, num_rows = num_real + 3, len(ROWS)
    width = max(-(-(cached + count) // page_size) for cached, count in ROWS)
    free = list(rng.permutation(np.arange(1, num_pages)))
    arrays = dict(positions=np.zeros(num_tokens, np.int32), slot_mapping=np.zeros(num_tokens, np.int32),
                  query_start_loc=np.full(num_rows + 1, num_real, np.int32), seq_lens=np.zeros(num_rows, np.int32),
                  page_table=np.zeros((num_rows, width), np.int32))
    cached_slots = np.zeros((num_pages, page_size), bool)  # (P, S)
    start = 0
    for row, (cached, count) in enumerate(ROWS):
        length = cached + count
        pages = [free.pop() for _ in range(-(-length // page_size))]
        positions = np.arange(cached, length)
        arrays["page_table"][row, :len(pages)] = pages
        arrays["query_start_loc"][row] = start
        arrays["seq_lens"][row] = length
        arrays["positions"][start:start + count] = positions
        arrays["slot_mapping"][start:start + count] = [pages[p // page_size] * page_size + p % page_size
                                                       for p in positions]
        for p in range(cached):
            cached_slots[pages[p // page_size], p % page_size] = True
        start += count
    zeros = np.zeros(num_rows, np.int32)
    batch = BatchDescriptor(input_ids=np.zeros(num_tokens, np.int32),
                            device_token_index=np.full(num_tokens, -1, np.int32), logits_indices=zeros, copy_src=zeros,
                            copy_dst=zeros, lora_slots=np.full(num_tokens, -1, np.int32),
                            num_seqs=np.asarray(len(ROWS) - 2, np.int32), **arrays)
    return jax.tree.map(jnp.asarray, batch), cached_slots


CASES = [
    pytest.param(2, 2, 32, 8, jnp.float32, None, None, id="gqa2-d32-padded"),
    pytest.param(2, 4, 128, 16, jnp.bfloat16, 12, None, id="bf16-d128-window"),
    pytest.param(1, 3, 16, 8, jnp.float32, None, 32, id="row-groups"),  # a page table of 32 bytes: 2 rows a call
]


@pytest.mark.parametrize("num_kv_heads,group,head_dim,page_size,dtype,window,table_bytes", CASES)
def test_attention_and_write_match_the_reference(monkeypatch, num_kv_heads, group, head_dim, page_size, dtype,
                                                 window, table_bytes):
    if table_bytes:
        monkeypatch.setattr(tpu, "PAGE_TABLE_SMEM_BYTES", table_bytes)
    rng = np.random.default_rng(0)
    num_pages = 24
    spec = _spec(num_kv_heads, group, head_dim, window)
    backend = make_attention(spec, "pallas-tpu-interpret", make_mesh(1), page_size)
    batch, cached_slots = _batch(page_size, num_pages, rng)
    num_tokens = batch.positions.shape[0]
    split_shape = (NUM_LAYERS, num_pages, page_size, num_kv_heads, head_dim)
    k_cache = rng.standard_normal(split_shape).astype(np.float32)  # (L, P, S, Hkv, D)
    v_cache = rng.standard_normal(split_shape).astype(np.float32)
    (fused_shape,) = backend.cache_shapes(NUM_LAYERS, num_pages, page_size, num_kv_heads, head_dim)
    fused = np.full(fused_shape, np.nan, np.float32)  # (L, P, S, 2 * Hkv, Dp): only the cached prefix is finite
    fused[LAYER, cached_slots] = 0.0
    fused[LAYER, cached_slots, 0::2, :head_dim] = k_cache[LAYER, cached_slots]
    fused[LAYER, cached_slots, 1::2, :head_dim] = v_cache[LAYER, cached_slots]
    q, k, v = (jnp.asarray(rng.standard_normal((num_tokens, heads, head_dim)), dtype)  # (T, heads, D)
               for heads in (num_kv_heads * group, num_kv_heads, num_kv_heads))

    @jax.jit
    def step(q, k, v, fused, batch):
        caches = backend.write_kv((fused,), jnp.int32(LAYER), k, v, batch)
        return backend.attention(q, caches, jnp.int32(LAYER), batch, LayerAttention(head_dim**-0.5, window)), caches[0]

    out, written = step(q, k, v, jnp.asarray(fused, dtype), batch)
    k_ref, v_ref = reference.write_kv(jnp.asarray(k_cache, dtype), jnp.asarray(v_cache, dtype), LAYER, k, v,
                                      batch.slot_mapping)
    ref = reference.ragged_paged_attention(q, k_ref, v_ref, LAYER, batch.positions, batch.query_start_loc,
                                           batch.page_table, sm_scale=head_dim**-0.5, sliding_window=window)
    real = int(batch.query_start_loc[-1])
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == q.shape and not np.isnan(out).any()
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    assert np.abs(out[:real] - ref[:real]).max() / np.abs(ref[:real]).max() < tolerance
    assert (out[real:] == 0).all(), "padded tokens get zeros"

    slots = np.asarray(batch.slot_mapping[:real])
    new = np.asarray(written, np.float32)[LAYER, slots // page_size, slots % page_size]  # (N, 2 * Hkv, Dp)
    assert np.array_equal(new[:, 0::2, :head_dim], np.asarray(k[:real], np.float32))
    assert np.array_equal(new[:, 1::2, :head_dim], np.asarray(v[:real], np.float32))
    assert (new[:, :, head_dim:] == 0).all(), "the padded head dimension holds zeros"


@pytest.mark.parametrize("name,tp", [("gemma2", 1), ("qwen2", 2)])
def test_engine_matches_hf(name, tp):
    """The TPU kernel's greedy tokens are Hugging Face's, which the xla path gives too (tests/test_engine_vs_hf.py).
    gemma2: sliding (16 keys) and full layers in one scan, soft-capped scores, prompts past the window."""
    check_greedy_tokens_are_hfs(name, attention_backend="pallas-tpu-interpret", tensor_parallel_size=tp,
                                max_model_len=32, page_size=8, max_num_batched_tokens=16, max_num_seqs=4)


def test_backend_choice_for_tpu(caplog):
    spec = load_model_spec(checkpoint("llama"))  # 2 KV heads
    assert resolve_backend("auto", spec, 16, "tpu") == "pallas"
    assert resolve_backend("pallas", spec, 8, "tpu", tensor_parallel_size=2) == "pallas"
    assert resolve_backend("pallas-tpu-interpret", spec, 16) == "pallas-tpu-interpret"
    six = dataclasses.replace(spec, num_heads=12, num_kv_heads=6)
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        assert resolve_backend("auto", six, 16, "tpu") == "xla"
    assert "6 KV heads per device" in caplog.text
    with pytest.raises(ValueError, match="6 KV heads per device"):
        resolve_backend("pallas", six, 16, "tpu")
    with pytest.raises(ValueError, match="3 KV heads per device"):
        resolve_backend("pallas-tpu-interpret", six, 16, tensor_parallel_size=2)

    backend = make_attention(spec, "auto", make_mesh(2), 16, platform="tpu")
    assert (backend.name, backend.layout) == ("pallas", "fused")
    assert backend.cache_shapes(2, 10, 16, 2, 16) == ((2, 10, 16, 4, 128),)
    assert backend.cache_shapes(2, 10, 16, 2, 128) == ((2, 10, 16, 4, 128),)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
def test_head_rule_is_the_kernels(dtype):
    """tpu_unsupported accepts exactly the KV heads per device the kernel tiles for a 32-, 16- or 8-bit cache."""
    for heads in range(1, 33):
        try:
            get_min_heads_per_blk(heads, 2 * heads, jnp.bfloat16, dtype)
            tiles = True
        except ValueError:
            tiles = False
        assert (tpu.tpu_unsupported(heads, dtype) is None) == tiles, heads


@pytest.mark.parametrize("tp", [1, 2])
def test_lowers_for_tpu_on_the_cpu(tp):
    """jax.export for 'tpu' on the CPU at Llama-3.1-8B's attention shapes (32 query heads, 8 KV heads, head dim
    128, bf16, pages of 16), a bucket whose page table (256 rows x 1024 pages) is twice the SMEM budget."""
    num_tokens, num_rows, width, num_layers, num_pages, page_size = 512, 256, 1024, 2, 4096, 16
    mesh = make_mesh(tp)
    backend = make_attention(_spec(8, 4, 128), "pallas", mesh, page_size, platform="tpu")
    heads = jax.NamedSharding(mesh, jax.P(None, "model", None))
    replicated = jax.NamedSharding(mesh, jax.P())
    (cache_shape,) = backend.cache_shapes(num_layers, num_pages, page_size, 8, 128)

    def array(shape, dtype=jnp.int32, sharding=replicated):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def step(q, k, v, cache, query_start_loc, seq_lens, page_table, slot_mapping, num_seqs):
        tokens = jnp.zeros(num_tokens, jnp.int32)
        rows = jnp.zeros(num_rows, jnp.int32)
        batch = BatchDescriptor(input_ids=tokens, device_token_index=tokens - 1, positions=tokens,
                                slot_mapping=slot_mapping,
                                query_start_loc=query_start_loc, seq_lens=seq_lens, page_table=page_table,
                                logits_indices=rows, copy_src=rows, copy_dst=rows, lora_slots=tokens - 1,
                                num_seqs=num_seqs)
        caches = backend.write_kv((cache,), jnp.int32(1), k, v, batch)
        return backend.attention(q, caches, jnp.int32(1), batch, LayerAttention(128**-0.5)), caches

    args = (array((num_tokens, 32, 128), jnp.bfloat16, heads), array((num_tokens, 8, 128), jnp.bfloat16, heads),
            array((num_tokens, 8, 128), jnp.bfloat16, heads),
            array(cache_shape, jnp.bfloat16, jax.NamedSharding(mesh, jax.P(None, None, None, "model", None))),
            array((num_rows + 1,)), array((num_rows,)), array((num_rows, width)), array((num_tokens,)), array(()))
    with tpu.lowering_off_tpu():
        text = jax.export.export(jax.jit(step, donate_argnums=(3,)), platforms=("tpu",))(*args).mlir_module()
    assert "tpu_custom_call" in text
    assert len(re.findall(r"call @ragged_paged_attention\(", text)) == 2, "two row groups of 128 rows"
    (kernel,) = [line for line in text.splitlines() if "func.func private @ragged_paged_attention(" in line]
    assert f"tensor<{num_layers * num_pages}x{page_size}x{16 // tp}x128xbf16>" in kernel, \
        "the kernel reads the (L * P, ...) view of the whole cache"
    assert not re.search(rf"dynamic_slice[^\n]*tensor<{num_layers}x{num_pages}x", text), "no copy of a layer"


def test_a_model_with_attention_sinks_takes_the_xla_path_on_a_tpu():
    """gpt-oss's sinks are not in JAX's TPU kernel: auto picks the XLA path there, pallas says why, and the kernel
    backend refuses sinks passed to it."""
    spec = load_model_spec(checkpoint("gpt-oss"))
    assert spec.attention_sinks
    assert resolve_backend("auto", spec, 16, "tpu") == "xla"
    assert resolve_backend("auto", dataclasses.replace(spec, attention_sinks=False), 16, "tpu") == "pallas"
    with pytest.raises(ValueError, match="no attention sinks .* use attention_backend xla"):
        resolve_backend("pallas-tpu-interpret", spec, 16)
    backend = tpu.make_backend(make_mesh(1), interpret=True)
    with pytest.raises(ValueError, match="no attention sinks"):
        backend.attention(None, (None,), 0, None, LayerAttention(1.0), sinks=np.zeros(4, np.float32))
