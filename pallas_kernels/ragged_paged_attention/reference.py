"""Plain-jnp ragged paged attention: the definition of correct for the Pallas kernels.

One call serves a whole mixed step: decodes (one query token), prefill chunks (many query tokens,
causal inside the chunk, full attention to the cached prefix) and padded empty rows. Queries are
flattened over the batch; request `r` owns query tokens `query_start_loc[r]:query_start_loc[r+1]`
and its K/V live in pages `page_table[r, :]` of the pool. The new tokens' K/V must already be
written into the pages (see `write_kv`).

Work scales with the page-table width the caller passes (`W`), not with the pool or with
`max_model_len`: the batch builder sizes `W` to the longest sequence in the step. Each query
token gathers its own row's pages at once, so this is for tests and small shapes; the engine's XLA path
(jaxserve/attention/xla.py) computes the same in bounded tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.tile_math import from_cache, to_cache


def token_request_index(query_start_loc: jax.Array, num_tokens: int) -> jax.Array:
    """Request row of every flattened query token; padded tokens map to the last row."""
    # query_start_loc: (R + 1,) int32, non-decreasing, padded entries equal the real total
    num_rows = query_start_loc.shape[0] - 1
    token_ids = jnp.arange(num_tokens, dtype=jnp.int32)  # (T,)
    rows = jnp.searchsorted(query_start_loc, token_ids, side="right") - 1  # (T,)
    return jnp.clip(rows, 0, num_rows - 1).astype(jnp.int32)


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter the step's new K/V into their slots of layer `layer` (padded slots point at page 0)."""
    # k_cache, v_cache: (L, P, S, Hkv, D); k, v: (T, Hkv, D); slot_mapping: (T,) int32 = page * S + offset
    page_size = k_cache.shape[2]
    pages = slot_mapping // page_size  # (T,)
    offsets = slot_mapping % page_size  # (T,)
    k_cache = k_cache.at[layer, pages, offsets].set(to_cache(k, k_cache.dtype))
    v_cache = v_cache.at[layer, pages, offsets].set(to_cache(v, v_cache.dtype))
    return k_cache, v_cache


def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    positions: jax.Array,
    query_start_loc: jax.Array,
    page_table: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Causal attention of every query token over its own request's paged K/V.

    A query at absolute position `p` sees the keys at positions `0..p` of its request (and only
    the last `sliding_window` of them when a window is set). Softmax runs in float32. The caches are in
    q's dtype, in float8_e4m3fn or in its bits (`tile_math.FP8_BITS`), read as q's dtype, unscaled (the model folds
    the scales in). Returns `(T, Hq, D)` in q's dtype; padded tokens get whatever their positions give.

    `return_lse=True` returns `(out, lse)`: `lse` `(T, Hq)` float32 is the log-sum-exp of the (scaled,
    soft-capped) scores of the keys each query head sees, -inf where it sees none (out is NaN there);
    an attention sink `sink` (Hq,) gives `out * sigmoid(lse - sink)[..., None]`.
    """
    # q: (T, Hq, D); k_cache, v_cache: (L, P, S, Hkv, D); positions: (T,) int32
    # query_start_loc: (R + 1,) int32; page_table: (R, W) int32
    num_tokens = q.shape[0]
    token_pages = page_table[token_request_index(query_start_loc, num_tokens)]  # (T, W)
    return _attend_tokens(q, positions, token_pages, k_cache=k_cache, v_cache=v_cache, layer=layer,
                          sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, return_lse=return_lse)


def _attend_tokens(q, positions, token_pages, *, k_cache, v_cache, layer, sm_scale, sliding_window, soft_cap,
                   return_lse=False):
    """Attention of a set of query tokens, each over the pages listed in its row of `token_pages`:
    `(N, Hq, D)` in q's dtype, and with `return_lse` also each head's log-sum-exp `(N, Hq)` float32."""
    # q: (N, Hq, D); positions: (N,) int32; token_pages: (N, W) int32
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[2], k_cache.shape[3]
    group = num_heads // num_kv_heads
    num_keys = token_pages.shape[1] * page_size
    shape = (num_tokens, num_keys, num_kv_heads, head_dim)
    k = from_cache(k_cache[layer, token_pages].reshape(shape), q.dtype)  # (N, K, Hkv, D): an fp8 cache's in q's dtype
    v = from_cache(v_cache[layer, token_pages].reshape(shape), q.dtype)  # (N, K, Hkv, D)

    q = q.reshape(num_tokens, num_kv_heads, group, head_dim)  # (N, Hkv, G, D)
    scores = jnp.einsum("thgd,tkhd->thgk", q, k, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_pos = jnp.arange(num_keys, dtype=jnp.int32)  # (K,)
    visible = key_pos[None, :] <= positions[:, None]  # (N, K)
    if sliding_window is not None:
        visible &= key_pos[None, :] > positions[:, None] - sliding_window
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)  # (N, Hkv, G, K)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("thgk,tkhd->thgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
    if not return_lse:
        return out
    lse = jax.nn.logsumexp(scores, axis=-1)  # (N, Hkv, G): -inf (not NaN) where every key is masked
    return out, lse.reshape(num_tokens, num_heads)
