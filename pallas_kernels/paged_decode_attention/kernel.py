"""Pallas paged attention for decode rows (one query token per row), with flash-decoding split-K.

Grid `(R, Hkv, num_splits)`: a program takes one row, one kv head and the `G = Hq // Hkv` query
heads that share it (GQA without repeating K/V), and one contiguous chunk of the row's page-table
slots. It walks its pages with a `fori_loop`, `pages_per_step` pages a step, reading their
`(S, D)` K and V slices of its kv head straight from the whole cache refs (no gather outside the
kernel; several pages a step are one `(n * S, D)` tile, as `pages_per_compute_block` in JAX's own
Triton paged attention), and keeps an online softmax in float32: running max `m`, running sum `l`
and the unnormalised output `acc`. Those partials go out per split; the wrapper merges the splits
with a log-sum-exp in plain jnp. With `return_lse=True` that merge also gives each query head's
log-sum-exp over all its keys (`m + log(l)` of the merged partials; attention sinks are
`out * sigmoid(lse - sink)`); the kernel itself is the same either way.
The caches are in q's dtype or hold e4m3 values (an fp8 KV cache, as float8 or as its uint8 bits,
`tile_math.FP8_BITS`): pages are cast to q's dtype as they are loaded; the scales are the model's to fold in.

Keys a row's query must not see (past `seq_len` in its last page, or before its sliding window)
are masked in the scores *and* zeroed in V, so stale or even non-finite values in those slots can
not leak into the output; pages wholly before the window are not read at all.

Written for the GPU Triton lowering (forced with Triton `CompilerParams`; whole-array GMEM refs
for the caches, the page table and the lengths instead of scalar prefetch; power-of-two blocks,
so the wrapper pads each q group to `Gp` rows, a power of two >= 16; a dot on 2-D blocks
only when every dimension is >= 16, otherwise broadcast-multiply-sum). The tests check it with
`interpret=True` (Pallas's interpreter on the CPU) and lower it to Triton IR for CUDA; on an H200
(jax 0.11.2) it compiled and passed the correctness checks at one page a step (docs/benchmarks.md);
several pages a step has not yet run on a GPU. On a GPU, page size and head dim must be powers of
two. Interpret mode slices the whole caches once per program, so it is for tests only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.tile_math import FP8_BITS, dot_fits, from_cache, matmul_f32
from pallas_kernels.paged_decode_attention.tuning import (
    PAGES_PER_STEP,
    TRITON_NUM_STAGES,
    TRITON_NUM_WARPS,
    choose_num_splits,
)

# Query heads of a kv head are padded to a power of two >= this many rows, so the per-program
# q block is a legal Triton tensor and a legal `tl.dot` operand (M >= 16).
MIN_GROUP_ROWS = 16


def _padded_group(group: int) -> int:
    """Rows of the per-program q block: the next power of two >= max(group, MIN_GROUP_ROWS)."""
    return max(pl.next_power_of_2(group), MIN_GROUP_ROWS)


def _first_key(seq_len, sliding_window: int | None):
    """First key position a query at `seq_len - 1` may see."""
    # seq_len: () or (...) int32
    if sliding_window is None:
        return jnp.zeros_like(seq_len)
    return jnp.maximum(seq_len - sliding_window, 0)


def split_page_range(split, seq_len, *, page_size: int, pages_per_split: int, sliding_window: int | None):
    """Page-table slots `[start, end)` that split `split` of a row with `seq_len` keys walks.

    Split s owns slots `[s * pages_per_split, (s + 1) * pages_per_split)`, cut to the row's pages
    `[0, cdiv(seq_len, S))` and, with a sliding window, to the pages from the window's first key.
    `end <= start` means the split has nothing to do. Works on scalars (in the kernel) or arrays.
    """
    # split, seq_len: () or broadcastable (...) int32
    num_pages = (seq_len + page_size - 1) // page_size  # pages the row uses
    first_page = _first_key(seq_len, sliding_window) // page_size  # first page inside the window
    start = jnp.maximum(split * pages_per_split, first_page)
    end = jnp.minimum((split + 1) * pages_per_split, num_pages)
    return start, end


def _load_pages(k_ref, v_ref, page_table_ref, layer, row, kv_head, first_slot, end, *, pages_per_step: int):
    """K and V of page-table slots `[first_slot, first_slot + pages_per_step)` of `row` for one kv head.

    One page is a scalar-indexed `(S, D)` read; several are one gather of `(n, S, D)` flattened to
    `(n * S, D)` keys. Slots at or past `end` (the split's end) read the null page 0 instead (the caller
    masks them), so a step never reads a page of the next split; the wrapper pads the page table with
    `n - 1` null slots, so the slot slice never runs past it.
    """
    # k_ref, v_ref: (L, P, S, Hkv, D) whole caches; page_table_ref: (R, W + n - 1) int32
    if pages_per_step == 1:
        page = page_table_ref[row, first_slot]  # () int32
        return k_ref[layer, page, :, kv_head, :], v_ref[layer, page, :, kv_head, :]  # (S, D) each
    slots = first_slot + jax.lax.broadcasted_iota(jnp.int32, (pages_per_step,), 0)  # (n,)
    pages = page_table_ref[row, pl.ds(first_slot, pages_per_step)]  # (n,) int32
    pages = jnp.where(slots < end, pages, 0)  # (n,): null page for slots of the next split
    k = k_ref[layer, pages, :, kv_head, :]  # (n, S, D)
    v = v_ref[layer, pages, :, kv_head, :]  # (n, S, D)
    keys = pages_per_step * k.shape[1]
    return k.reshape(keys, k.shape[2]), v.reshape(keys, v.shape[2])  # (n * S, D) each


def _decode_kernel(
    layer_ref, seq_lens_ref, page_table_ref, q_ref, k_ref, v_ref,  # inputs
    m_ref, l_ref, acc_ref,  # outputs
    *, sm_scale: float, sliding_window: int | None, soft_cap: float | None, page_size: int,
    pages_per_split: int, pages_per_step: int, use_dot: bool,
):
    """One (row, kv head, split): online softmax over the split's pages of that row, `pages_per_step`
    pages (`n * S` keys) per loop step."""
    # layer_ref: (1,) int32; seq_lens_ref: (R,) int32; page_table_ref: (R, W + n - 1) int32  (whole arrays)
    # q_ref: (Gp, D) block; k_ref, v_ref: (L, P, S, Hkv, D) whole caches
    # m_ref, l_ref: (Gp,) float32 blocks; acc_ref: (Gp, D) float32 block
    row = pl.program_id(0)
    kv_head = pl.program_id(1)
    split = pl.program_id(2)
    layer = layer_ref[0]  # () int32
    seq_len = seq_lens_ref[row]  # () int32
    first_key = _first_key(seq_len, sliding_window)  # () int32: first key position the query may see
    start, end = split_page_range(
        split, seq_len, page_size=page_size, pages_per_split=pages_per_split,
        sliding_window=sliding_window,
    )  # () int32 each; end <= start for an empty split
    # keys a step may see: the row's, inside the window, and (several pages a step) inside the split
    last_key = jnp.minimum(seq_len, end * page_size)  # () int32: one past the split's last visible key
    keys_per_step = pages_per_step * page_size

    q = q_ref[...]  # (Gp, D)
    group_rows, head_dim = q.shape

    def body(step, carry):
        m, l, acc = carry  # (Gp,), (Gp,), (Gp, D) float32
        first_slot = start + step * pages_per_step  # () int32
        k, v = _load_pages(
            k_ref, v_ref, page_table_ref, layer, row, kv_head, first_slot, end, pages_per_step=pages_per_step,
        )  # (n * S, D) each
        k, v = from_cache(k, q.dtype), from_cache(v, q.dtype)  # an fp8 cache's pages in the queries' dtype
        key_pos = first_slot * page_size + jax.lax.broadcasted_iota(jnp.int32, (keys_per_step,), 0)  # (n * S,)
        visible = (key_pos < last_key) & (key_pos >= first_key)  # (n * S,)
        v = jnp.where(visible[:, None], v, jnp.zeros_like(v))  # (n * S, D): unseen slots may hold anything
        s = matmul_f32(q, k.T, use_dot)  # (Gp, n * S)
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(visible[None, :], s, -jnp.inf)  # (Gp, n * S)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))  # (Gp,)
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # (Gp,): no (-inf) - (-inf)
        alpha = jnp.exp(m - m_safe)  # (Gp,)
        p = jnp.exp(s - m_safe[:, None])  # (Gp, n * S) float32
        l_new = alpha * l + jnp.sum(p, axis=1)  # (Gp,)
        p = p.astype(v.dtype)  # (Gp, n * S)
        pv = matmul_f32(p, v, use_dot)  # (Gp, D)
        acc_new = alpha[:, None] * acc + pv  # (Gp, D)
        return m_new, l_new, acc_new

    m0 = jnp.full((group_rows,), -jnp.inf, jnp.float32)  # (Gp,)
    l0 = jnp.zeros((group_rows,), jnp.float32)  # (Gp,)
    acc0 = jnp.zeros((group_rows, head_dim), jnp.float32)  # (Gp, D)
    num_steps = (end - start + pages_per_step - 1) // pages_per_step  # () int32; <= 0 for an empty split
    m, l, acc = jax.lax.fori_loop(0, num_steps, body, (m0, l0, acc0))
    m_ref[...] = m
    l_ref[...] = l
    acc_ref[...] = acc


def combine_splits(
    m: jax.Array, l: jax.Array, acc: jax.Array, *, return_lse: bool = False
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Log-sum-exp merge of per-split partials into normalised outputs (zeros where nothing was seen).

    Empty splits (m = -inf, l = 0, acc = 0) get weight 0; rows with no keys at all give 0, never NaN.
    Returns `(..., G, D)` float32; with `return_lse=True`, `(out, lse)` where `lse` `(..., G)` float32 is
    the log-sum-exp over every split's keys, `m_max + log(l_total)`, and exactly -inf where nothing was seen.
    """
    # m, l: (..., NS, G) float32; acc: (..., NS, G, D) float32
    m_max = jnp.max(m, axis=-2, keepdims=True)  # (..., 1, G)
    m_max = jnp.where(jnp.isfinite(m_max), m_max, 0.0)  # (..., 1, G)
    weight = jnp.exp(m - m_max)  # (..., NS, G); exp(-inf) = 0 for empty splits
    l_total = jnp.sum(weight * l, axis=-2)  # (..., G)
    acc_total = jnp.sum(weight[..., None] * acc, axis=-3)  # (..., G, D)
    seen = l_total > 0  # (..., G)
    out = acc_total / jnp.where(seen, l_total, 1.0)[..., None]  # (..., G, D)
    out = jnp.where(seen[..., None], out, 0.0)  # (..., G, D)
    if not return_lse:
        return out
    lse = jnp.where(seen, m_max[..., 0, :] + jnp.log(jnp.where(seen, l_total, 1.0)), -jnp.inf)  # (..., G)
    return out, lse


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "sliding_window", "soft_cap", "num_splits", "num_warps", "num_stages", "pages_per_step",
        "interpret", "return_lse",
    ),
)
def paged_decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    seq_lens: jax.Array,
    page_table: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_splits: int | None = None,
    num_warps: int = TRITON_NUM_WARPS,
    num_stages: int = TRITON_NUM_STAGES,
    pages_per_step: int = PAGES_PER_STEP,
    interpret: bool = False,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Decode attention of each row's single query (position `seq_lens[r] - 1`) over its paged K/V.

    Row r sees keys `0..seq_lens[r]-1` of the pages `page_table[r, :cdiv(seq_lens[r], S)]`
    (only the last `sliding_window` keys when set); `soft_cap` maps scaled scores `s` to
    `cap * tanh(s / cap)`. Float32 softmax and accumulation; returns `(R, Hq, D)` in q's dtype,
    zeros for padded rows (`seq_len == 0`). `num_splits=None` picks
    `tuning.choose_num_splits(R, Hkv, W)`; `num_warps` and `num_stages` are Triton's launch settings;
    `pages_per_step` (a power of two) is how many pages a program reads per loop step, as one
    `(pages_per_step * S, D)` tile (JAX's Triton paged attention calls it `pages_per_compute_block`);
    the defaults are in `tuning`. `interpret=True` runs Pallas's interpreter (CPU).

    `return_lse=True` returns `(out, lse)`: `lse` `(R, Hq)` float32 is each query head's log-sum-exp over
    the keys it sees, of the scores as the softmax takes them (scaled, soft-capped, masked), merged over the
    splits; padded rows get exactly -inf. An attention sink `sink` (Hq,) then gives
    `out * sigmoid(lse - sink)[..., None]` (0 on padded rows, never NaN). `out` is the same either way.
    """
    # q: (R, Hq, D); k_cache, v_cache: (L, P, S, Hkv, D); layer: () int
    # seq_lens: (R,) int32; page_table: (R, W) int32
    num_rows, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, cache_head_dim = k_cache.shape
    num_slots = page_table.shape[1]
    if num_heads % num_kv_heads or cache_head_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"shapes do not fit: q {q.shape}, k_cache {k_cache.shape}, v_cache {v_cache.shape}"
        )
    if {k_cache.dtype, v_cache.dtype} - {q.dtype, jnp.dtype(jnp.float8_e4m3fn), FP8_BITS}:
        raise ValueError(f"the caches must be in q's dtype, float8_e4m3fn or its bits (uint8): {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    if num_rows == 0 or num_slots == 0:
        if return_lse:
            return jnp.zeros_like(q), jnp.full((num_rows, num_heads), -jnp.inf, jnp.float32)  # (R, Hq, D), (R, Hq)
        return jnp.zeros_like(q)  # (R, Hq, D)
    if num_splits is None:
        num_splits = choose_num_splits(num_rows, num_kv_heads, num_slots)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if pages_per_step < 1 or pages_per_step & (pages_per_step - 1):
        raise ValueError(f"pages_per_step must be a power of two >= 1, got {pages_per_step}")
    group = num_heads // num_kv_heads
    group_rows = _padded_group(group)
    pages_per_split = pl.cdiv(num_slots, num_splits)

    seq_lens = seq_lens.astype(jnp.int32)  # (R,)
    q_groups = q.reshape(num_rows, num_kv_heads, group, head_dim)  # (R, Hkv, G, D)
    q_groups = jnp.pad(q_groups, ((0, 0), (0, 0), (0, group_rows - group), (0, 0)))  # (R, Hkv, Gp, D)
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)  # (1,)

    kernel = functools.partial(
        _decode_kernel, sm_scale=float(sm_scale), sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap), page_size=page_size,
        pages_per_split=pages_per_split, pages_per_step=pages_per_step,
        use_dot=dot_fits(pages_per_step * page_size, head_dim),
    )
    # (R, W + n - 1): null slots after the last, so a step's slot slice never runs past the table
    page_table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, pages_per_step - 1)))
    whole = pl.BlockSpec()  # the whole array, read with computed indices inside the kernel
    partial_spec = pl.BlockSpec(
        (pl.squeezed, pl.squeezed, pl.squeezed, group_rows), lambda r, h, s: (r, h, s, 0)
    )
    m, l, acc = pl.pallas_call(
        kernel,
        grid=(num_rows, num_kv_heads, num_splits),
        in_specs=[
            whole,  # layer
            whole,  # seq_lens
            whole,  # page_table
            pl.BlockSpec((pl.squeezed, pl.squeezed, group_rows, head_dim), lambda r, h, s: (r, h, 0, 0)),
            whole,  # k_cache
            whole,  # v_cache
        ],
        out_specs=[
            partial_spec,  # m
            partial_spec,  # l
            pl.BlockSpec(
                (pl.squeezed, pl.squeezed, pl.squeezed, group_rows, head_dim),
                lambda r, h, s: (r, h, s, 0, 0),
            ),  # acc
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_rows, num_kv_heads, num_splits, group_rows), jnp.float32),
            jax.ShapeDtypeStruct((num_rows, num_kv_heads, num_splits, group_rows), jnp.float32),
            jax.ShapeDtypeStruct((num_rows, num_kv_heads, num_splits, group_rows, head_dim), jnp.float32),
        ],
        # Triton, not Mosaic GPU (the default GPU backend would stage whole-array blocks in SMEM)
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_attention",
    )(layer_arr, seq_lens, page_table, q_groups, k_cache, v_cache)
    # m, l: (R, Hkv, NS, Gp) float32; acc: (R, Hkv, NS, Gp, D) float32

    merged = combine_splits(m[..., :group], l[..., :group], acc[..., :group, :], return_lse=return_lse)
    out = merged[0] if return_lse else merged  # (R, Hkv, G, D)
    out = out.reshape(num_rows, num_heads, head_dim)  # (R, Hq, D)
    out = jnp.where(seq_lens[:, None, None] > 0, out, 0.0)  # (R, Hq, D)
    if not return_lse:
        return out.astype(q.dtype)
    lse = jnp.where(seq_lens[:, None] > 0, merged[1].reshape(num_rows, num_heads), -jnp.inf)  # (R, Hq)
    return out.astype(q.dtype), lse
