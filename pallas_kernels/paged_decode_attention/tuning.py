"""How many splits (flash-decoding "split-K" chunks) the paged decode kernel uses by default.

The kernel's grid is `(rows, kv_heads, splits)`. A decode step with few rows and few kv heads
launches too few programs to fill an H100/H200 (132 SMs), so the page range of every row is cut
into `splits` contiguous chunks that run in parallel and are merged afterwards with a
log-sum-exp. More splits cost more partial results to write and merge, and a split with too
few pages spends most of its time on set-up, so the rule is:

1. the smallest power of two with `rows * kv_heads * splits >= TARGET_PROGRAMS` (about 62
   programs per SM: many programs in flight hide the latency of the scattered page reads);
2. at most `MAX_SPLITS`;
3. at most `num_page_slots // MIN_PAGES_PER_SPLIT` (rounded down to a power of two), so every
   split of the widest row owns at least `MIN_PAGES_PER_SPLIT` page-table slots; this also
   means never more splits than page-table slots;
4. at least 1.

The numbers come from the H200 sweep of benchmarks/gpu_check.sh (2026-11-30, docs/benchmarks.md; one
layer of Llama-3.1-8B attention, bfloat16, pages of 16): the best split counts measured were 64 for 8
rows at contexts of 8k and 32k (up to 1.26x the old rule's 8), 16 for 64 rows (up to 1.26x the old
rule's 1), and 8 for 8 rows at 2k (16 and 64 were slower there, hence 16 pages per split at least).
The rule picks those; the shapes between them (e.g. 32 splits for 8 rows at 8k) were not measured.
Triton launch settings: 8 warps were slower everywhere (by up to 2x); 3 stages and two pages per loop
step were within a few percent of the defaults, better on some shapes and worse on others.
"""

from __future__ import annotations

NUM_SMS = 132  # H100 / H200 SXM streaming multiprocessors
TARGET_PROGRAMS = 8192  # programs a decode step should launch at least (about 62 per SM)
MIN_PAGES_PER_SPLIT = 16  # page-table slots a split should own at least
MAX_SPLITS = 64  # cap on splits (partials to write and merge grow with it)

# Triton launch settings for the kernel (pallas triton CompilerParams); measured on an H200, see above.
TRITON_NUM_WARPS = 4
TRITON_NUM_STAGES = 2
# Pages a program reads per loop step (one `(PAGES_PER_STEP * S, D)` K and V tile per step); see above.
PAGES_PER_STEP = 1


def _floor_power_of_two(n: int) -> int:
    """Largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def choose_num_splits(num_rows: int, num_kv_heads: int, num_page_slots: int) -> int:
    """Default split count for a `(num_rows, num_kv_heads, splits)` grid over `num_page_slots` slots.

    A power of two in `[1, MAX_SPLITS]`; see the module docstring for the rule.
    """
    programs = max(num_rows * num_kv_heads, 1)
    splits = 1
    while programs * splits < TARGET_PROGRAMS and splits < MAX_SPLITS:
        splits *= 2
    by_pages = _floor_power_of_two(max(num_page_slots // MIN_PAGES_PER_SPLIT, 1))
    return max(min(splits, by_pages), 1)
