"""How many splits (flash-decoding "split-K" chunks) the paged decode kernel uses by default.

The kernel's grid is `(rows, kv_heads, splits)`. A decode step with few rows and few kv heads
launches too few programs to fill an H100/H200 (132 SMs), so the page range of every row is cut
into `splits` contiguous chunks that run in parallel and are merged afterwards with a
log-sum-exp. More splits cost more partial results to write and merge, and a split with too
few pages spends most of its time on set-up, so the rule is:

1. the smallest power of two with `rows * kv_heads * splits >= TARGET_PROGRAMS` (about two
   programs per SM);
2. at most `MAX_SPLITS`;
3. at most `num_page_slots // MIN_PAGES_PER_SPLIT` (rounded down to a power of two), so every
   split of the widest row owns at least `MIN_PAGES_PER_SPLIT` page-table slots; this also
   means never more splits than page-table slots;
4. at least 1.

The numbers (and the Triton launch settings below) are first guesses, not measured on a GPU;
tune them here.
"""

from __future__ import annotations

NUM_SMS = 132  # H100 / H200 SXM streaming multiprocessors
PROGRAMS_PER_SM = 2
TARGET_PROGRAMS = PROGRAMS_PER_SM * NUM_SMS  # programs a decode step should launch at least
MIN_PAGES_PER_SPLIT = 4  # page-table slots a split should own at least
MAX_SPLITS = 16  # cap on splits (partials to write and merge grow with it)

# Triton launch settings for the kernel (pallas triton CompilerParams); untuned.
TRITON_NUM_WARPS = 4
TRITON_NUM_STAGES = 2
# Pages a program reads per loop step (one `(PAGES_PER_STEP * S, D)` K and V tile per step); untuned.
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
