"""PagePool: reference-counted fixed-size KV pages, with page 0 reserved as the null page."""

from __future__ import annotations

import collections

NULL_PAGE = 0  # padded token slots write here; never handed to a request


class PagePool:
    """Hands out page ids from a free queue and takes them back when their reference count drops to 0.

    Contract: `allocate(n)` either returns `n` distinct pages, each with reference count 1, or
    raises; callers check `num_free` first (check-then-act). `release(pages)` decrements each
    page once; a page returns to the free queue when nothing references it.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the reserved null page), got {num_pages}")
        self.num_pages = num_pages
        self._ref_counts = [0] * num_pages  # (num_pages,) references per page id
        self._free: collections.deque[int] = collections.deque(range(1, num_pages))

    @property
    def num_free(self) -> int:
        """Pages that can be allocated now."""
        return len(self._free)

    @property
    def num_usable(self) -> int:
        """Pages a request could ever hold (all but the null page)."""
        return self.num_pages - 1

    def usage(self) -> float:
        """Fraction of usable pages in use, in [0, 1]."""
        return 1.0 - self.num_free / self.num_usable

    def allocate(self, count: int) -> list[int]:
        """Take `count` pages off the free queue."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} pages with only {len(self._free)} free: call num_free first")
        pages = [self._free.popleft() for _ in range(count)]
        for page in pages:
            self._ref_counts[page] = 1
        return pages

    def release(self, pages: list[int]) -> None:
        """Drop one reference from each page; pages nobody holds go back on the free queue."""
        for page in pages:
            if not NULL_PAGE < page < self.num_pages or self._ref_counts[page] <= 0:
                raise RuntimeError(f"page {page} released more often than it was taken")
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                self._free.append(page)

    def ref_count(self, page: int) -> int:
        """Current number of holders of `page`."""
        return self._ref_counts[page]
