"""The Pallas ragged paged-attention and KV-write kernels against their plain-jnp references, in
Pallas interpret mode on the CPU, and the engine with `attention_backend="pallas-interpret"`.

Every case is one mixed batch: a prefill chunk continuing a cached prefix, a chunk ending exactly
on a page boundary, decodes (one query token, one of them at a page boundary), a fresh prompt, an
empty padded row, and padded tokens after the last real one. Pool pages no row owns, other layers
and the slots past each row's length are NaN for the kernel (zeros for the reference), so a read
of a slot a query must not see shows up in the output. Pallas interpret mode fills
a kernel's outputs with NaN before it runs, so an element the kernel fails to write shows up too
(the tests assert there is no NaN anywhere in the output).

`return_lse=True` (the log-sum-exp that attention sinks need) is checked against the reference's LSE and,
with random sinks, against a softmax-with-sink written out in numpy from the gathered K/V.
"""

import functools

import jax
import numpy as np
import pytest
from helpers import attention_with_sinks, check_greedy_tokens_are_hfs, checkpoint

import jax.numpy as jnp

from jaxserve.attention import resolve_backend
from jaxserve.attention.pallas_gpu import decode_and_prompt_rows
from pallas_kernels.paged_decode_attention import kernel as decode_kernel
from jaxserve.model.registry import load_model_spec
from pallas_kernels.paged_kv_write import kernel as kv_write_kernel
from pallas_kernels.paged_kv_write import reference as kv_write_reference
from pallas_kernels.ragged_paged_attention import kernel, reference
from pallas_kernels.ragged_paged_attention.tuning import gpu_unsupported
from pallas_kernels.tile_math import from_cache, to_cache

# (cached tokens before this step, query tokens this step) per row
ROWS = [(20, 7), (0, 16), (31, 1), (15, 1), (0, 5), (0, 0)]
NUM_LAYERS, LAYER = 2, 1


def _case(page_size, num_kv_heads, group, head_dim, dtype, rows=ROWS, seed=0, cache_dtype=None):
    """Random q, caches and metadata for `rows` ((cached, query) tokens each); slots no query may read
    are NaN (the null page is finite). The caches are in `cache_dtype` (default: q's), uint8 for fp8 bits."""
    rng = np.random.default_rng(seed)
    seq_lens = np.array([c + n for c, n in rows], np.int32)  # (R,)
    query_lens = np.array([n for _, n in rows], np.int32)  # (R,)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)  # (R+1,)
    pages_per_row = -(-seq_lens // page_size)
    width = int(pages_per_row.max())
    num_pages = int(pages_per_row.sum()) + 4
    free = list(rng.permutation(np.arange(1, num_pages)))
    page_table = np.zeros((len(rows), width), np.int32)  # (R, W)
    for row, count in enumerate(pages_per_row):
        page_table[row, :count] = [free.pop() for _ in range(count)]
    shape = (NUM_LAYERS, num_pages, page_size, num_kv_heads, head_dim)
    k_cache = rng.standard_normal(shape).astype(np.float32)  # (L, P, S, Hkv, D)
    v_cache = rng.standard_normal(shape).astype(np.float32)
    owned = set(page_table[page_table > 0].tolist())
    poison = np.zeros(shape[:3], bool)  # (L, P, S): slots no query may read
    poison[:, [p for p in range(1, num_pages) if p not in owned]] = True
    poison[:LAYER] = True  # other layers
    for row, seq_len in enumerate(seq_lens):
        if seq_len % page_size:
            poison[:, page_table[row, seq_len // page_size], seq_len % page_size:] = True  # tail of the last page
    k_cache[poison] = np.nan
    v_cache[poison] = np.nan
    num_tokens = int(query_start_loc[-1]) + 3  # three padded tokens
    q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)).astype(np.float32)  # (T, Hq, D)
    positions = np.zeros(num_tokens, np.int32)  # (T,)
    for row, (cached, count) in enumerate(rows):
        positions[query_start_loc[row]:query_start_loc[row + 1]] = cached + np.arange(count)
    arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache,  # the reference reads whole pages: it gets zeros
                  k_clean=np.nan_to_num(k_cache), v_clean=np.nan_to_num(v_cache))
    arrays = {name: jnp.asarray(value, dtype) for name, value in arrays.items()}
    if cache_dtype is not None:
        arrays.update({name: to_cache(jnp.asarray(value, jnp.float32), cache_dtype)
                       for name, value in arrays.items() if name != "q"})
    return arrays, positions, query_start_loc, seq_lens, page_table


def _relative_error(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(out - ref).max() / np.abs(ref).max())


CASES = [pytest.param(16, 1, group, 64, jnp.float32, None, None, id=f"group{group}") for group in range(1, 9)] + [
    pytest.param(8, 2, 2, 128, jnp.float32, None, None, id="page8-d128"),
    pytest.param(32, 2, 4, 64, jnp.float32, None, None, id="page32"),
    pytest.param(16, 2, 2, 64, jnp.bfloat16, None, None, id="bfloat16"),
    pytest.param(16, 1, 2, 64, jnp.float32, 12, None, id="sliding-window"),
    pytest.param(8, 1, 4, 64, jnp.float32, None, 5.0, id="soft-cap"),
    pytest.param(16, 2, 3, 80, jnp.bfloat16, 9, 20.0, id="d80-bf16-window-cap"),
]


@pytest.mark.parametrize("page_size,num_kv_heads,group,head_dim,dtype,window,soft_cap", CASES)
def test_ragged_kernel_matches_reference(page_size, num_kv_heads, group, head_dim, dtype, window, soft_cap):
    arrays, positions, query_start_loc, seq_lens, page_table = _case(page_size, num_kv_heads, group, head_dim, dtype)
    options = dict(sm_scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    # jitted: one compile each instead of many small eager ones (a faster test, above all on an empty cache)
    attend = jax.jit(functools.partial(kernel.ragged_paged_attention, layer=LAYER, interpret=True, **options))
    out = attend(arrays["q"], arrays["k_cache"], arrays["v_cache"], query_start_loc=jnp.asarray(query_start_loc),
                 seq_lens=jnp.asarray(seq_lens), page_table=jnp.asarray(page_table))
    ref = jax.jit(functools.partial(reference.ragged_paged_attention, layer=LAYER, **options))(
        arrays["q"], arrays["k_clean"], arrays["v_clean"], positions=jnp.asarray(positions),
        query_start_loc=jnp.asarray(query_start_loc), page_table=jnp.asarray(page_table),
    )
    real = int(query_start_loc[-1])
    assert out.shape == arrays["q"].shape and out.dtype == arrays["q"].dtype
    assert not np.isnan(np.asarray(out, np.float32)).any()
    tolerance = 1e-5 if dtype == jnp.float32 else 1e-2
    assert _relative_error(out[:real], ref[:real]) < tolerance
    assert (np.asarray(out[real:], np.float32) == 0).all(), "padded tokens get zeros"


def test_kv_write_kernel_writes_in_place_and_nothing_else():
    rng = np.random.default_rng(1)
    shape = (NUM_LAYERS, 6, 8, 2, 16)  # (L, P, S, Hkv, D)
    k_cache = jnp.full(shape, jnp.nan, jnp.float32)
    v_cache = jnp.full(shape, jnp.nan, jnp.float32)
    slots = jnp.asarray([9, 10, 11, 23, 40, 47, 0, 0], jnp.int32)  # page*8+offset; last two are padding
    k = jnp.asarray(rng.standard_normal((8, 2, 16)), jnp.float32)  # (T, Hkv, D)
    v = jnp.asarray(rng.standard_normal((8, 2, 16)), jnp.float32)
    k_out, v_out = kv_write_kernel.write_kv(k_cache, v_cache, LAYER, k, v, slots, interpret=True)
    k_ref, v_ref = kv_write_reference.write_kv(k_cache, v_cache, LAYER, k, v, slots)
    written = np.zeros(shape[:3], bool)
    written[LAYER, np.asarray(slots[:6]) // 8, np.asarray(slots[:6]) % 8] = True
    for out, ref in ((k_out, k_ref), (v_out, v_ref)):
        out, ref = np.asarray(out), np.asarray(ref)
        assert np.array_equal(out[written], ref[written])
        untouched = ~written
        untouched[LAYER, 0, 0] = False  # the null page slot the padding wrote to
        assert np.isnan(out[untouched]).all()


@pytest.mark.parametrize("name,tp", [("llama", 1), ("qwen2", 2), ("gemma2", 1), ("gpt-oss", 2)])
def test_engine_with_pallas_interpret_matches_hf(name, tp):
    """The kernels' greedy tokens are Hugging Face's, which the xla path gives too (tests/test_engine_vs_hf.py).
    gemma2: sliding (16 keys) and full layers in one scan, soft-capped scores, prompts past the window; gpt-oss:
    attention sinks (the kernels' log-sum-exp) split with their heads over two devices."""
    check_greedy_tokens_are_hfs(name, attention_backend="pallas-interpret", tensor_parallel_size=tp,
                                max_num_batched_tokens=32, max_num_seqs=8)


def test_backend_choice_on_the_cpu():
    spec = load_model_spec(checkpoint("llama"))
    assert resolve_backend("auto", spec, 16) == "xla"
    assert resolve_backend("pallas-interpret", spec, 8) == "pallas-interpret"
    with pytest.raises(ValueError, match="use pallas-interpret"):
        resolve_backend("pallas", spec, 16)
    assert gpu_unsupported(16, 128) is None and gpu_unsupported(32, 64) is None
    assert gpu_unsupported(8, 128) is None
    assert "power of two" in gpu_unsupported(16, 80)


LOWERING_CASES = [
    pytest.param(16, 2, 4, 128, jnp.bfloat16, None, None, None, id="gqa4-bf16"),
    pytest.param(32, 1, 3, 64, jnp.float32, 64, 30.0, None, id="group3-window-cap"),
    pytest.param(16, 4, 1, 64, jnp.bfloat16, None, None, None, id="mha"),
    pytest.param(8, 2, 2, 128, jnp.bfloat16, None, None, None, id="page8"),
    pytest.param(16, 2, 4, 128, jnp.bfloat16, None, None, jnp.uint8, id="fp8-cache"),  # e4m3 bits (attention/fp8.py)
]


@pytest.mark.parametrize("page_size,num_kv_heads,group,head_dim,dtype,window,soft_cap,cache_dtype", LOWERING_CASES)
def test_kernels_lower_to_triton_ir(page_size, num_kv_heads, group, head_dim, dtype, window, soft_cap, cache_dtype):
    """Pallas -> Triton IR for CUDA on the CPU (no PTX, no GPU): catches operations or block shapes
    the Triton lowering rejects."""
    num_tokens, num_rows, width = 64, 8, 8
    q = jax.ShapeDtypeStruct((num_tokens, num_kv_heads * group, head_dim), dtype)  # (T, Hq, D)
    kv = jax.ShapeDtypeStruct((num_tokens, num_kv_heads, head_dim), dtype)  # (T, Hkv, D)
    cache = jax.ShapeDtypeStruct((2, 64, page_size, num_kv_heads, head_dim), cache_dtype or dtype)  # (L, P, S, Hkv, D)

    def ints(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    def attend(q, k_cache, v_cache, query_start_loc, seq_lens, page_table, return_lse=False, skip_decode_rows=False):
        return kernel.ragged_paged_attention(q, k_cache, v_cache, LAYER, query_start_loc, seq_lens, page_table,
                                             sm_scale=0.125, sliding_window=window, soft_cap=soft_cap,
                                             return_lse=return_lse, skip_decode_rows=skip_decode_rows)

    def write(k_cache, v_cache, k, v, slots):
        return kv_write_kernel.write_kv(k_cache, v_cache, LAYER, k, v, slots)

    attend_args = (q, cache, cache, ints(num_rows + 1), ints(num_rows), ints(num_rows, width))
    for function, args in ((attend, attend_args), (functools.partial(attend, return_lse=True), attend_args),
                           (functools.partial(attend, skip_decode_rows=True), attend_args),
                           (write, (cache, cache, kv, kv, ints(num_tokens)))):
        text = jax.jit(function).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "xla.gpu.triton" in text


def test_ragged_kernel_skips_decode_rows():
    """`skip_decode_rows`: the decodes' tokens get zeros (lse -inf), as if padded; every other token is unchanged."""
    arrays, positions, query_start_loc, seq_lens, page_table = _case(16, 2, 4, 64, jnp.float32)
    args = (arrays["q"], arrays["k_cache"], arrays["v_cache"], jnp.int32(LAYER), jnp.asarray(query_start_loc),
            jnp.asarray(seq_lens), jnp.asarray(page_table))
    attend = functools.partial(kernel.ragged_paged_attention, sm_scale=0.125, interpret=True, return_lse=True)
    out, lse = jax.jit(attend)(*args)
    skipped, skipped_lse = jax.jit(functools.partial(attend, skip_decode_rows=True))(*args)
    query_lens = np.diff(query_start_loc)
    decode_tokens = np.zeros(arrays["q"].shape[0], bool)  # (T,)
    decode_tokens[query_start_loc[:-1][query_lens == 1]] = True
    assert decode_tokens.sum() == 2
    assert (np.asarray(skipped)[decode_tokens] == 0).all() and (np.asarray(skipped_lse)[decode_tokens] == -np.inf).all()
    assert np.array_equal(np.asarray(skipped)[~decode_tokens], np.asarray(out)[~decode_tokens])
    assert np.array_equal(np.asarray(skipped_lse)[~decode_tokens], np.asarray(lse)[~decode_tokens])


# (cached, query) tokens per row for each kind of step: decodes only (one at a page boundary) with a padded row;
# prompt chunks only (one continuing a prefix, one fresh); and both
STEP_KINDS = {
    "decodes": ([(30, 1), (15, 1), (0, 0), (40, 1)], ["decode"]),
    "prompts": ([(20, 7), (0, 16), (0, 0)], ["ragged"]),
    "mixed": (ROWS, ["decode", "ragged"]),
}


@pytest.mark.parametrize("kind", STEP_KINDS)
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
def test_each_row_takes_its_own_kernel(kind, return_lse):
    """Decode rows through the decode kernel, prompt chunks through the ragged kernel (skipping the decodes), each
    kind of step running only the kernels it needs; together equal to the reference."""
    rows, kernels = STEP_KINDS[kind]
    arrays, positions, query_start_loc, seq_lens, page_table = _case(16, 2, 4, 64, jnp.float32, rows)
    options = dict(sm_scale=64**-0.5, interpret=True, return_lse=return_lse)
    args = (arrays["q"], arrays["k_cache"], arrays["v_cache"], jnp.int32(LAYER), jnp.asarray(query_start_loc),
            jnp.asarray(seq_lens), jnp.asarray(page_table))
    ragged = functools.partial(kernel.ragged_paged_attention, skip_decode_rows=True, **options)
    decode = functools.partial(decode_kernel.paged_decode_attention, **options)
    attend = functools.partial(decode_and_prompt_rows, ragged=ragged, decode=decode, return_lse=return_lse)
    result = jax.jit(attend)(*args)
    out, lse = result if return_lse else (result, None)
    ref_out, ref_lse = reference.ragged_paged_attention(
        arrays["q"], arrays["k_clean"], arrays["v_clean"], LAYER, jnp.asarray(positions),
        jnp.asarray(query_start_loc), jnp.asarray(page_table), sm_scale=64**-0.5, return_lse=True,
    )
    real = int(query_start_loc[-1])
    assert _relative_error(out[:real], ref_out[:real]) < 1e-5
    assert (np.asarray(out[real:]) == 0).all()
    if return_lse:
        np.testing.assert_allclose(np.asarray(lse)[:real], np.asarray(ref_lse)[:real], rtol=1e-5, atol=1e-5)
        assert (np.asarray(lse)[real:] == -np.inf).all()

    def marked(value):  # a kernel that only marks the tokens it answers
        def call(q, *rest):
            out = jnp.full_like(q, value)  # (T, Hq, D)
            return (out, jnp.zeros(q.shape[:2], jnp.float32)) if return_lse else out
        return call

    # which kernels the data picks: a kernel that did not run leaves no mark
    stubbed = decode_and_prompt_rows(*args, ragged=marked(7.0), decode=marked(3.0), return_lse=return_lse)
    stubbed = np.asarray(stubbed[0] if return_lse else stubbed)
    ran = {name for name, value in (("decode", 3.0), ("ragged", 7.0)) if (stubbed == value).any()}
    assert sorted(ran) == kernels


# (cached, query) tokens per row: a chunk continuing a prefix, a fresh prompt, decodes (one at a page
# boundary), an empty row; three padded tokens follow
LSE_ROWS = [(9, 5), (0, 6), (17, 1), (8, 1), (0, 0)]
LSE_CASES = [
    pytest.param(8, 2, 1, 32, jnp.float32, None, None, None, id="mha"),
    pytest.param(8, 1, 3, 32, jnp.float32, 6, None, None, id="group3-window"),  # the group padded to 4 rows
    pytest.param(16, 1, 4, 16, jnp.float32, None, 5.0, None, id="group4-soft-cap"),  # 16 x 16 tiles: the dot path
    pytest.param(8, 1, 2, 32, jnp.bfloat16, 5, 20.0, jnp.uint8, id="fp8-bf16-window-cap"),
]


@pytest.mark.parametrize("page_size,num_kv_heads,group,head_dim,dtype,window,soft_cap,cache_dtype", LSE_CASES)
def test_ragged_kernel_lse_and_sinks(page_size, num_kv_heads, group, head_dim, dtype, window, soft_cap, cache_dtype):
    arrays, positions, query_start_loc, seq_lens, page_table = _case(
        page_size, num_kv_heads, group, head_dim, dtype, rows=LSE_ROWS, seed=7, cache_dtype=cache_dtype)
    sm_scale = head_dim**-0.5
    options = dict(sm_scale=sm_scale, sliding_window=window, soft_cap=soft_cap)
    args = (arrays["q"], arrays["k_cache"], arrays["v_cache"], jnp.int32(LAYER), jnp.asarray(query_start_loc),
            jnp.asarray(seq_lens), jnp.asarray(page_table))
    attend = functools.partial(kernel.ragged_paged_attention, interpret=True, **options)
    plain = jax.jit(attend)(*args)  # jitted: one compile instead of many small eager ones (a faster test)
    out, lse = jax.jit(functools.partial(attend, return_lse=True))(*args)
    ref_out, ref_lse = jax.jit(functools.partial(reference.ragged_paged_attention, return_lse=True, **options))(
        arrays["q"], arrays["k_clean"], arrays["v_clean"], jnp.int32(LAYER), jnp.asarray(positions),
        jnp.asarray(query_start_loc), jnp.asarray(page_table),
    )
    num_tokens, num_heads, _ = arrays["q"].shape
    real = int(query_start_loc[-1])
    assert out.dtype == plain.dtype and lse.shape == (num_tokens, num_heads) and lse.dtype == jnp.float32
    assert np.array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32)), "out changed"
    lse = np.asarray(lse)
    assert not np.isnan(lse).any() and np.isfinite(lse[:real]).all()
    assert (lse[real:] == -np.inf).all(), "padded tokens: exactly -inf"
    np.testing.assert_allclose(lse[:real], np.asarray(ref_lse)[:real], rtol=1e-5, atol=1e-5)
    tolerance = 1e-5 if dtype == jnp.float32 else 1e-2
    assert _relative_error(out[:real], ref_out[:real]) < tolerance

    # sinks: out * sigmoid(lse - sink) == softmax over [scores, sink] with the sink dropped
    sinks = 2.0 * np.random.default_rng(8).standard_normal(num_heads).astype(np.float32)  # (Hq,)
    with_sinks = np.asarray(out, np.float32) * np.asarray(jax.nn.sigmoid(lse - sinks))[..., None]  # (T, Hq, D)
    assert np.isfinite(with_sinks).all() and (with_sinks[real:] == 0).all(), "padded tokens stay 0"
    q = np.asarray(arrays["q"], np.float64)  # (T, Hq, D)
    k = np.asarray(from_cache(arrays["k_clean"][LAYER], dtype), np.float64)  # (P, S, Hkv, D) as the kernel reads it
    v = np.asarray(from_cache(arrays["v_clean"][LAYER], dtype), np.float64)
    row = np.searchsorted(query_start_loc, np.arange(real), side="right") - 1  # (real,)
    direct = np.zeros((real, num_heads, head_dim))
    for token in range(real):
        seen = np.arange(0 if window is None else max(positions[token] - window + 1, 0), positions[token] + 1)
        pages = page_table[row[token], seen // page_size]  # (K,)
        direct[token] = attention_with_sinks(q[token], k[pages, seen % page_size], v[pages, seen % page_size],
                                              sinks.astype(np.float64), sm_scale=sm_scale, soft_cap=soft_cap)
    assert _relative_error(with_sinks[:real], direct) < tolerance
