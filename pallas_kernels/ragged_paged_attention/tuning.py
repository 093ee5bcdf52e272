"""Block sizes of the ragged paged-attention kernel (the tuning table lives beside the kernel)."""

from __future__ import annotations

# Rows of one query tile (query tokens x query heads of a KV head). GPU dots want at least 16 rows,
# so a tile holds 16 // group query tokens: 16 tokens for MHA, 2 for a group of 8.
QUERY_TILE_ROWS = 16


def block_q_for(group: int) -> int:
    """Query tokens per tile for a GQA group size."""
    return max(1, QUERY_TILE_ROWS // group)
