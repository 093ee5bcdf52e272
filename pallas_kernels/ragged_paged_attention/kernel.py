"""Ragged paged attention as a Pallas kernel: one call for a whole mixed step, read straight from the pool.

Layout. The wrapper cuts every request's query tokens into blocks of `block_q` tokens (a request
with 1 query token, a decode, is one block) and lays them out as dense `(block, kv head, block_q *
group, head_dim)` tiles, so each program gets one tile: the `group` query heads of one KV head for
`block_q` consecutive tokens of one request (GQA without repeating K/V). The grid is
`(num_blocks, num_kv_heads)` with `num_blocks = T // block_q + R`, an upper bound on the blocks
any step of that shape can have; blocks past the last real one are empty and write zeros.

Each program walks its request's pages from the page table, only those its queries can see
(causal: up to the page of its last query; sliding window: from the page of its first visible
key), and keeps an online softmax in float32. K and V are read page by page straight out of the
`(L, P, S, Hkv, D)` caches with the layer index as an operand; nothing is gathered into a dense
copy. The caches are in q's dtype or hold e4m3 values (an fp8 KV cache, as float8 or as its uint8 bits,
`tile_math.FP8_BITS`): each page is cast to q's dtype as it is loaded; the scales are the model's to fold in.
Page tables, lengths and block metadata are plain int32 operands read inside the kernel (GPU Pallas lowerings
have no scalar prefetch).

GPU route: the Triton lowering, chosen explicitly with `triton.CompilerParams`. Mosaic GPU (JAX's
default GPU lowering, the one with Hopper's wgmma and TMA) wants a different program: `plgpu.kernel`
with explicit shared-memory buffers and TMA copies, which cannot gather pages at data-dependent
indices the way a pointer load can. The Triton route lowers this generic, page-gathering kernel as
written; Mosaic GPU is the next step for peak bandwidth, behind the same signature.

Status: verified against the plain-jnp reference in Pallas interpret mode on the CPU. The body
uses only operations the Triton lowering supports (2-D dots, exp, max, where, fori_loop, ref
indexing); GQA groups are padded to a power of two and a tile has 16 query rows, but the kernel
has not been compiled for a GPU yet (no GPU was available); `gpu_unsupported` lists the shapes the
Triton lowering cannot take. Pages of 8 tokens use a multiply-and-sum instead of a dot.

Log-sum-exp. With `return_lse=True` the kernel also writes, per query row of a tile, the log-sum-exp
of the scores it saw (`running_max + log(running_sum)` of its online softmax, float32; -inf where it
saw no key), as a second output; a static flag, so the default call compiles to the same program as
before. Attention sinks (gpt-oss: one learned logit per query head in the softmax denominator only)
are then `out * sigmoid(lse - sink)`, applied by the caller.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton

from pallas_kernels.ragged_paged_attention.reference import token_request_index
from pallas_kernels.tile_math import dot_fits, from_cache, matmul_f32
from pallas_kernels.ragged_paged_attention.tuning import NUM_STAGES, NUM_WARPS, block_q_for, padded_group

_MASKED = -1e30  # finite "minus infinity": keeps fully masked rows free of inf - inf


def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    page_table: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_q: int | None = None,
    interpret: bool = False,
    return_lse: bool = False,
    skip_decode_rows: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Causal attention of every query token over its own request's pages (see the module docstring).

    Request `r` owns query tokens `query_start_loc[r]:query_start_loc[r+1]`, the last of its
    `seq_lens[r]` tokens; their K/V must already be in the pages. Returns `(T, Hq, D)` in q's dtype;
    padded tokens (past `query_start_loc[-1]`) and empty rows get zeros.

    `return_lse=True` returns `(out, lse)` instead: `lse` `(T, Hq)` float32 is each query head's
    log-sum-exp over the keys it sees, of the scores as the softmax takes them (scaled by `sm_scale`,
    soft-capped, masked), so an attention sink `sink` (Hq,) gives `out * sigmoid(lse - sink)[..., None]`.
    Padded tokens get exactly -inf (sigmoid gives 0 there; never NaN). `out` is the same, bit for bit,
    as without it.

    `skip_decode_rows=True` leaves the rows with exactly one query token (decodes) to another kernel: they get
    no query block, and their tokens get zeros (and an lse of -inf), as padded tokens do. A mixed step then
    runs its decodes through the decode kernel and only its prompt chunks here.
    """
    # q: (T, Hq, D); k_cache, v_cache: (L, P, S, Hkv, D); query_start_loc: (R + 1,) int32
    # seq_lens: (R,) int32; page_table: (R, W) int32
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[2], k_cache.shape[3]
    group = num_heads // num_kv_heads
    tile_group = padded_group(group)  # query heads per KV head in a tile, a power of two
    block_q = block_q or block_q_for(group)
    rows = _block_layout(query_start_loc, seq_lens, num_tokens, block_q, skip_decode_rows)
    num_blocks = rows["row"].shape[0]
    rows_per_tile = block_q * tile_group

    token_index = jnp.clip(rows["first_token"][:, None] + jnp.arange(block_q), 0, num_tokens - 1)  # (NB, BQ)
    q_tiles = q[token_index].reshape(num_blocks, block_q, num_kv_heads, group, head_dim)
    q_tiles = jnp.pad(q_tiles, [(0, 0)] * 3 + [(0, tile_group - group), (0, 0)])  # (NB, BQ, Hkv, G', D)
    q_tiles = q_tiles.transpose(0, 2, 1, 3, 4).reshape(num_blocks, num_kv_heads, rows_per_tile, head_dim)

    kernel = functools.partial(
        _attention_kernel, group=tile_group, page_size=page_size, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap,
    )
    tile = pl.BlockSpec((None, None, rows_per_tile, head_dim), lambda b, h: (b, h, 0, 0))
    whole = pl.BlockSpec(memory_space=pl.ANY)
    out_shape = jax.ShapeDtypeStruct((num_blocks, num_kv_heads, rows_per_tile, head_dim), q.dtype)
    out_specs = tile
    if return_lse:  # a second output, (NB, Hkv, BQ * G) float32: one log-sum-exp per tile row
        out_shape = [out_shape, jax.ShapeDtypeStruct((num_blocks, num_kv_heads, rows_per_tile), jnp.float32)]
        out_specs = [tile, pl.BlockSpec((None, None, rows_per_tile), lambda b, h: (b, h, 0))]
    outputs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_blocks, num_kv_heads),
        in_specs=[whole] * 6 + [tile, whole, whole],
        out_specs=out_specs,
        interpret=interpret,
        compiler_params=None if interpret else triton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        name="ragged_paged_attention",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1), rows["row"], rows["first_position"], rows["num_queries"],
        seq_lens.astype(jnp.int32), page_table.astype(jnp.int32), q_tiles, k_cache, v_cache,
    )  # (NB, Hkv, BQ * G, D), and with return_lse (NB, Hkv, BQ * G) float32
    out_tiles = outputs[0] if return_lse else outputs

    out_tiles = out_tiles.reshape(num_blocks, num_kv_heads, block_q, tile_group, head_dim)[:, :, :, :group]
    out_tokens = out_tiles.transpose(0, 2, 1, 3, 4).reshape(num_blocks * block_q, num_heads, head_dim)
    slots = _token_slots(query_start_loc, rows["block_start"], num_tokens, block_q, num_blocks)  # (T,)
    if not return_lse:
        return out_tokens[slots]  # (T, Hq, D)
    lse_tiles = outputs[1].reshape(num_blocks, num_kv_heads, block_q, tile_group)[:, :, :, :group]
    lse_tokens = lse_tiles.transpose(0, 2, 1, 3).reshape(num_blocks * block_q, num_heads)  # (NB * BQ, Hq)
    return out_tokens[slots], lse_tokens[slots]  # (T, Hq, D), (T, Hq) float32


def _block_layout(query_start_loc: jax.Array, seq_lens: jax.Array, num_tokens: int, block_q: int,
                  skip_decode_rows: bool = False) -> dict:
    """Per query block: its request row, first token, first position and number of real queries; with
    `skip_decode_rows`, rows of one query token get no block."""
    # query_start_loc: (R + 1,) int32; seq_lens: (R,) int32
    num_rows = seq_lens.shape[0]
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # (R,)
    context_lens = seq_lens - query_lens  # (R,) tokens cached before this step's chunk
    blocks_per_row = (query_lens + block_q - 1) // block_q  # (R,)
    if skip_decode_rows:
        blocks_per_row = jnp.where(query_lens == 1, 0, blocks_per_row)  # (R,)
    block_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(blocks_per_row).astype(jnp.int32)])  # (R+1,)
    num_blocks = num_tokens // block_q + num_rows  # static bound on sum(ceil(query_len / block_q))
    block = jnp.arange(num_blocks, dtype=jnp.int32)  # (NB,)
    row = jnp.clip(jnp.searchsorted(block_start, block, side="right") - 1, 0, num_rows - 1).astype(jnp.int32)
    first_query = (block - block_start[row]) * block_q  # (NB,) offset of the block inside its request
    real = block < block_start[-1]  # (NB,)
    num_queries = jnp.where(real, jnp.clip(query_lens[row] - first_query, 0, block_q), 0).astype(jnp.int32)
    return {
        "row": row,
        "first_token": query_start_loc[row] + first_query,  # (NB,)
        "first_position": (context_lens[row] + first_query).astype(jnp.int32),  # (NB,)
        "num_queries": num_queries,  # (NB,)
        "block_start": block_start,  # (R+1,)
    }


def _token_slots(
    query_start_loc: jax.Array, block_start: jax.Array, num_tokens: int, block_q: int, num_blocks: int
) -> jax.Array:
    """Index of every query token in the flattened `(num_blocks * block_q)` output tiles; padded
    tokens, and those of rows without a block (skipped decodes), point at the last slot, which no real
    block reaches (its block is always empty)."""
    # query_start_loc: (R + 1,) int32; block_start: (R + 1,) int32
    token = jnp.arange(num_tokens, dtype=jnp.int32)  # (T,)
    row = token_request_index(query_start_loc, num_tokens)  # (T,)
    offset = token - query_start_loc[row]  # (T,)
    slot = (block_start[row] + offset // block_q) * block_q + offset % block_q  # (T,)
    has_block = offset // block_q < block_start[row + 1] - block_start[row]  # (T,)
    return jnp.where((token < query_start_loc[-1]) & has_block, slot, num_blocks * block_q - 1)


def _attention_kernel(
    layer_ref, row_ref, first_position_ref, num_queries_ref, seq_lens_ref, page_table_ref, q_ref, k_ref, v_ref,
    o_ref, *lse_ref, group: int, page_size: int, sm_scale: float, sliding_window: int | None,
    soft_cap: float | None,
):
    """One program: `block_q` tokens x `group` heads of one request and one KV head. Writes the
    normalised output tile `o_ref` (M, D) and, when the call asked for it, `lse_ref` (M,) float32: each
    row's log-sum-exp, -inf for rows that saw no key."""
    block = pl.program_id(0)
    kv_head = pl.program_id(1)
    layer = layer_ref[0]
    row = row_ref[block]
    seq_len = seq_lens_ref[row]
    first_position = first_position_ref[block]
    num_queries = num_queries_ref[block]
    rows_per_tile, head_dim = q_ref.shape

    q = q_ref[...]  # (M, D) with M = block_q * group, row m = query m // group, head m % group
    query_offset = jax.lax.broadcasted_iota(jnp.int32, (rows_per_tile, 1), 0) // group  # (M, 1)
    query_position = first_position + query_offset  # (M, 1)
    query_real = query_offset < num_queries  # (M, 1)
    last_position = first_position + num_queries - 1
    end_page = jnp.where(num_queries > 0, last_position // page_size + 1, 0)
    start_page = 0
    if sliding_window is not None:
        start_page = jnp.maximum(first_position - sliding_window + 1, 0) // page_size
    key_offset = jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)  # (1, S)
    use_dot = dot_fits(page_size, head_dim)
    value_offset = jax.lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)  # (S, 1)

    def visit_page(index, carry):
        running_max, running_sum, acc = carry  # (M, 1), (M, 1), (M, D) float32
        page = page_table_ref[row, index]
        k = from_cache(k_ref[layer, page, :, kv_head, :], q.dtype)  # (S, D): an fp8 page in the queries' dtype
        v = from_cache(v_ref[layer, page, :, kv_head, :], q.dtype)  # (S, D)
        # Slots past the sequence hold whatever a page's earlier owner left: keep it out of the sums.
        v = jnp.where(index * page_size + value_offset < seq_len, v, jnp.zeros_like(v))
        scores = matmul_f32(q, k.T, use_dot) * sm_scale  # (M, S)
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        key_position = index * page_size + key_offset  # (1, S)
        visible = (key_position <= query_position) & query_real  # (M, S)
        if sliding_window is not None:
            visible &= key_position > query_position - sliding_window
        scores = jnp.where(visible, scores, _MASKED)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=1, keepdims=True))  # (M, 1)
        probs = jnp.where(visible, jnp.exp(scores - new_max), 0.0)  # (M, S)
        rescale = jnp.exp(running_max - new_max)  # (M, 1)
        running_sum = rescale * running_sum + jnp.sum(probs, axis=1, keepdims=True)
        acc = rescale * acc + matmul_f32(probs.astype(v.dtype), v, use_dot)
        return new_max, running_sum, acc

    init = (
        jnp.full((rows_per_tile, 1), _MASKED, jnp.float32),
        jnp.zeros((rows_per_tile, 1), jnp.float32),
        jnp.zeros((rows_per_tile, head_dim), jnp.float32),
    )
    running_max, running_sum, acc = jax.lax.fori_loop(start_page, end_page, visit_page, init)
    out = jnp.where(running_sum > 0, acc / jnp.where(running_sum > 0, running_sum, 1.0), 0.0)  # (M, D)
    o_ref[...] = out.astype(o_ref.dtype)
    if lse_ref:
        # running_sum >= 1 once a key was seen (the max key adds exp(0)); rows that saw none: -inf
        seen = running_sum[:, 0] > 0  # (M,)
        lse = running_max[:, 0] + jnp.log(jnp.where(seen, running_sum[:, 0], 1.0))  # (M,)
        lse_ref[0][...] = jnp.where(seen, lse, -jnp.inf)

