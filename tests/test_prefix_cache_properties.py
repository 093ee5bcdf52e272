"""Shared KV pages as properties (pure Python, no jax): the page pool and cache manager with prefix
caching on, and the scheduler driven by a fake device that really keeps KV pages.

The fake device (`FakeDevice`) stores, in every slot of every page, the (token id, position) a step
wrote there; it makes a step's page copies before the step's writes (as `copy_pages` does), and a
sampling row reads its whole context back through its page list. The fake model's token is a hash of
the request id and that context (`model_token`), so a wrong cache hit, a missed or misdirected copy,
or a page handed out while a running request still reads it changes the output, and every read is
also compared with the request's own tokens. `oracle` computes each request's output with no
scheduler, no cache and no pages at all: caching must change nothing.

After every step: reference counts are never negative and equal the number of request page lists
holding the page; no page is both in the free queue and referenced; free and held pages together
are every usable page; a registered (cached) page holds on the device exactly the tokens, at the
positions, that its hash names (the hash chain recomputed from the requests' tokens and salts); a
page held by two requests is held under one cache salt; a page written by a step is held by its
writer alone; the token budget holds; and at the end every page is free.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import jaxserve.kv.cache_manager as cache_manager
from jaxserve.config import SchedulerSettings
from jaxserve.engine.scheduler import Scheduler
from jaxserve.kv.cache_manager import KVCacheManager, pages_for_tokens, root_hash
from jaxserve.kv.page_pool import NULL_PAGE, PagePool
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams
from jaxserve.step import SampledToken, SchedulerOutput

VOCAB = 1000
ALPHABET = 4  # prompt tokens come from a tiny alphabet so page contents repeat across prefixes and positions


# ---- the pool's internals the invariants need (kept in one place) ---------------------------------


def free_queue(pool: PagePool) -> list[int]:
    """The free pages, least recently freed first."""
    return list(pool._free)


def registry(pool: PagePool) -> dict[int, tuple[bytes, tuple[int, ...]]]:
    """Registered (cached) page -> (its hash, its token ids)."""
    return {page: (content.page_hash, content.token_ids) for page, content in pool._content.items()}


def pending_copies(kv: KVCacheManager) -> dict[int, int]:
    """Copies recorded but not made yet (a step taken back restores them): destination -> source."""
    return {dest: source for copies in kv._copies.values() for source, dest in copies}


def chain(token_ids: list[int], salt: str | None, page_size: int) -> list[bytes]:
    """The hashes of the full pages of `token_ids`, recomputed here (with the current `page_hash`)."""
    hashes, parent = [], root_hash(salt)
    for index in range(len(token_ids) // page_size):
        parent = cache_manager.page_hash(parent, tuple(token_ids[index * page_size : (index + 1) * page_size]))
        hashes.append(parent)
    return hashes


# ---- a fake device that keeps KV pages -------------------------------------------------------------


def model_token(request_id: str, context: list[int]) -> int:
    """The fake model: the next token of `request_id` after `context` (every token before it)."""
    digest = hashlib.blake2b(f"{request_id}|{context}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


class FakeDevice:
    """KV pages as the device holds them: each slot records the (token id, position) written into it."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.slots: list[list[tuple[int, int] | None]] = [[None] * page_size for _ in range(num_pages)]

    def copy(self, copies: list[tuple[int, int]]) -> None:
        """Every source is read before any destination is written (`copy_pages` gathers, then scatters)."""
        contents = [list(self.slots[source]) for source, _ in copies]
        for (_, dest), content in zip(copies, contents):
            self.slots[dest] = content

    def write(self, pages: list[int] | tuple[int, ...], start: int, token_ids: list[int]) -> None:
        for offset, token in enumerate(token_ids):
            position = start + offset
            page = pages[position // self.page_size]
            assert page != NULL_PAGE
            self.slots[page][position % self.page_size] = (token, position)

    def read(self, pages: list[int] | tuple[int, ...], stop: int) -> list[tuple[int, int] | None]:
        """What attention sees for positions [0, stop) through `pages`."""
        return [self.slots[pages[p // self.page_size]][p % self.page_size] for p in range(stop)]

    def check_context(self, request_id: str, pages, token_ids: list[int], pending: dict[int, int] = {}) -> None:
        """The request's pages hold exactly its tokens at their positions (a page whose copy is still
        pending is read from its source, which the copy will read)."""
        pages = [pending.get(page, page) for page in pages]
        got = self.read(pages, len(token_ids))
        want = [(token, position) for position, token in enumerate(token_ids)]
        if got != want:
            bad = next(p for p in range(len(want)) if got[p] != want[p])
            raise AssertionError(
                f"{request_id} reads {got[bad]} at position {bad} (page {pages[bad // self.page_size]}), "
                f"expected {want[bad]}: pages {list(pages)}"
            )

    def run(self, output: SchedulerOutput) -> list[list[SampledToken]]:
        """One step: the copies, then every row's writes, then every sampling row reads and samples."""
        assert len(output.page_copies) <= len(output.scheduled), "more page copies than batch rows"
        self.copy(output.page_copies)
        for item in output.scheduled:
            start = item.num_computed_tokens + item.num_present_tokens  # present tokens are not written
            self.write(item.page_ids, start,
                       item.request.token_ids(start, item.num_computed_tokens + item.num_new_tokens))
        sampled: list[list[SampledToken]] = []
        for item in output.scheduled:
            if not item.samples:
                sampled.append([])
                continue
            request = item.request
            context = request.token_ids(0, item.num_computed_tokens + item.num_new_tokens)
            self.check_context(request.request_id, item.page_ids, context)
            tokens = [token for token, _ in self.read(item.page_ids, len(context))]
            sampled.append([SampledToken(model_token(request.request_id, tokens))])
        return sampled


# ---- pool-wide invariants ---------------------------------------------------------------------------


class ChainBook:
    """Every hash chain computed from any request's tokens: hash -> (page index, token ids)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.named: dict[bytes, set[tuple[int, tuple[int, ...]]]] = collections.defaultdict(set)

    def add(self, token_ids: list[int], salt: str | None) -> list[bytes]:
        hashes = chain(token_ids, salt, self.page_size)
        for index, page_hash in enumerate(hashes):
            tokens = tuple(token_ids[index * self.page_size : (index + 1) * self.page_size])
            self.named[page_hash].add((index, tokens))
        return hashes


def check_pool(kv: KVCacheManager, device: FakeDevice, book: ChainBook,
               holders: dict[str, tuple[list[int], int, str | None]]) -> None:
    """`holders`: request id -> (its token ids, its computed tokens, its cache salt) for every request
    that may hold pages (others must hold none)."""
    pool, page_size = kv.pool, kv.page_size
    pending = pending_copies(kv)
    count = collections.Counter()
    salts: dict[int, set] = collections.defaultdict(set)
    for request_id, (token_ids, num_computed, salt) in holders.items():
        pages = kv.page_ids(request_id)
        assert NULL_PAGE not in pages
        assert len(pages) * page_size >= num_computed
        count.update(pages)
        for page in pages:
            salts[page].add(salt)
        # No page was handed out (and overwritten) while this request still reads it.
        device.check_context(request_id, pages, token_ids[:num_computed], pending)
    for page in range(pool.num_pages):
        assert pool.ref_count(page) >= 0, f"page {page} has ref count {pool.ref_count(page)}"
        assert pool.ref_count(page) == count[page], (
            f"page {page}: ref count {pool.ref_count(page)}, held by {count[page]} page lists"
        )
    free = free_queue(pool)
    assert len(free) == len(set(free)) == pool.num_free
    assert not set(free) & set(count), f"pages {sorted(set(free) & set(count))} are free and referenced"
    assert set(free) | set(count) == set(range(1, pool.num_pages)), "a page is neither free nor held"
    for page, page_salts in salts.items():
        assert len(page_salts) == 1, f"page {page} is shared across cache salts {page_salts}"

    cached = registry(pool)
    assert len(cached) == pool.num_cached
    for page, (page_hash, tokens) in cached.items():
        assert pool._page_of[page_hash] == page
        assert len(tokens) == page_size
        named = book.named.get(page_hash, set())
        matching = [index for index, named_tokens in named if named_tokens == tokens]
        assert matching, f"page {page} is registered with tokens {tokens} that its hash does not name"
        content = device.slots[page]
        assert [slot[0] if slot else None for slot in content] == list(tokens), (
            f"registered page {page} holds {content}, its hash names {tokens}"
        )
        first = content[0][1]
        assert first % page_size == 0 and [slot[1] for slot in content] == list(range(first, first + page_size))
        assert first // page_size in matching, f"page {page} holds positions from {first}, its hash names another"
    for request_id, (token_ids, num_computed, salt) in holders.items():
        hashes = chain(token_ids, salt, page_size)
        for index, page in enumerate(kv.page_ids(request_id)):
            if page in cached and index < num_computed // page_size:
                assert cached[page] == (hashes[index], tuple(token_ids[index * page_size : (index + 1) * page_size]))


# ---- the pool and cache manager as a state machine ------------------------------------------------

BASES = ([0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3], [1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])


@dataclasses.dataclass
class Held:
    token_ids: list[int]
    num_computed: int
    salt: str | None


class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests start (taking the longest cached prefix), compute, grow, fork a prefix of another, free,
    and the cache is reset, on a small pool with prefix caching on; every step is checked against the
    fake device."""

    page_size = 4

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(PagePool(11), self.page_size, enable_prefix_caching=True)
        self.device = FakeDevice(11, self.page_size)
        self.book = ChainBook(self.page_size)
        self.held: dict[str, Held] = {}

    # -- helpers

    def snapshot(self):
        pool = self.kv.pool
        return ({rid: list(self.kv.page_ids(rid)) for rid in "abcdefg"},
                [pool.ref_count(page) for page in range(pool.num_pages)], sorted(free_queue(pool)), registry(pool))

    def compute(self, request_id: str, start: int, stop: int, copies: list[tuple[int, int]]) -> None:
        """The device step: copies, then writing positions [start, stop), then registering full pages."""
        held = self.held[request_id]
        pages = self.kv.page_ids(request_id)
        for page in pages[start // self.page_size : pages_for_tokens(stop, self.page_size)]:
            assert self.kv.pool.ref_count(page) == 1, f"{request_id} writes page {page}, held by others too"
        self.device.copy(copies)
        self.device.write(pages, start, held.token_ids[start:stop])
        held.num_computed = stop
        self.device.check_context(request_id, pages, held.token_ids[:stop])
        self.kv.cache_full_pages(request_id, stop, lambda a, b: held.token_ids[a:b], held.salt)
        self.book.add(held.token_ids[:stop], held.salt)

    # -- rules

    @rule(request_id=st.sampled_from("abcdefg"), base=st.sampled_from(BASES), shared=st.integers(0, 16),
          tail=st.lists(st.integers(0, ALPHABET - 1), max_size=8), salt=st.sampled_from([None, None, "x"]),
          fraction=st.floats(0, 1))
    def start(self, request_id, base, shared, tail, salt, fraction):
        token_ids = base[:shared] + tail
        if request_id in self.held or not token_ids:
            return
        cached = self.kv.find_cached_prefix(token_ids, salt)
        num_computed = len(cached) * self.page_size
        assert num_computed <= len(token_ids) - 1, "a cache hit covers the last token"
        hashes = chain(token_ids, salt, self.page_size)
        for index, page in enumerate(cached):  # a hit is the right content under the right name
            assert registry(self.kv.pool)[page][0] == hashes[index]
            want = [(token, position) for position, token in enumerate(token_ids)]
            assert self.device.slots[page] == want[index * self.page_size : (index + 1) * self.page_size]
        event(f"start: hit {bool(cached)}")
        total = num_computed + 1 + int(fraction * (len(token_ids) - num_computed - 1))
        before = self.snapshot()
        if not self.kv.allocate_slots(request_id, num_computed, total, cached):
            assert self.snapshot() == before, "a refused allocation changed the pool"
            return
        copies = self.kv.pop_copies(request_id)
        assert copies == [], f"pages taken from the cache are only read, yet {copies} were copied"
        assert self.kv.page_ids(request_id)[: len(cached)] == cached
        self.held[request_id] = Held(token_ids, num_computed, salt)
        self.compute(request_id, num_computed, total, copies)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, ALPHABET - 1), max_size=6), count=st.integers(1, 8))
    def grow(self, data, new_tokens, count):
        request_id = data.draw(st.sampled_from(sorted(self.held)))
        held = self.held[request_id]
        held.token_ids = held.token_ids + new_tokens  # generated tokens
        if held.num_computed == len(held.token_ids):
            return
        stop = min(len(held.token_ids), held.num_computed + count)
        before = self.snapshot()
        if not self.kv.allocate_slots(request_id, held.num_computed, stop):
            assert self.snapshot() == before, "a refused allocation changed the pool"
            event("grow: refused")
            return
        self.compute(request_id, held.num_computed, stop, self.kv.pop_copies(request_id))

    @precondition(lambda self: any(h.num_computed for h in self.held.values()))
    @rule(data=st.data(), request_id=st.sampled_from("abcdefg"), fraction=st.floats(0, 1))
    def fork(self, data, request_id, fraction):
        """A sample forks the first `length` computed tokens of a source and computes its last token again."""
        if request_id in self.held:
            return
        source_id = data.draw(st.sampled_from(sorted(rid for rid, h in self.held.items() if h.num_computed)))
        source = self.held[source_id]
        length = 1 + int(fraction * (source.num_computed - 1))
        before = self.snapshot()
        free_before = set(free_queue(self.kv.pool))
        self.kv.fork(request_id, source_id, length)
        shared_index = (length - 1) // self.page_size
        shared_page = self.kv.page_ids(source_id)[shared_index]
        assert self.kv.page_ids(request_id) == self.kv.page_ids(source_id)[: shared_index + 1]
        if not self.kv.allocate_slots(request_id, length - 1, length):
            self.kv.free(request_id)
            assert self.snapshot() == before, "a refused fork changed the pool"
            event("fork: refused")
            return
        event("fork: copied")
        copies = self.kv.pop_copies(request_id)
        # The write into the last shared page goes to a private copy: from the shared page to a fresh one.
        assert len(copies) == 1, copies
        ((source_page, copy_page),) = copies
        assert source_page == shared_page != copy_page
        assert copy_page in free_before and copy_page not in before[0][source_id]
        assert self.kv.page_ids(request_id)[shared_index] == copy_page
        assert self.kv.pool.ref_count(copy_page) == 1
        assert self.kv.page_ids(source_id)[shared_index] == shared_page  # the source keeps its page
        assert self.kv.page_ids(request_id)[:shared_index] == self.kv.page_ids(source_id)[:shared_index]
        self.held[request_id] = Held(source.token_ids[:length], length - 1, source.salt)
        self.compute(request_id, length - 1, length, copies)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.held)))
        pages = self.kv.page_ids(request_id)
        only_its = [page for page in pages if self.kv.pool.ref_count(page) == pages.count(page)]
        others = {page: self.kv.pool.ref_count(page) - pages.count(page) for page in pages}
        self.kv.free(request_id)
        del self.held[request_id]
        assert self.kv.page_ids(request_id) == []
        # Pages nobody else holds go to the tail of the free queue; pages others hold stay theirs.
        queue = free_queue(self.kv.pool)
        tail = queue[len(queue) - len(set(only_its)):] if only_its else []
        assert set(tail) == set(only_its)
        for page, count in others.items():
            assert self.kv.pool.ref_count(page) == count

    @rule()
    def reset_cache(self):
        lists, counts, free, _ = self.snapshot()
        forgotten = self.kv.pool.reset_cache()
        assert forgotten >= 0
        assert self.kv.pool.num_cached == 0 and registry(self.kv.pool) == {}
        assert self.snapshot()[:3] == (lists, counts, free), "reset_cache changed who holds what"
        for held in self.held.values():
            assert self.kv.find_cached_prefix(held.token_ids, held.salt) == []

    @rule(base=st.sampled_from(BASES), shared=st.integers(1, 16), salt=st.sampled_from([None, "x", "y"]))
    def lookup(self, base, shared, salt):
        """Any lookup returns pages holding exactly the asked tokens at the asked positions."""
        token_ids = base[:shared]
        for index, page in enumerate(self.kv.find_cached_prefix(token_ids, salt)):
            want = [(token, position) for position, token in enumerate(token_ids)]
            assert self.device.slots[page] == want[index * self.page_size : (index + 1) * self.page_size]

    # -- invariants and teardown

    @invariant()
    def pool_is_consistent(self):
        holders = {rid: (h.token_ids, h.num_computed, h.salt) for rid, h in self.held.items()}
        for rid in "abcdefg":
            if rid not in self.held:
                assert self.kv.page_ids(rid) == []
        check_pool(self.kv, self.device, self.book, holders)

    def teardown(self):
        for request_id in list(self.held):
            self.kv.free(request_id)
        pool = self.kv.pool
        assert pool.num_free == pool.num_usable
        assert all(pool.ref_count(page) == 0 for page in range(pool.num_pages))
        assert self.kv.num_requests == 0


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


# ---- direct checks of the cache manager -------------------------------------------------------------


def _computed(kv: KVCacheManager, device: FakeDevice, request_id: str, token_ids: list[int], salt=None) -> None:
    """Admit and fully compute a request of `token_ids` (no earlier hits)."""
    cached = kv.find_cached_prefix(token_ids, salt)
    assert kv.allocate_slots(request_id, len(cached) * kv.page_size, len(token_ids), cached)
    device.copy(kv.pop_copies(request_id))
    device.write(kv.page_ids(request_id), len(cached) * kv.page_size, token_ids[len(cached) * kv.page_size:])
    kv.cache_full_pages(request_id, len(token_ids), lambda a, b: token_ids[a:b], salt)


def test_a_hit_is_the_longest_prefix_and_never_the_last_token():
    kv = KVCacheManager(PagePool(16), 4, enable_prefix_caching=True)
    device = FakeDevice(16, 4)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]  # three full pages
    _computed(kv, device, "a", tokens)
    assert kv.find_cached_prefix(tokens, None) == kv.page_ids("a")[:2]  # the last token stays uncovered
    assert kv.find_cached_prefix(tokens + [1], None) == kv.page_ids("a")[:3]
    assert kv.find_cached_prefix(tokens[:4] + [0] + tokens[5:], None) == kv.page_ids("a")[:1]
    assert kv.find_cached_prefix([0] + tokens[1:], None) == []
    kv.free("a")
    assert kv.pool.num_free == kv.pool.num_usable
    assert kv.find_cached_prefix(tokens + [1], None) != []  # freed pages stay cached


def test_different_cache_salts_never_share():
    kv = KVCacheManager(PagePool(16), 4, enable_prefix_caching=True)
    device = FakeDevice(16, 4)
    tokens = list(range(1, 14))
    _computed(kv, device, "a", tokens, salt="alice")
    assert kv.find_cached_prefix(tokens, "bob") == []
    assert kv.find_cached_prefix(tokens, None) == []
    assert kv.find_cached_prefix(tokens, "alice") == kv.page_ids("a")[:3]
    _computed(kv, device, "b", tokens, salt="bob")
    assert not set(kv.page_ids("a")) & set(kv.page_ids("b"))
    kv.free("a")
    assert kv.find_cached_prefix(tokens, "bob") == kv.page_ids("b")[:3]


def test_reset_cache_forgets_registrations_but_keeps_held_pages():
    kv = KVCacheManager(PagePool(16), 4, enable_prefix_caching=True)
    device = FakeDevice(16, 4)
    tokens = list(range(1, 14))
    _computed(kv, device, "a", tokens)
    _computed(kv, device, "b", tokens + [99])  # shares a's three full pages
    pages_a, pages_b = list(kv.page_ids("a")), list(kv.page_ids("b"))
    assert pages_b[:3] == pages_a[:3]
    counts = [kv.pool.ref_count(page) for page in range(16)]
    free = kv.pool.num_free
    assert kv.pool.reset_cache() == 3
    assert kv.pool.num_cached == 0
    assert kv.page_ids("a") == pages_a and kv.page_ids("b") == pages_b
    assert [kv.pool.ref_count(page) for page in range(16)] == counts and kv.pool.num_free == free
    assert kv.find_cached_prefix(tokens + [99], None) == []
    kv.free("a")
    kv.free("b")
    assert kv.pool.num_free == kv.pool.num_usable


def test_a_forks_write_copies_from_the_shared_page_to_a_fresh_one():
    kv = KVCacheManager(PagePool(16), 4, enable_prefix_caching=True)
    device = FakeDevice(16, 4)
    prompt = [3, 1, 4, 1, 5, 9]  # the last page is partly filled: shared, then copied before the write
    _computed(kv, device, "0_r", prompt)
    free_before = set(free_queue(kv.pool))
    kv.fork("1_r", "0_r", len(prompt))
    assert kv.page_ids("1_r") == kv.page_ids("0_r")
    assert [kv.pool.ref_count(page) for page in kv.page_ids("0_r")] == [2, 2]
    assert kv.allocate_slots("1_r", len(prompt) - 1, len(prompt))
    ((source, copy),) = kv.pop_copies("1_r")
    assert source == kv.page_ids("0_r")[1] and copy == kv.page_ids("1_r")[1] and copy in free_before
    assert kv.page_ids("1_r")[0] == kv.page_ids("0_r")[0]
    assert [kv.pool.ref_count(page) for page in kv.page_ids("1_r")] == [2, 1]
    assert kv.pop_copies("1_r") == []
    device.copy([(source, copy)])
    device.write(kv.page_ids("1_r"), len(prompt) - 1, prompt[-1:])
    device.check_context("1_r", kv.page_ids("1_r"), prompt)
    kv.free("0_r")
    kv.free("1_r")
    assert kv.pool.num_free == kv.pool.num_usable


def test_a_hash_collision_never_returns_a_wrong_page(monkeypatch):
    """Every page hashes the same: a lookup must still never return a page holding other tokens or the
    same tokens at other positions (after another prefix)."""
    monkeypatch.setattr(cache_manager, "page_hash", lambda parent, token_ids: b"collision")
    kv = KVCacheManager(PagePool(16), 4, enable_prefix_caching=True)
    device = FakeDevice(16, 4)
    _computed(kv, device, "a", [1, 2, 3, 4, 9, 9, 9, 9, 5])
    assert kv.find_cached_prefix([5, 6, 7, 8, 1], None) == []  # other tokens
    for token_ids in ([1, 2, 3, 4, 1, 2, 3, 4, 7], [1, 2, 3, 4, 9, 9, 9, 9, 1, 2, 3, 4, 0]):
        for index, page in enumerate(kv.find_cached_prefix(token_ids, None)):
            want = [(token, position) for position, token in enumerate(token_ids)][index * 4 : index * 4 + 4]
            assert device.slots[page] == want, (
                f"the lookup of {token_ids} returns page {page} holding {device.slots[page]} for positions "
                f"{index * 4}..{index * 4 + 3}"
            )


# ---- the scheduler on random workloads with shared prefixes -----------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec:
    """One user request: `n` samples (sample i > 0 forks sample 0's prompt) with one prompt and salt."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    n: int = 1
    salt: str | None = None
    stop_token: int | None = None
    prompt_logprobs: bool = False
    priority: int = 0
    arrival_step: int = 0
    abort_step: int | None = None  # steps after arrival
    abort_mid_step: bool = False

    def sample_ids(self) -> list[str]:
        return [self.request_id] if self.n == 1 else [f"{i}_{self.request_id}" for i in range(self.n)]

    def build(self, max_model_len: int, arrival_time: float) -> list[Request]:
        params = SamplingParams(max_tokens=self.max_tokens, n=self.n,
                                stop_token_ids=[] if self.stop_token is None else [self.stop_token])
        ids = self.sample_ids()
        return [
            Request(
                request_id=rid, prompt_token_ids=list(self.prompt), sampling_params=params, eos_token_ids=(),
                seed=0, max_tokens=min(self.max_tokens, max_model_len - len(self.prompt)),
                arrival_time=arrival_time, priority=self.priority,
                prompt_logprobs=[None] if self.prompt_logprobs and index == 0 else None,
                fork_source=None if index == 0 else ids[0], cache_salt=self.salt,
            )
            for index, rid in enumerate(ids)
        ]


def oracle(request_id: str, prompt: tuple[int, ...], max_tokens: int, stop_token: int | None,
           max_model_len: int) -> tuple[list[int], str]:
    """A sample's tokens and finish reason with no scheduler, no pages and no cache."""
    tokens, out = list(prompt), []
    cap = min(max_tokens, max_model_len - len(prompt))
    while True:
        token = model_token(request_id, tokens)
        tokens.append(token)
        out.append(token)
        if token == stop_token:
            return out, "stop"
        if len(out) >= cap:
            return out, "length"


@st.composite
def shared_prefix_workloads(draw, max_requests: int = 10):
    """A small scheduler (pool, budget, seqs) and user requests whose prompts share prefixes of random
    lengths, with random salts, n > 1, prompt logprobs, priorities, arrivals and aborts."""
    page_size = draw(st.sampled_from([2, 4, 8]))
    tokens = st.integers(0, ALPHABET - 1)
    # Some prefixes repeat one page of tokens, so equal page contents sit at different positions.
    periodic = st.tuples(st.lists(tokens, min_size=page_size, max_size=page_size), st.integers(2, 5)).map(
        lambda page_reps: page_reps[0] * page_reps[1])
    families = [draw(st.one_of(st.lists(tokens, min_size=1, max_size=6 * page_size), periodic))
                for _ in range(draw(st.integers(1, 3)))]
    num_requests = draw(st.integers(1, max_requests))
    prompts = []
    for _ in range(num_requests):
        family = draw(st.sampled_from(families))
        shared = draw(st.integers(0, len(family)))
        tail = draw(st.lists(st.integers(0, ALPHABET - 1), max_size=2 * page_size))
        prompts.append(tuple(family[:shared] + tail) or (0,))
    max_model_len = max(map(len, prompts)) + draw(st.integers(1, 16))
    chunked = draw(st.booleans())
    budget = draw(st.integers(4, 48))
    if not chunked:
        budget = max(budget, max_model_len)
    one_request = pages_for_tokens(max_model_len, page_size)
    extra = draw(st.one_of(st.integers(0, 2), st.integers(0, 2 * one_request)))
    config = dict(page_size=page_size, num_pages=one_request + extra + 1,
                  max_num_seqs=draw(st.integers(1, 8)), max_num_batched_tokens=budget,
                  max_model_len=max_model_len, enable_chunked_prefill=chunked,
                  policy=draw(st.sampled_from(["fcfs", "priority"])))
    arrivals = sorted(draw(st.integers(0, 15)) for _ in range(num_requests))
    specs = []
    for index, (prompt, arrival) in enumerate(zip(prompts, arrivals)):
        request_id = f"u{index}"
        n = draw(st.sampled_from([1, 1, 1, 2, 3]))
        max_tokens = draw(st.integers(1, 12))
        stop_token = None
        if draw(st.booleans()):  # a token sample 0 actually produces
            out, _ = oracle(request_id if n == 1 else f"0_{request_id}", prompt, max_tokens, None, max_model_len)
            stop_token = draw(st.sampled_from(out))
        specs.append(Spec(
            request_id=request_id, prompt=prompt, max_tokens=max_tokens, n=n,
            salt=draw(st.sampled_from([None, None, None, "a", "b"])), stop_token=stop_token,
            prompt_logprobs=draw(st.sampled_from([False, False, False, True])),
            priority=draw(st.integers(0, 2)), arrival_step=arrival,
            abort_step=draw(st.one_of(st.none(), st.none(), st.integers(0, 25))),
            abort_mid_step=draw(st.booleans()),
        ))
    fail_steps = frozenset(draw(st.lists(st.integers(0, 60), max_size=2)))
    return config, specs, fail_steps


def make_caching_scheduler(*, page_size, num_pages, max_num_seqs, max_num_batched_tokens, max_model_len,
                           enable_chunked_prefill=True, policy="fcfs") -> Scheduler:
    config = SchedulerSettings(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                             policy=policy)
    return Scheduler(config, KVCacheManager(PagePool(num_pages), page_size, enable_prefix_caching=True))


def check_written_pages_are_private(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """Every page a step writes is held by its writer alone (after the step's copies), and the copies go
    from a page to a page the writer alone holds."""
    kv = scheduler.kv
    assert output.total_num_tokens <= scheduler.config.max_num_batched_tokens, "the token budget is exceeded"
    assert len(output.scheduled) <= scheduler.config.max_num_seqs
    destinations = [dest for _, dest in output.page_copies]
    assert len(destinations) == len(set(destinations))
    for item in output.scheduled:
        start = item.num_computed_tokens + item.num_present_tokens  # the first position the step writes
        stop = item.num_computed_tokens + item.num_new_tokens
        assert item.page_ids == tuple(kv.page_ids(item.request.request_id))
        assert len(item.page_ids) * kv.page_size >= stop
        for page in item.page_ids[start // kv.page_size : pages_for_tokens(stop, kv.page_size)]:
            assert kv.pool.ref_count(page) == 1, (
                f"{item.request.request_id} writes page {page} that {kv.pool.ref_count(page)} requests hold"
            )
        for source, dest in item.page_copies:
            assert source != NULL_PAGE and dest != NULL_PAGE and source != dest
            assert dest in item.page_ids and kv.pool.ref_count(dest) == 1


def run_cached_workload(scheduler: Scheduler, specs: list[Spec], fail_steps=frozenset(),
                        check_hashes: bool = True) -> dict[str, Request]:
    """Arrivals, aborts (between steps and mid-step), steps the engine takes back (a request fails alone,
    as `EngineCore._fail_unbuildable` does), the fake device, and every invariant after every step."""
    kv, page_size = scheduler.kv, scheduler.kv.page_size
    max_model_len = scheduler.config.max_model_len
    device = FakeDevice(kv.pool.num_pages, page_size)
    allocate = kv.pool.allocate

    def checked_allocate(count: int) -> list[int]:
        """The pool never hands out a page that some request's page list still holds."""
        held = {page for pages in kv._pages.values() for page in pages}
        pages = allocate(count)
        assert not set(pages) & held, f"the pool handed out pages {sorted(set(pages) & held)} still held"
        return pages

    kv.pool.allocate = checked_allocate
    book = ChainBook(page_size)
    oracles = {}
    for spec in specs:
        for rid in spec.sample_ids():
            oracles[rid] = oracle(rid, spec.prompt, spec.max_tokens, spec.stop_token, max_model_len)
    requests: dict[str, Request] = {}
    samples_of: dict[str, list[str]] = {}
    aborts: dict[tuple[int, bool], list[str]] = collections.defaultdict(list)
    failed: set[str] = set()
    work = sum(spec.n * (len(spec.prompt) + spec.max_tokens + 1) for spec in specs)
    max_steps = max(spec.arrival_step for spec in specs) + 4 * work + 50
    last_arrival = max(spec.arrival_step for spec in specs)

    def holders():
        live = {r.request_id: r for r in scheduler.running}
        for rid, request in requests.items():
            if rid not in live:
                assert kv.page_ids(rid) == [], f"{rid} ({request.status.name}) holds pages"
        return {rid: (r.token_ids(0, r.num_tokens), r.num_computed_tokens, r.cache_salt) for rid, r in live.items()}

    step = 0
    while step <= last_arrival or scheduler.has_unfinished_requests():
        assert step < max_steps, f"no progress after {max_steps} steps"
        for index, spec in enumerate(specs):
            if spec.arrival_step == step:
                samples_of[spec.request_id] = spec.sample_ids()
                for request in spec.build(max_model_len, arrival_time=step + index * 1e-3):
                    requests[request.request_id] = request
                    scheduler.add_request(request)
                if spec.abort_step is not None:
                    aborts[step + spec.abort_step, spec.abort_mid_step].append(spec.request_id)
        for user_id in aborts.get((step, False), []):
            for rid in samples_of[user_id]:
                scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)

        output = scheduler.schedule()
        check_written_pages_are_private(scheduler, output)
        for item in output.scheduled:
            if item.request.prompt_logprobs is not None:
                assert item.request.num_cached_tokens == 0, "a request scoring its prompt got cache hits"
        if step in fail_steps and output.scheduled:
            # The step cannot be built because of one request: it alone fails, the others run next step.
            victim = output.scheduled[step % len(output.scheduled)].request
            scheduler.unschedule(output)
            scheduler.finish_request(victim.request_id, RequestStatus.FINISHED_ERROR)
            failed.add(victim.request_id)
        else:
            sampled = device.run(output)
            for user_id in aborts.get((step, True), []):
                for rid in samples_of[user_id]:
                    scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            scheduler.update(output, sampled)

        live = holders()
        for request in [item.request for item in output.scheduled] + list(scheduler.running):
            book.add(request.token_ids(0, request.num_tokens), request.cache_salt)
        if check_hashes:
            check_pool(kv, device, book, live)
        for rid, request in requests.items():
            want, _ = oracles[rid]
            assert request.output_token_ids == want[: request.num_output_tokens], (
                f"{rid} produced {request.output_token_ids}, expected a prefix of {want}"
            )
        step += 1

    pool = kv.pool
    assert pool.num_free == pool.num_usable, "pages are still held after every request ended"
    assert all(pool.ref_count(page) == 0 for page in range(pool.num_pages))
    assert kv.num_requests == 0 and not scheduler.requests
    for rid, request in requests.items():
        want, reason = oracles[rid]
        assert request.is_finished
        if request.status == RequestStatus.FINISHED_ABORTED or rid in failed:
            continue
        assert request.output_token_ids == want, f"{rid}: {request.output_token_ids} != {want}"
        assert request.status.finish_reason == reason
    return requests


def _check(config, specs, fail_steps, check_hashes=True):
    scheduler = make_caching_scheduler(**config)
    requests = run_cached_workload(scheduler, specs, fail_steps, check_hashes)
    event(f"prefix cache hits: {scheduler.num_prefix_cache_hits > 0}")
    event(f"preempted: {scheduler.num_preemptions > 0}")
    event(f"forked: {any(r.fork_source for r in requests.values())}")
    assert scheduler.num_prefix_cache_hits <= scheduler.num_prefix_cache_queries


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_prefix_workloads())
def test_random_shared_prefix_workloads(workload):
    """Caching, forks, eviction, preemption, aborts and taken-back steps change no output; every
    per-step invariant holds; every page comes back."""
    _check(*workload)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_prefix_workloads())
def test_random_workloads_under_hash_collisions(workload):
    """With every page hashing the same, token-for-token verification must still keep outputs exact."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cache_manager, "page_hash", lambda parent, token_ids: b"collision")
        _check(*workload, check_hashes=False)


def test_shared_prefixes_hit_and_forks_share():
    """A deterministic workload: a shared system prompt hits the cache, n = 3 forks, all exact."""
    system = tuple([1, 2, 3, 0] * 6)
    specs = [Spec("sys0", system + (1, 1), max_tokens=6),
             Spec("sys1", system + (2, 2, 2), max_tokens=6, arrival_step=30),
             Spec("fan", system + (3,), max_tokens=5, n=3, arrival_step=31),
             Spec("salted", system + (1, 1), max_tokens=4, salt="other", arrival_step=32)]
    scheduler = make_caching_scheduler(page_size=4, num_pages=40, max_num_seqs=8, max_num_batched_tokens=16,
                                       max_model_len=64)
    requests = run_cached_workload(scheduler, specs)
    assert requests["sys1"].num_cached_tokens == len(system)
    assert requests["0_fan"].num_cached_tokens == len(system)
    assert requests["salted"].num_cached_tokens == 0
    assert scheduler.num_prefix_cache_hits >= 2 * len(system)


def test_freed_pages_stay_cached_until_allocated_least_recently_freed_first():
    kv = KVCacheManager(PagePool(7), 4, enable_prefix_caching=True)  # 6 usable pages
    device = FakeDevice(7, 4)
    old, new = [1] * 8 + [0], [2] * 8 + [0]
    _computed(kv, device, "old", old)
    _computed(kv, device, "new", new)
    old_pages, new_pages = kv.page_ids("old")[:2], kv.page_ids("new")[:2]
    kv.free("old")
    kv.free("new")
    assert kv.pool.num_cached == 4 and kv.pool.num_free == kv.pool.num_usable
    assert kv.allocate_slots("filler", 0, 4 * 4)  # 4 of the 6 free pages: the least recently freed go first
    assert kv.find_cached_prefix(old, None) == []  # evicted
    assert kv.find_cached_prefix(new, None) == new_pages  # still cached
    assert not set(kv.page_ids("filler")) & set(new_pages) and set(old_pages) <= set(kv.page_ids("filler"))
    assert kv.pool.num_cached == 2
