"""Pallas paged decode attention (interpret mode on the CPU) against the plain-jnp reference.

Every key a row's query must not see is NaN in the kernel's caches: other layers, the null page,
pool pages no row owns, the slots past `seq_len` in a row's last page and the keys before its
sliding window. The reference gets the same caches with those slots zeroed. A slot the kernel
wrongly treats as visible (wrong layer, wrong page, off-by-one mask) turns its output into NaN.
The kernel masks unseen slots in the scores and zeroes them in V (stale slots may hold anything),
so a *masked* read of a poisoned page cannot show up as NaN; which pages each split walks is
checked separately on `split_page_range`, the function the kernel takes its loop bounds from.

`return_lse=True` (the log-sum-exp that attention sinks need, merged over the splits) is checked against the
reference's LSE and, with random sinks, against a softmax-with-sink written out in numpy from the gathered K/V.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import attention_with_sinks

from pallas_kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_reference
from pallas_kernels.paged_decode_attention.kernel import combine_splits, split_page_range
from pallas_kernels.paged_decode_attention.tuning import (
    MAX_SPLITS,
    MIN_PAGES_PER_SPLIT,
    TARGET_PROGRAMS,
    choose_num_splits,
)
from pallas_kernels.tile_math import from_cache, to_cache

F32, BF16 = jnp.float32, jnp.bfloat16
TOLERANCE = {F32: 1e-5, BF16: 1e-2}
LAYER = 1
NUM_LAYERS = 2
SPARE_PAGES = 3  # pool pages no row owns (poisoned)


def make_case(seed, seq_lens, width, page_size, num_kv_heads, group, head_dim, dtype, *,
              sliding_window=None, q_scale=1.0):
    """Random decode inputs; returns (q, poisoned k, poisoned v, clean k, clean v, seq_lens, page_table)."""
    rng = np.random.default_rng(seed)
    num_rows = len(seq_lens)
    row_pages = [-(-n // page_size) for n in seq_lens]
    assert max(row_pages) <= width
    num_pages = 1 + sum(row_pages) + SPARE_PAGES
    shape = (NUM_LAYERS, num_pages, page_size, num_kv_heads, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)  # (L, P, S, Hkv, D)
    v = rng.standard_normal(shape).astype(np.float32)  # (L, P, S, Hkv, D)
    q = q_scale * rng.standard_normal((num_rows, group * num_kv_heads, head_dim)).astype(np.float32)  # (R, Hq, D)

    page_ids = rng.permutation(np.arange(1, num_pages))  # (P - 1,) page 0 stays the null page
    page_table = np.zeros((num_rows, width), np.int32)  # (R, W): unused slots -> null page 0
    seen = np.zeros((NUM_LAYERS, num_pages, page_size), bool)  # (L, P, S): slots a query may see
    next_page = 0
    for row, (seq_len, n) in enumerate(zip(seq_lens, row_pages)):
        pages = page_ids[next_page:next_page + n]
        next_page += n
        page_table[row, :n] = pages
        first_key = 0 if sliding_window is None else max(seq_len - sliding_window, 0)
        for pos in range(first_key, seq_len):
            seen[LAYER, pages[pos // page_size], pos % page_size] = True

    mask = seen[:, :, :, None, None]  # (L, P, S, 1, 1)
    as_dtype = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (
        as_dtype(q), as_dtype(np.where(mask, k, np.nan)), as_dtype(np.where(mask, v, np.nan)),
        as_dtype(np.where(mask, k, 0.0)), as_dtype(np.where(mask, v, 0.0)),
        jnp.asarray(seq_lens, jnp.int32), jnp.asarray(page_table),
    )


def check(seq_lens, width, page_size, num_kv_heads, group, head_dim, dtype, *, num_splits,
          sliding_window=None, soft_cap=None, q_scale=1.0, seed=0, pages_per_step=1):
    """Run kernel and reference on one case and compare them."""
    q, k_bad, v_bad, k_ok, v_ok, lens, table = make_case(
        seed, seq_lens, width, page_size, num_kv_heads, group, head_dim, dtype,
        sliding_window=sliding_window, q_scale=q_scale,
    )
    options = dict(sm_scale=1.0 / math.sqrt(head_dim), sliding_window=sliding_window, soft_cap=soft_cap)
    # jitted: one compile each instead of many small eager ones (a faster test, above all on an empty cache)
    out = jax.jit(functools.partial(paged_decode_attention, layer=LAYER, num_splits=num_splits,
                                    pages_per_step=pages_per_step, interpret=True, **options))(
        q, k_bad, v_bad, seq_lens=lens, page_table=table)  # (R, Hq, D)
    ref = jax.jit(functools.partial(paged_decode_attention_reference, layer=LAYER, **options))(
        q, k_ok, v_ok, seq_lens=lens, page_table=table)  # (R, Hq, D)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(F32))
    ref = np.asarray(ref.astype(F32))
    assert np.all(np.isfinite(out)), "kernel read a slot its query must not see (or made a NaN)"
    padded = np.asarray(seq_lens) == 0
    assert np.all(out[padded] == 0.0) and np.all(ref[padded] == 0.0)
    error = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"


# (group, Hkv, page size, head dim, dtype, num_splits, seq_lens, W); every group size 1..8,
# ragged lengths with 1, exact page boundaries and padded rows.
GQA_CASES = [
    (1, 2, 16, 64, F32, 2, [1, 32, 0, 61], 4),
    (2, 1, 8, 128, F32, 1, [8, 1, 45, 0], 6),
    (3, 2, 32, 64, F32, 4, [100, 0, 64, 1], 4),
    (4, 1, 16, 128, BF16, 2, [0, 17, 1, 128], 8),
    (5, 1, 8, 64, F32, None, [63, 64, 1, 0], 8),
    (6, 2, 16, 64, F32, 8, [33, 1, 0, 48], 4),  # more splits than page-table slots
    (7, 1, 32, 128, BF16, 4, [1, 0, 96, 200], 8),
    (8, 1, 16, 64, F32, 2, [16, 127, 0, 5], 8),
]


@pytest.mark.parametrize("group, num_kv_heads, page_size, head_dim, dtype, num_splits, seq_lens, width", GQA_CASES)
def test_gqa_groups_page_sizes_head_dims(group, num_kv_heads, page_size, head_dim, dtype, num_splits, seq_lens, width):
    check(seq_lens, width, page_size, num_kv_heads, group, head_dim, dtype, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 2, 4, 8, 16])
def test_num_splits(num_splits):
    # W = 8 slots: 16 splits leaves half of them empty for every row, the 1-page rows for all but one.
    check([1, 16, 0, 128], 8, 16, 2, 4, 64, F32, num_splits=num_splits, seed=1)


@pytest.mark.parametrize(
    "sliding_window, num_splits, dtype",
    [(1, 2, F32), (20, 4, F32), (32, 1, F32), (200, 2, F32), (20, 2, BF16)],
)
def test_sliding_window(sliding_window, num_splits, dtype):
    # keys before the window are NaN: pages wholly before it must not be read at all
    check([1, 40, 0, 128], 8, 16, 2, 2, 64, dtype, num_splits=num_splits, sliding_window=sliding_window, seed=2)


@pytest.mark.parametrize("soft_cap, dtype", [(5.0, F32), (30.0, F32), (5.0, BF16)])
def test_soft_cap(soft_cap, dtype):
    # q scaled up so raw scores run well past the cap
    check([3, 47, 64, 0], 4, 16, 1, 4, 64, dtype, num_splits=2, soft_cap=soft_cap, q_scale=4.0, seed=3)


def test_window_cap_small_pages_bfloat16():
    check([1, 50, 0, 29], 8, 8, 2, 3, 128, BF16, num_splits=4, sliding_window=12, soft_cap=10.0,
          q_scale=3.0, seed=4)


@pytest.mark.parametrize(
    "pages_per_step, page_size, num_splits, sliding_window, dtype",
    # splits of 3 and 2 slots with 2 and 4 pages a step: a step runs past its split's end (those keys are
    # the next split's: masked) and, on the last split, past the page table; pages of 8 with 2 a step take
    # the dot path (16 keys) where one page a step multiplies and sums
    [(2, 16, 3, None, F32), (4, 16, 4, None, BF16), (4, 8, 2, 12, F32), (2, 8, 1, None, F32)],
)
def test_pages_per_step(pages_per_step, page_size, num_splits, sliding_window, dtype):
    check([1, 40, 0, 8 * page_size - 3, page_size], 8, page_size, 2, 4, 64, dtype, num_splits=num_splits,
          sliding_window=sliding_window, pages_per_step=pages_per_step, seed=6)


@pytest.mark.parametrize("pages_per_step", [0, 3])
def test_pages_per_step_must_be_a_power_of_two(pages_per_step):
    q, k, v, _, _, lens, table = make_case(5, [3], 2, 16, 1, 2, 64, F32)
    with pytest.raises(ValueError, match="pages_per_step"):
        paged_decode_attention(q, k, v, LAYER, lens, table, sm_scale=0.125, pages_per_step=pages_per_step,
                               interpret=True)


def test_all_rows_padded_give_zeros():
    q, k, v, _, _, lens, table = make_case(5, [0, 0], 4, 16, 1, 2, 64, F32)
    out = paged_decode_attention(q, k, v, LAYER, lens, table, sm_scale=0.125, num_splits=2, interpret=True)
    assert np.all(np.asarray(out) == 0.0)
    # the early return of an empty page table, with the LSE: out 0, lse exactly -inf (test_lse_and_sinks
    # checks padded rows through the kernel)
    out, lse = paged_decode_attention(q, k, v, LAYER, lens, table[:, :0], sm_scale=0.125, interpret=True,
                                      return_lse=True)
    assert np.all(np.asarray(out) == 0.0) and lse.shape == (2, 2) and lse.dtype == F32
    assert np.all(np.asarray(lse) == -np.inf)


def test_choose_num_splits_rules():
    # enough rows x heads already fill the GPU: no split
    assert choose_num_splits(TARGET_PROGRAMS, 1, 4096) == 1
    assert choose_num_splits(1024, 8, 4096) == 1
    # few programs and long rows: split up to the cap; the H200 sweep's best settings
    assert choose_num_splits(1, 1, 4096) == MAX_SPLITS
    assert choose_num_splits(1, 8, 2048) == MAX_SPLITS
    assert choose_num_splits(8, 8, 2048) == 64  # 8 rows at 32k
    assert choose_num_splits(64, 8, 2048) == 16  # 64 rows at 32k
    assert choose_num_splits(64, 8, 512) == 16  # 64 rows at 8k
    assert choose_num_splits(8, 8, 128) == 8  # 8 rows at 2k: at least 16 pages a split
    # short rows: at least MIN_PAGES_PER_SPLIT slots per split, never more splits than slots
    assert choose_num_splits(1, 8, 2 * MIN_PAGES_PER_SPLIT) == 2
    assert choose_num_splits(1, 8, MIN_PAGES_PER_SPLIT - 1) == 1
    assert choose_num_splits(1, 8, 1) == 1
    assert choose_num_splits(1, 8, 0) == 1
    for rows in (1, 2, 3, 7, 16, 33, 256):
        for heads in (1, 2, 8):
            for slots in (0, 1, 3, 4, 5, 8, 13, 31, 64, 100, 1000):
                n = choose_num_splits(rows, heads, slots)
                assert 1 <= n <= MAX_SPLITS and n & (n - 1) == 0
                assert n == 1 or n * MIN_PAGES_PER_SPLIT <= slots
                # the smallest power of two reaching the target, unless a cap binds first
                assert n == 1 or rows * heads * (n // 2) < TARGET_PROGRAMS


@pytest.mark.parametrize("sliding_window", [None, 1, 7, 16, 40])
def test_splits_walk_exactly_the_rows_pages(sliding_window):
    # every page from the window's first page to the row's last page, each by exactly one split
    # (in its own chunk of slots), nothing past the row's pages nor before the window
    page_size = 8
    for width in (1, 3, 4, 8):
        seq_lens = np.arange(0, width * page_size + 1)  # (N,) every length the width allows
        for num_splits in (1, 2, 3, 4, 8, 16):
            per_split = -(-width // num_splits)
            splits = np.arange(num_splits)[:, None]  # (NS, 1)
            start, end = split_page_range(
                splits, seq_lens[None, :], page_size=page_size, pages_per_split=per_split,
                sliding_window=sliding_window,
            )  # (NS, N) each
            start, end = np.asarray(start), np.asarray(end)
            slots = np.arange(width)[:, None, None]  # (W, 1, 1)
            walked = (slots >= start[None]) & (slots < end[None])  # (W, NS, N)
            times = walked.sum(axis=1)  # (W, N)
            num_pages = -(-seq_lens // page_size)  # (N,)
            first_key = seq_lens * 0 if sliding_window is None else np.maximum(seq_lens - sliding_window, 0)
            wanted = (slots[:, 0] < num_pages) & (slots[:, 0] >= first_key // page_size)  # (W, N)
            np.testing.assert_array_equal(times, wanted.astype(times.dtype))
            assert np.all(walked <= ((slots >= splits * per_split) & (slots < (splits + 1) * per_split)))


def test_combine_splits_log_sum_exp_without_nans():
    # head 0: two live splits and an empty one; head 1: every split empty (a padded row)
    m = jnp.array([[1.0, -jnp.inf], [3.0, -jnp.inf], [-jnp.inf, -jnp.inf]])  # (NS, G)
    l = jnp.array([[2.0, 0.0], [1.0, 0.0], [0.0, 0.0]])  # (NS, G)
    acc = jnp.zeros((3, 2, 4)).at[0, 0].set(1.0).at[1, 0].set(5.0)  # (NS, G, D)
    with jax.debug_nans(True):  # no NaN in any intermediate either
        out = np.asarray(combine_splits(m, l, acc))  # (G, D)
        out_lse, lse = combine_splits(m, l, acc, return_lse=True)  # (G, D), (G,)
    w = math.exp(1.0 - 3.0)
    np.testing.assert_allclose(out[0], (w * 1.0 + 5.0) / (w * 2.0 + 1.0), rtol=1e-6)
    assert np.all(out[1] == 0.0)
    assert np.array_equal(np.asarray(out_lse), out)
    np.testing.assert_allclose(lse[0], math.log(math.exp(1.0) * 2.0 + math.exp(3.0) * 1.0), rtol=1e-6)
    assert lse[1] == -np.inf


@pytest.mark.parametrize(
    "page_size, head_dim, group, dtype, sliding_window, soft_cap, pages_per_step, cache_dtype",
    # dot path; broadcast-sum path; several pages a step (a gather of pages into one tile)
    # and an fp8 cache (e4m3 bits in uint8)
    [(16, 128, 4, BF16, None, None, 1, BF16), (8, 64, 3, F32, 12, 10.0, 1, F32), (16, 128, 4, BF16, 20, None, 4, BF16),
     (16, 128, 4, BF16, None, None, 2, jnp.uint8)],
)
def test_lowers_to_triton_ir(page_size, head_dim, group, dtype, sliding_window, soft_cap, pages_per_step,
                             cache_dtype):
    # Pallas -> Triton IR only (no PTX, no GPU): catches ops or shapes the Triton lowering rejects
    pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    num_rows, num_kv_heads, width = 4, 2, 8
    q = jax.ShapeDtypeStruct((num_rows, group * num_kv_heads, head_dim), dtype)  # (R, Hq, D)
    cache = jax.ShapeDtypeStruct((2, 64, page_size, num_kv_heads, head_dim), cache_dtype)  # (L, P, S, Hkv, D)
    lens = jax.ShapeDtypeStruct((num_rows,), jnp.int32)  # (R,)
    table = jax.ShapeDtypeStruct((num_rows, width), jnp.int32)  # (R, W)

    def attend(q, k, v, lens, table, return_lse=False):
        return paged_decode_attention(
            q, k, v, LAYER, lens, table, sm_scale=0.125, sliding_window=sliding_window,
            soft_cap=soft_cap, num_splits=2, num_warps=8, num_stages=3, pages_per_step=pages_per_step,
            return_lse=return_lse,
        )

    for function in (attend, functools.partial(attend, return_lse=True)):
        text = jax.jit(function).trace(q, cache, cache, lens, table).lower(lowering_platforms=("cuda",)).as_text()
        assert "xla.gpu.triton" in text
        assert "num_stages = 3 : i32, num_warps = 8 : i32" in text  # the launch settings asked for


@pytest.mark.parametrize(
    "group, num_kv_heads, page_size, head_dim, dtype, num_splits, pages_per_step, sliding_window, soft_cap, "
    "cache_dtype, seq_lens",
    # ragged lengths with 1, page boundaries and a padded row; splits left empty (3 splits of 4 slots for a
    # 1-page row), two pages a step (a step past its split's end), a window, a soft cap (q scaled past it),
    # an fp8 cache (e4m3 bits) under bfloat16 queries
    [(1, 2, 8, 32, F32, 2, 2, None, 5.0, None, [1, 17, 0, 32]),
     (3, 1, 8, 32, F32, 3, 1, 10, None, None, [1, 30, 0, 9]),
     (2, 2, 8, 32, BF16, 2, 1, 12, 10.0, jnp.uint8, [0, 27, 3, 16])],
    ids=["mha-cap-2-splits-2-pages-a-step", "group3-window-3-splits", "fp8-bf16-window-cap"],
)
def test_lse_and_sinks(group, num_kv_heads, page_size, head_dim, dtype, num_splits, pages_per_step,
                       sliding_window, soft_cap, cache_dtype, seq_lens):
    q, k_bad, v_bad, k_ok, v_ok, lens, table = make_case(
        7, seq_lens, 4, page_size, num_kv_heads, group, head_dim, dtype, sliding_window=sliding_window,
        q_scale=1.0 if soft_cap is None else 4.0,
    )
    if cache_dtype is not None:
        k_bad, v_bad, k_ok, v_ok = (to_cache(x, cache_dtype) for x in (k_bad, v_bad, k_ok, v_ok))
    sm_scale = 1.0 / math.sqrt(head_dim)
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    run = functools.partial(paged_decode_attention, q, k_bad, v_bad, LAYER, lens, table, num_splits=num_splits,
                            pages_per_step=pages_per_step, interpret=True, **options)
    plain = run()  # (R, Hq, D)
    out, lse = run(return_lse=True)  # (R, Hq, D), (R, Hq)
    reference = jax.jit(functools.partial(paged_decode_attention_reference, return_lse=True, **options))
    ref_out, ref_lse = reference(q, k_ok, v_ok, LAYER, lens, table)  # jitted: one compile, a faster test
    num_rows, num_heads, _ = q.shape
    assert out.dtype == plain.dtype and lse.shape == (num_rows, num_heads) and lse.dtype == F32
    assert np.array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32)), "out changed"
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    padded = np.asarray(seq_lens) == 0
    assert not np.isnan(lse).any() and np.isfinite(lse[~padded]).all()
    assert np.all(lse[padded] == -np.inf) and np.all(ref_lse[padded] == -np.inf)
    np.testing.assert_allclose(lse[~padded], ref_lse[~padded], rtol=1e-5, atol=1e-5)
    out = np.asarray(out, np.float32)
    assert np.max(np.abs(out - np.asarray(ref_out, np.float32))) / np.max(np.abs(out)) < TOLERANCE[dtype]

    # sinks: out * sigmoid(lse - sink) == softmax over [scores, sink] with the sink dropped
    sinks = 2.0 * np.random.default_rng(8).standard_normal(num_heads).astype(np.float32)  # (Hq,)
    with_sinks = out * np.asarray(jax.nn.sigmoid(lse - sinks))[..., None]  # (R, Hq, D)
    assert np.all(np.isfinite(with_sinks)) and np.all(with_sinks[padded] == 0.0), "padded rows stay 0"
    k = np.asarray(from_cache(k_ok[LAYER], dtype), np.float64)  # (P, S, Hkv, D) as the kernel reads it
    v = np.asarray(from_cache(v_ok[LAYER], dtype), np.float64)
    table = np.asarray(table)
    direct = np.zeros(with_sinks.shape)  # (R, Hq, D)
    for row, seq_len in enumerate(seq_lens):
        if seq_len:
            seen = np.arange(0 if sliding_window is None else max(seq_len - sliding_window, 0), seq_len)  # (K,)
            pages = table[row, seen // page_size]  # (K,)
            direct[row] = attention_with_sinks(
                np.asarray(q[row], np.float64), k[pages, seen % page_size], v[pages, seen % page_size],
                sinks.astype(np.float64), sm_scale=sm_scale, soft_cap=soft_cap)
    error = np.max(np.abs(with_sinks - direct)) / np.max(np.abs(direct))
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"
