"""BatchDescriptor: the fixed-shape padded pytree that is the model step's input."""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    """The model step's only input besides params and KV pages. Shapes: T tokens, R rows, W pages per row."""

    input_ids: jax.Array  # (T,) int32 token ids, flattened over requests
    positions: jax.Array  # (T,) int32 absolute position of each token in its sequence
    slot_mapping: jax.Array  # (T,) int32 page * page_size + offset where each token's K/V is written
    query_start_loc: jax.Array  # (R + 1,) int32 first token of each row; padded rows start at the real total
    seq_lens: jax.Array  # (R,) int32 tokens in the cache after this step (0 for padded rows)
    page_table: jax.Array  # (R, W) int32 page ids of each row, padded with the null page
    logits_indices: jax.Array  # (R,) int32 index of each row's last token in the flattened batch
    num_seqs: jax.Array  # () int32 real rows
