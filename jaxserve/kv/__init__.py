"""Paged KV cache bookkeeping on the host: the page pool and the per-request cache manager."""

from jaxserve.kv.cache_manager import KVCacheManager
from jaxserve.kv.page_pool import NULL_PAGE, PagePool

__all__ = ["KVCacheManager", "NULL_PAGE", "PagePool"]
