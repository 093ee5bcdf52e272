"""KVCacheManager: which pages each request holds, and growing or freeing them."""

from __future__ import annotations

from jaxserve.kv.page_pool import PagePool


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


class KVCacheManager:
    """Maps request ids to their page lists on top of a PagePool.

    Contract: `allocate_slots(request_id, total_tokens)` makes the request hold enough pages for
    `total_tokens` tokens and returns True, or changes nothing and returns False when the pool is
    short. `free(request_id)` returns every page the request held; it is safe to call for a
    request that holds none.
    """

    def __init__(self, pool: PagePool, page_size: int):
        self.pool = pool
        self.page_size = page_size
        self._pages: dict[str, list[int]] = {}  # request id -> page ids in sequence order

    def page_ids(self, request_id: str) -> list[int]:
        """The pages a request holds, in order (empty when it holds none)."""
        return self._pages.get(request_id, [])

    def num_pages_needed(self, request_id: str, total_tokens: int) -> int:
        """How many more pages the request needs to hold `total_tokens` tokens."""
        return max(0, pages_for_tokens(total_tokens, self.page_size) - len(self.page_ids(request_id)))

    def allocate_slots(self, request_id: str, total_tokens: int) -> bool:
        """Grow the request's pages to cover `total_tokens`; False (and no change) if the pool is short."""
        needed = self.num_pages_needed(request_id, total_tokens)
        if needed > self.pool.num_free:
            return False
        if needed:
            self._pages.setdefault(request_id, []).extend(self.pool.allocate(needed))
        return True

    def free(self, request_id: str) -> None:
        """Return all of the request's pages to the pool."""
        pages = self._pages.pop(request_id, [])
        self.pool.release(pages)

    @property
    def num_requests(self) -> int:
        """Requests currently holding pages."""
        return len(self._pages)
