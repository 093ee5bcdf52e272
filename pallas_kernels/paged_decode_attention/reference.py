"""Plain-jnp paged decode attention: the definition of correct for the decode kernel.

A decode row has exactly one query token, at position `seq_lens[r] - 1`, so this is the ragged
reference with one query per row. Rows with `seq_len == 0` are padding and give zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention


def paged_decode_attention_reference(
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
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of each row's single query over keys `0..seq_lens[r]-1` of its pages.

    Returns `(R, Hq, D)` in q's dtype; padded rows (`seq_len == 0`) are exactly zero. `return_lse=True`
    returns `(out, lse)`: `lse` `(R, Hq)` float32 is each head's log-sum-exp over the (scaled, soft-capped)
    scores of the keys it sees, -inf on padded rows.
    """
    # q: (R, Hq, D); k_cache, v_cache: (L, P, S, Hkv, D); seq_lens: (R,) int32; page_table: (R, W) int32
    num_rows = q.shape[0]
    seq_lens = seq_lens.astype(jnp.int32)  # (R,)
    query_start_loc = jnp.arange(num_rows + 1, dtype=jnp.int32)  # (R + 1,)
    positions = seq_lens - 1  # (R,)
    result = ragged_paged_attention(
        q, k_cache, v_cache, layer, positions, query_start_loc, page_table,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, return_lse=return_lse,
    )  # (R, Hq, D); padded rows are NaN (softmax over no keys); with return_lse also (R, Hq) float32
    out = result[0] if return_lse else result
    out = jnp.where(seq_lens[:, None, None] > 0, out, jnp.zeros_like(out))  # (R, Hq, D)
    if not return_lse:
        return out
    return out, jnp.where(seq_lens[:, None] > 0, result[1], -jnp.inf)  # (R, Hq, D), (R, Hq)
