"""KVCacheManager: which pages each request holds; growing, sharing, copying on write and freeing them.

Who holds a page: every request whose page list contains it (the pool counts them). A request gets
pages three ways: fresh from the pool (`allocate_slots`), from the prefix cache (the longest run of
its full pages whose content hashes are registered, verified token for token), or from a sibling
sample that has computed the same prompt (`fork`). Pages shared that way are only ever read, except
the last, partly filled page of a fork: before a request writes into a page someone else also
holds, `allocate_slots` gives it a private copy (copy-on-write) and records the device copy the
next step must make first.

Swapping (`swap_out`, `swap_in`) moves a preempted request's computed pages to a host pool with the
same page layout and back: a page only it holds is copied to a host page and released; a page
others hold too stays on the device, held, and is never copied (shared KV is swapped once: not at
all). The manager only decides the copies; the runner makes them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

from jaxserve.kv.page_pool import PagePool, ParentKey

TokenIds = Callable[[int, int], list[int]]  # (start, stop) -> a request's token ids at those positions


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


def page_hash(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    """The content hash of a full page: SHA-256 chained over its parent page's hash and its tokens."""
    return hashlib.sha256(parent + np.asarray(token_ids, np.int64).tobytes()).digest()


def root_hash(cache_salt: str | None) -> bytes:
    """The parent hash of a request's first page: the extra keys (the cache salt) enter every page's hash
    through it, so requests with different salts never share pages."""
    return b"" if cache_salt is None else hashlib.sha256(b"salt:" + cache_salt.encode()).digest()


def root_key(cache_salt: str | None) -> ParentKey:
    """The parent key of a request's first page (see page_pool.ParentKey)."""
    return ("root", cache_salt)


class KVCacheManager:
    """Maps request ids to their page lists on top of a PagePool.

    Contract: `allocate_slots(request_id, first_written, total_tokens, cached_pages)` makes the request
    hold enough pages for `total_tokens` tokens, private from position `first_written` on, and
    returns True; or changes nothing and returns False when the pool is short. `free(request_id)`
    releases every page the request held (last page first, so its tail is evicted first); it is safe
    to call for a request that holds none.
    """

    def __init__(self, pool: PagePool, page_size: int, enable_prefix_caching: bool = False,
                 host_pool: PagePool | None = None):
        self.pool = pool
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.host_pool = host_pool  # pages of the host swap space; None when swapping is off
        # request id -> (on the host, page id) of each of its computed pages, in order, while it is swapped out
        self._swapped: dict[str, list[tuple[bool, int]]] = {}
        self._pages: dict[str, list[int]] = {}  # request id -> page ids in sequence order
        # request id -> its page ids as a tuple, made at the first `page_tuple` after they last changed
        self._page_tuples: dict[str, tuple[int, ...]] = {}
        # request id -> (hash, registration key) of its first full computed pages; a None key ends the chain
        self._chains: dict[str, list[tuple[bytes, ParentKey | None]]] = {}
        self._copies: dict[str, list[tuple[int, int]]] = {}  # request id -> (source, copy) for the next step

    def page_ids(self, request_id: str) -> list[int]:
        """The pages a request holds, in order (empty when it holds none)."""
        return self._pages.get(request_id, [])

    def page_tuple(self, request_id: str, num_pages: int) -> tuple[int, ...]:
        """The request's first `num_pages` pages as a tuple. All of them come as the same tuple object from call to
        call while they do not change, so a consumer may keep what it derives from a tuple (the batch builder's
        page-table rows) for as long as it is handed that tuple again."""
        pages = self._page_tuples.get(request_id)
        if pages is None:
            pages = self._page_tuples[request_id] = tuple(self.page_ids(request_id))
        return pages if num_pages == len(pages) else pages[:num_pages]

    def num_pages_needed(self, request_id: str, total_tokens: int) -> int:
        """How many more pages the request needs to hold `total_tokens` tokens."""
        return max(0, pages_for_tokens(total_tokens, self.page_size) - len(self.page_ids(request_id)))

    # ---- getting pages ------------------------------------------------------------------------------

    def find_cached_prefix(self, token_ids: list[int], cache_salt: str | None) -> list[int]:
        """The cached pages holding the longest run of `token_ids`' full pages (not taken yet). The last
        token is never covered, so the step that computes it has logits to sample from."""
        if not self.enable_prefix_caching:
            return []
        pages, parent_hash, parent = [], root_hash(cache_salt), root_key(cache_salt)
        for index in range((len(token_ids) - 1) // self.page_size):
            tokens = tuple(token_ids[index * self.page_size : (index + 1) * self.page_size])
            parent_hash = page_hash(parent_hash, tokens)
            found = self.pool.lookup(parent_hash, tokens, parent)
            if found is None:
                break
            page, parent = found
            pages.append(page)
        return pages

    def fork(self, request_id: str, source_id: str, num_tokens: int) -> None:
        """Make a request that holds no pages share the pages of `source_id` covering `num_tokens` tokens."""
        if self.page_ids(request_id):
            raise RuntimeError(f"request {request_id!r} already holds pages")
        shared = self.page_ids(source_id)[: pages_for_tokens(num_tokens, self.page_size)]
        for page in shared:
            self.pool.take(page)
        self._pages[request_id] = list(shared)
        self._page_tuples.pop(request_id, None)

    def allocate_slots(self, request_id: str, first_written: int, total_tokens: int,
                       cached_pages: list[int] = ()) -> bool:
        """Grow the request's pages (after taking `cached_pages`, for a request holding none) to cover
        `total_tokens`, copying every shared page it will write (positions >= `first_written`, its
        computed tokens unless their KV is already held); False, and no change, when the pool is short."""
        held = self._pages.get(request_id)
        if cached_pages and held:
            raise RuntimeError(f"request {request_id!r} takes cached pages while holding pages")
        pages = held or list(cached_pages)
        first_page = first_written // self.page_size
        shared = [i for i in range(first_page, len(pages)) if self._is_shared(pages[i], bool(held))]
        new = max(0, pages_for_tokens(total_tokens, self.page_size) - len(pages))
        leaving_free = sum(self.pool.is_cached_and_free(page) for page in cached_pages) if cached_pages else 0
        if new + len(shared) > self.pool.num_free - leaving_free:
            return False
        for page in cached_pages:
            self.pool.take(page)
        if shared:  # (a decode's step mostly writes into its own last page, or a fresh one)
            for index, copy in zip(shared, self.pool.allocate(len(shared))):
                self._copies.setdefault(request_id, []).append((pages[index], copy))
                self.pool.release([pages[index]])
                pages[index] = copy
        if new:
            pages += self.pool.allocate(new)
        if pages:
            self._pages[request_id] = pages
        if cached_pages or shared or new:
            self._page_tuples.pop(request_id, None)
        return True

    def _is_shared(self, page: int, held: bool) -> bool:
        """True when another request also holds `page` (counting the holder being added for a cached page)."""
        return self.pool.ref_count(page) > (1 if held else 0)

    def pop_copies(self, request_id: str) -> list[tuple[int, int]]:
        """The (source, copy) page copies the request's next step must make before it writes."""
        return self._copies.pop(request_id, [])

    def restore_copies(self, request_id: str, copies: list[tuple[int, int]]) -> None:
        """Put back copies a step did not make (it never ran), so the request's next step makes them."""
        if copies:
            self._copies.setdefault(request_id, [])[:0] = copies

    # ---- the prefix cache ---------------------------------------------------------------------------

    def cache_full_pages(self, request_id: str, num_computed: int, token_ids: TokenIds,
                         cache_salt: str | None) -> None:
        """Register the request's pages that are now full of computed KV in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        chain = self._chains.setdefault(request_id, [])
        pages = self.page_ids(request_id)
        for index in range(len(chain), num_computed // self.page_size):
            parent_hash, parent = chain[-1] if chain else (root_hash(cache_salt), root_key(cache_salt))
            if parent is None:
                return  # a collision broke the chain: later pages cannot be named safely
            tokens = tuple(token_ids(index * self.page_size, (index + 1) * self.page_size))
            hashed = page_hash(parent_hash, tokens)
            chain.append((hashed, self.pool.register(pages[index], hashed, tokens, parent)))

    # ---- swapping to host memory ------------------------------------------------------------------

    def is_swapped(self, request_id: str) -> bool:
        """True while the request's pages are swapped out."""
        return request_id in self._swapped

    def swapped_request_ids(self) -> list[str]:
        """The requests whose pages are swapped out now."""
        return list(self._swapped)

    def host_pages(self, request_id: str) -> list[int]:
        """The host pages a swapped-out request holds (empty for one not swapped out)."""
        return [page for on_host, page in self._swapped.get(request_id, []) if on_host]

    def num_swapped_pages(self, request_id: str) -> int:
        """Pages (on the host or kept on the device) a swapped-out request will have back when it resumes."""
        return len(self._swapped.get(request_id, []))

    def device_pages_kept(self, request_id: str) -> list[int]:
        """The shared device pages a swapped-out request still holds (empty for one not swapped out)."""
        return [page for on_host, page in self._swapped.get(request_id, []) if not on_host]

    def swap_out(self, request_id: str, num_computed: int) -> list[tuple[int, int]] | None:
        """Move the pages holding the request's `num_computed` computed tokens to the host pool and release
        every device page only it holds; returns the (device page, host page) copies the device must make
        before anything writes those pages again, or None (and no change) when the host pool is short.

        A page others hold too stays held on the device. A private copy-on-write page whose copy the
        device has not made yet is swapped from its source page."""
        if self.host_pool is None:
            return None
        pages = self.page_ids(request_id)
        num_kept = pages_for_tokens(num_computed, self.page_size)
        source_of = {copy: source for source, copy in self._copies.get(request_id, [])}
        private = [index for index in range(num_kept)
                   if self.pool.ref_count(pages[index]) == 1 or pages[index] in source_of]
        if len(private) > self.host_pool.num_free:
            return None
        self._copies.pop(request_id, None)
        slots = [(False, page) for page in pages[:num_kept]]
        copies = []
        for index, host_page in zip(private, self.host_pool.allocate(len(private))):
            copies.append((source_of.get(pages[index], pages[index]), host_page))
            slots[index] = (True, host_page)
        self.pool.release([pages[index] for index in private][::-1] + pages[num_kept:][::-1])
        del self._pages[request_id]
        self._page_tuples.pop(request_id, None)
        self._swapped[request_id] = slots
        return copies

    def swap_in(self, request_id: str, first_written: int, total_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request's pages back into fresh device pages and grow them to `total_tokens`
        (as `allocate_slots`); returns the (host page, device page) copies the device must make before
        the request's step reads them, or None (and no change) when the device pool is short."""
        slots = self._swapped[request_id]
        num_on_host = sum(on_host for on_host, _ in slots)
        first_page = first_written // self.page_size
        shared = sum(1 for index, (on_host, page) in enumerate(slots)
                     if index >= first_page and not on_host and self.pool.ref_count(page) > 1)
        new = max(0, pages_for_tokens(total_tokens, self.page_size) - len(slots))
        if num_on_host + shared + new > self.pool.num_free:
            return None
        fresh = iter(self.pool.allocate(num_on_host))
        pages, copies = [], []
        for on_host, page in slots:
            if on_host:
                copies.append((page, next(fresh)))
                pages.append(copies[-1][1])
            else:
                pages.append(page)
        self.host_pool.release([page for page, _ in copies])
        del self._swapped[request_id]
        self._pages[request_id] = pages
        self._page_tuples.pop(request_id, None)
        if not self.allocate_slots(request_id, first_written, total_tokens):
            raise RuntimeError("allocate_slots failed after its pages were counted")
        return copies

    # ---- giving pages back --------------------------------------------------------------------------

    def free(self, request_id: str) -> None:
        """Release all of the request's pages (device pages last first; host pages when swapped out) and drop
        its pending copies."""
        pages = self._pages.pop(request_id, []) + self.device_pages_kept(request_id)
        self._page_tuples.pop(request_id, None)
        host_pages = self.host_pages(request_id)
        self._swapped.pop(request_id, None)
        self._chains.pop(request_id, None)
        self._copies.pop(request_id, None)
        self.pool.release(pages[::-1])
        if host_pages:
            self.host_pool.release(host_pages)

    @property
    def num_requests(self) -> int:
        """Requests currently holding pages."""
        return len(self._pages)
