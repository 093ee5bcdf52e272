"""The XLA attention path: tiled paged attention in plain jnp, bounded in memory on every platform.

The queries are taken in order of their row's length and processed `Tiles.queries` tokens at a time (a
sequential `lax.map`), and each tile walks its tokens' pages a chunk at a time with an online (flash) softmax
in float32. A tile's loop runs only over the chunks its tokens can see: from the first key inside the sliding
window of its earliest query to the position of its furthest query, so a short row never pays for the width
the step's longest row needs, and rows of like lengths share a tile. Each token gathers its own row's chunk,
`(Tq, C * page_size, Hkv, D)`; a tile whose tokens all belong to one row (the middle of a prefill chunk)
gathers that row's chunk once. Either way the memory held
at once is one chunk's, never the whole `(T, W * page_size, Hkv, D)` gather.

Semantics are those of `pallas_kernels/ragged_paged_attention/reference.py`: a query at position `p` sees
the keys `0..p` of its own request (the last `sliding_window` of them when a window is set). No key a query
cannot see reaches its result (such scores are masked and such V zeroed, so a NaN there stays out), and
padded tokens after the last real one get zeros, as in the kernels.

On a GPU, `make_backend` puts cuDNN's fused attention in front of this path for fresh prompts (see
attention/cudnn.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import jaxserve.attention.cudnn as cudnn
from jaxserve.attention.base import AttentionBackend, LayerAttention
from jaxserve.batch.descriptor import BatchDescriptor
from pallas_kernels.ragged_paged_attention import reference
from pallas_kernels.tile_math import from_cache

CPU_QUERY_TILE = 8  # measured: 3-4x faster than untiled on a 2-core CPU (docs/benchmarks.md)
# A CPU tile's gathered K + V per chunk (and, in one-row tiles, its scores): 8 pages of the benchmark models, so a
# tile walks about the pages its tokens need (measured against whole-width chunks: benchmarks/step_profile.py).
CPU_CHUNK_BYTES = 512 << 10
ACCELERATOR_QUERY_TILE = 64  # fewer, larger sequential steps on a GPU or TPU
ACCELERATOR_CHUNK_BYTES = 64 << 20  # a chunk's K + V (and, in one-row tiles, the tile's scores)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Static tile sizes of one compiled step: query tokens per tile, pages per key chunk when each token
    gathers its own row's pages, and pages per chunk when the whole tile is one row's (0: no such mode)."""

    queries: int
    pages: int
    row_pages: int = 0


def tile_sizes(num_tokens: int, width: int, page_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
               itemsize: int, platform: str) -> Tiles:
    """Tile sizes for a (T tokens, W pages) bucket, from a byte budget for one chunk's temporaries.

    The CPU takes query tiles of 8 and cache-sized chunks, accelerators tiles of 64 queries and larger chunks.
    A tile whose tokens all belong to one row (the middle of a prefill chunk) gathers that row's pages once, in
    chunks as large as the budget allows for K, V and the tile's scores. No chunk exceeds the width (a tile
    then takes one chunk, see `_walk_chunks`)."""
    cpu = platform == "cpu"
    queries = min(CPU_QUERY_TILE if cpu else ACCELERATOR_QUERY_TILE, num_tokens)
    budget = CPU_CHUNK_BYTES if cpu else ACCELERATOR_CHUNK_BYTES
    kv_bytes = page_size * 2 * num_kv_heads * head_dim * itemsize  # K and V of one page
    pages = int(max(1, min(budget // (queries * kv_bytes), width)))
    score_bytes = page_size * queries * num_heads * 4 * 2  # a page's float32 scores and probabilities
    return Tiles(queries=queries, pages=pages, row_pages=int(max(1, min(budget // (kv_bytes + score_bytes), width))))


def tiled_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    positions: jax.Array,
    token_rows: jax.Array,
    page_table: jax.Array,
    *,
    how: LayerAttention,
    tiles: Tiles,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of each query token over the pages of its row, tile by tile; `sinks` (Hq,): each head's
    attention sink, a logit in the softmax's denominator only.

    The tokens are taken in order of their row's length (`_length_order`), so a tile's loop over key chunks
    stops near each of its tokens' own length, and the tiles of padding do nothing. A token with a negative
    position sees nothing and gets zeros (padding)."""
    # q: (T, Hq, D); k_cache, v_cache: (L, P, S, Hkv, D); positions, token_rows: (T,) int32
    # page_table: (R, W) int32
    num_tokens = q.shape[0]
    order = _length_order(positions, token_rows, page_table.shape[0])  # (T,)
    q, positions, token_rows = q[order], positions[order], token_rows[order]  # (T, Hq, D), (T,), (T,)
    num_tiles = -(-num_tokens // tiles.queries)
    pad = num_tiles * tiles.queries - num_tokens
    q_tiles = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(num_tiles, tiles.queries, *q.shape[1:])
    position_tiles = jnp.pad(positions, (0, pad), constant_values=-1).reshape(num_tiles, tiles.queries)
    row_tiles = jnp.pad(token_rows, (0, pad)).reshape(num_tiles, tiles.queries)
    attend = functools.partial(_attend_tile, k_cache=k_cache, v_cache=v_cache, layer=layer, page_table=page_table,
                               how=how, tiles=tiles, sinks=sinks)
    if num_tiles == 1:
        out = attend((q_tiles[0], position_tiles[0], row_tiles[0]))[None]  # (1, Tq, Hq, D)
    else:
        out = jax.lax.map(attend, (q_tiles, position_tiles, row_tiles))  # (num_tiles, Tq, Hq, D)
    out = out.reshape(num_tiles * tiles.queries, *q.shape[1:])[:num_tokens]  # (T, Hq, D) in sorted order
    return jnp.zeros_like(out).at[order].set(out, unique_indices=True)


def _length_order(positions: jax.Array, token_rows: jax.Array, num_rows: int) -> jax.Array:
    """A stable order of the tokens by the furthest position of their row, padding last: tiles then hold rows
    of like lengths (each walks about its own tokens' pages) and a row's tokens stay together, in order."""
    # positions, token_rows: (T,) int32 -> (T,) int32
    row_end = jax.ops.segment_max(positions, token_rows, num_segments=num_rows)  # (R,)
    key = jnp.where(positions >= 0, row_end[token_rows], jnp.iinfo(jnp.int32).max)  # (T,)
    return jnp.argsort(key, stable=True).astype(jnp.int32)


def _attend_tile(tile, *, k_cache, v_cache, layer, page_table, how, tiles, sinks):
    """One query tile: each token over its own row's pages or, when `tiles.row_pages` is set and every real
    token of the tile belongs to one row, all of them over that row's pages, gathered once."""
    q, positions, rows = tile
    # q: (N, Hq, D); positions, rows: (N,) int32
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[3]
    q = q.reshape(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)  # (N, Hkv, G, D)
    walk = functools.partial(_walk_chunks, q, positions, k_cache=k_cache, v_cache=v_cache, layer=layer,
                             page_table=page_table, how=how)
    if tiles.row_pages:
        row = rows[jnp.argmax(positions >= 0)]  # () the first real token's row
        one_row = jnp.all((positions < 0) | (rows == row))  # ()
        stats = jax.lax.cond(one_row, lambda: walk(row[None], tiles.row_pages), lambda: walk(rows, tiles.pages))
    else:
        stats = walk(rows, tiles.pages)
    running_max, denominator, numerator = stats
    if sinks is not None:  # each head's sink joins the denominator, on a common max
        sink = sinks.astype(jnp.float32).reshape(1, num_kv_heads, -1)  # (1, Hkv, G)
        top = jnp.maximum(running_max, sink)  # (N, Hkv, G)
        rescale = jnp.exp(running_max - top)  # zero where nothing was visible
        numerator, denominator = numerator * rescale[..., None], denominator * rescale + jnp.exp(sink - top)
    out = numerator / jnp.where(denominator > 0, denominator, 1.0)[..., None]  # (N, Hkv, G, D)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def _walk_chunks(q, positions, key_rows, chunk_pages, *, k_cache, v_cache, layer, page_table, how):
    """The online softmax of a tile over the key chunks its tokens can see, `chunk_pages` pages at a time;
    `key_rows` holds each token's row, or one row for the whole tile.

    When one chunk spans the whole width, the tile instead takes a single chunk of the first W/4, W/2 or W
    pages, whichever holds its furthest query (a switch, no loop)."""
    # q: (N, Hkv, G, D); positions: (N,) int32; key_rows: (N,) or (1,) int32
    page_size, width = k_cache.shape[2], page_table.shape[1]

    def fold(carry, chunk, pages):
        k, v, visible = _gather_chunk(k_cache, v_cache, layer, page_table, key_rows, positions, chunk, pages,
                                      sliding_window=how.sliding_window)
        return _online_softmax_step(carry, q, k, v, visible, how)

    init = _empty_stats(q)
    if chunk_pages >= width:
        widths = sorted({max(width // 4, 1), max(width // 2, 1), width})
        pages_needed = jnp.max(positions) // page_size + 1  # () int32
        branch = jnp.sum(jnp.asarray(widths[:-1]) < pages_needed)  # () the first width that holds the tile
        return jax.lax.switch(branch, [functools.partial(fold, init, 0, pages) for pages in widths])
    first, stop = _chunk_range(positions, chunk_pages * page_size, how.sliding_window)
    return jax.lax.fori_loop(first, stop, lambda chunk, carry: fold(carry, chunk, chunk_pages), init)


def _empty_stats(q: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The online softmax's start: running max -inf, denominator and numerator zero."""
    # q: (N, Hkv, G, D)
    shape = q.shape[:3]
    return (jnp.full(shape, -jnp.inf, jnp.float32),  # running max (N, Hkv, G)
            jnp.zeros(shape, jnp.float32),  # running denominator (N, Hkv, G)
            jnp.zeros(q.shape, jnp.float32))  # running numerator (N, Hkv, G, D)


def _chunk_range(positions: jax.Array, chunk_keys: int, sliding_window: int | None) -> tuple[jax.Array, jax.Array]:
    """The key chunks [first, stop) a tile's tokens can see; empty when every token is padding."""
    # positions: (N,) int32, negative for padding
    stop = jnp.max(positions) // chunk_keys + 1  # () int32: 0 when all are negative
    if sliding_window is None:
        return jnp.int32(0), stop
    earliest = jnp.min(jnp.where(positions >= 0, positions, jnp.iinfo(jnp.int32).max))  # ()
    first = jnp.maximum(earliest - sliding_window + 1, 0) // chunk_keys  # () int32
    return jnp.minimum(first, stop), stop


def _gather_chunk(k_cache, v_cache, layer, page_table, key_rows, positions, chunk, chunk_pages, *, sliding_window):
    """Chunk `chunk` (of `chunk_pages` pages) of the pages of `key_rows` (one per token, or one for all):
    K, V (zeros where no token may look) and which keys each token sees."""
    # key_rows: (U,) int32, U = N or 1; positions: (N,) int32; page_table: (R, W) int32
    page_size, num_kv_heads, head_dim = k_cache.shape[2:]
    width = page_table.shape[1]
    columns = chunk * chunk_pages + jnp.arange(chunk_pages, dtype=jnp.int32)  # (C,) past W only at the end
    pages = page_table[key_rows[:, None], jnp.minimum(columns, width - 1)[None, :]]  # (U, C)
    key_pos = (columns[:, None] * page_size + jnp.arange(page_size, dtype=jnp.int32)).reshape(-1)  # (K,)
    visible = key_pos[None, :] <= positions[:, None]  # (N, K): keys past W are past every position
    if sliding_window is not None:
        visible &= key_pos[None, :] > positions[:, None] - sliding_window
    seen = visible if key_rows.shape[0] > 1 else jnp.any(visible, axis=0, keepdims=True)  # (U, K)
    shape = (key_rows.shape[0], chunk_pages * page_size, num_kv_heads, head_dim)
    k = k_cache[layer, pages].reshape(shape)  # (U, K, Hkv, D)
    v = v_cache[layer, pages].reshape(shape)  # (U, K, Hkv, D)
    return k, jnp.where(seen[:, :, None, None], v, 0), visible  # a hidden K only meets a masked score


def _online_softmax_step(carry, q, k, v, visible, how):
    """Fold one chunk of keys into the running (max, denominator, numerator) of every query head; the chunk
    is each token's own (U = N) or the whole tile's (U = 1)."""
    # q: (N, Hkv, G, D); k, v: (U, K, Hkv, D); visible: (N, K)
    running_max, denominator, numerator = carry  # (N, Hkv, G), (N, Hkv, G), (N, Hkv, G, D) float32
    k, v = from_cache(k, q.dtype), from_cache(v, q.dtype)  # an fp8 cache's pages in the queries' dtype
    shared = k.shape[0] == 1
    scores = (jnp.einsum("thgd,khd->thgk", q, k[0], preferred_element_type=jnp.float32) if shared else
              jnp.einsum("thgd,tkhd->thgk", q, k, preferred_element_type=jnp.float32)) * how.sm_scale
    if how.soft_cap is not None:
        scores = how.soft_cap * jnp.tanh(scores / how.soft_cap)
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)  # (N, Hkv, G, K)
    new_max = jnp.maximum(running_max, jnp.max(scores, axis=-1))  # (N, Hkv, G)
    shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # -inf while nothing was visible
    probs = jnp.exp(scores - shift[..., None]).astype(v.dtype)  # (N, Hkv, G, K): zero where hidden
    rescale = jnp.exp(running_max - shift)  # (N, Hkv, G): zero on the first visible chunk
    denominator = rescale * denominator + jnp.sum(probs.astype(jnp.float32), axis=-1)
    chunk_out = (jnp.einsum("thgk,khd->thgd", probs, v[0], preferred_element_type=jnp.float32) if shared else
                 jnp.einsum("thgk,tkhd->thgd", probs, v, preferred_element_type=jnp.float32))
    return new_max, denominator, rescale[..., None] * numerator + chunk_out


def step_tokens(batch: BatchDescriptor, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Each token's row and its position, -1 for the padded tokens after the last real one."""
    # query_start_loc: (R + 1,) int32; positions: (T,) int32
    token_rows = reference.token_request_index(batch.query_start_loc, num_tokens)  # (T,)
    real = jnp.arange(num_tokens, dtype=jnp.int32) < batch.query_start_loc[-1]  # (T,)
    return token_rows, jnp.where(real, batch.positions, -1)


def make_backend(platform: str, prefill_implementation: str | None = "auto") -> AttentionBackend:
    """The XLA backend for `platform` ('cpu', 'gpu' or 'tpu').

    `prefill_implementation` is the dense attention fresh prompts take in front of the tiled path
    (attention/cudnn.py): 'auto' is 'cudnn' on a GPU and None (the tiled path alone) elsewhere; 'xla' runs
    the same glue through XLA's dense attention, as the CPU tests do. A soft-capped layer, or one with attention
    sinks, takes the tiled path alone (the dense implementations have neither)."""
    if prefill_implementation == "auto":
        prefill_implementation = "cudnn" if platform == "gpu" else None

    def attention(q, caches, layer, batch: BatchDescriptor, how: LayerAttention, sinks=None):
        k_cache, v_cache = caches
        token_rows, positions = step_tokens(batch, q.shape[0])  # (T,), (T,)

        def tiled(q, k_cache, v_cache, layer, positions, token_rows, page_table):
            # q: (N, Hq, D); positions, token_rows: (N,) int32; page_table: (R, W) int32
            tiles = tile_sizes(q.shape[0], page_table.shape[1], k_cache.shape[2], q.shape[1], k_cache.shape[3],
                               k_cache.shape[4], max(k_cache.dtype.itemsize, q.dtype.itemsize), platform)
            return tiled_attention(q, k_cache, v_cache, layer, positions, token_rows, page_table, how=how,
                                   tiles=tiles, sinks=sinks)

        if prefill_implementation is None or how.soft_cap is not None or sinks is not None:
            return tiled(q, k_cache, v_cache, layer, positions, token_rows, batch.page_table)
        return cudnn.prefill_or_tiled(
            q, k_cache, v_cache, layer, positions, token_rows, batch, tiled=tiled, sm_scale=how.sm_scale,
            sliding_window=how.sliding_window, implementation=prefill_implementation,
        )

    def write_kv(caches, layer, k, v, batch: BatchDescriptor):
        return reference.write_kv(*caches, layer, k, v, batch.slot_mapping)

    return AttentionBackend("xla", "split", attention, write_kv, options=(platform, prefill_implementation))
