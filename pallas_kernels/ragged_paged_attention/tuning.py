"""Block sizes of the ragged paged-attention kernel, and what its GPU (Triton) lowering accepts."""

from __future__ import annotations

# Rows of one query tile (query tokens x query heads of a KV head). GPU dots want at least 16 rows,
# so a tile holds 16 // group query tokens: 16 tokens for MHA, 2 for a group of 8.
QUERY_TILE_ROWS = 16
# Triton lowering launch parameters.
NUM_WARPS = 4
NUM_STAGES = 2


def padded_group(group: int) -> int:
    """Query heads per KV head rounded up to a power of two (Triton tiles must be powers of two);
    the extra heads are zero rows whose outputs are dropped."""
    return 1 << (group - 1).bit_length()


def block_q_for(group: int) -> int:
    """Query tokens per tile for a GQA group size."""
    return max(1, QUERY_TILE_ROWS // padded_group(group))


def gpu_unsupported(page_size: int, head_dim: int) -> str | None:
    """Why the compiled (Triton) kernels cannot take these shapes, or None when they can (Triton
    blocks must be powers of two)."""
    if head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two"
    if page_size & (page_size - 1):
        return f"page_size {page_size} is not a power of two"
    return None
