"""Paged KV cache bookkeeping on the host: the page pool and the per-request cache manager."""

from jaxserve.kv.cache_manager import KVCacheManager
from jaxserve.kv.page_pool import NULL_PAGE, PAGE_STATES, PagePool

__all__ = ["KVCacheManager", "NULL_PAGE", "PAGE_STATES", "PagePool"]
