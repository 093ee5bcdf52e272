"""PagePool and KVCacheManager: the host-side page bookkeeping (pure Python, no jax)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxserve.kv.cache_manager import KVCacheManager, pages_for_tokens
from jaxserve.kv.page_pool import NULL_PAGE, PAGE_STATES, PagePool

# ---- PagePool ------------------------------------------------------------------------------


def test_pool_needs_a_page_besides_the_null_page():
    with pytest.raises(ValueError):
        PagePool(1)
    with pytest.raises(ValueError):
        PagePool(0)
    pool = PagePool(2)
    assert pool.num_usable == 1 and pool.num_free == 1
    assert pool.allocate(1) == [1]


def test_fresh_pool_counts_and_usage():
    pool = PagePool(9)
    assert pool.num_pages == 9
    assert pool.num_usable == 8
    assert pool.num_free == 8
    assert pool.usage() == 0.0
    assert all(pool.ref_count(page) == 0 for page in range(9))


def test_page_states_map_free_cached_held_and_shared_pages_in_runs():
    pool = PagePool(9)
    assert pool.page_states() == [[0, 8]]
    first, second, third = pool.allocate(3)  # pages 1, 2, 3
    pool.register(first, b"a", (1, 2), ("root", None))
    pool.take(second)  # shared by two holders
    pool.release([first])  # cached, nobody holds it
    free, cached, in_use, shared = (PAGE_STATES.index(name) for name in ("free", "cached", "in_use", "shared"))
    assert pool.page_states() == [[cached, 1], [shared, 1], [in_use, 1], [free, 5]]
    assert sum(run for _, run in pool.page_states()) == pool.num_usable


def test_allocate_gives_distinct_non_null_pages_with_ref_count_one():
    pool = PagePool(9)
    pages = pool.allocate(8)
    assert sorted(pages) == list(range(1, 9))
    assert NULL_PAGE not in pages
    assert all(pool.ref_count(page) == 1 for page in pages)
    assert pool.ref_count(NULL_PAGE) == 0
    assert pool.num_free == 0
    assert pool.usage() == 1.0


def test_allocate_zero_pages_is_a_no_op():
    pool = PagePool(4)
    assert pool.allocate(0) == []
    assert pool.num_free == 3


def test_usage_math():
    pool = PagePool(5)  # 4 usable
    first = pool.allocate(1)
    assert pool.usage() == pytest.approx(0.25)
    second = pool.allocate(2)
    assert pool.usage() == pytest.approx(0.75)
    pool.release(first)
    assert pool.usage() == pytest.approx(0.5)
    pool.release(second)
    assert pool.usage() == 0.0


def test_allocating_more_than_free_raises_and_changes_nothing():
    pool = PagePool(5)
    held = pool.allocate(3)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert pool.num_free == 1
    assert all(pool.ref_count(page) == 1 for page in held)
    assert pool.allocate(1) not in held


def test_double_release_raises():
    pool = PagePool(4)
    pages = pool.allocate(2)
    pool.release(pages)
    with pytest.raises(RuntimeError):
        pool.release(pages[:1])
    assert pool.num_free == 3


def test_release_of_a_never_allocated_page_raises():
    pool = PagePool(4)
    with pytest.raises(RuntimeError):
        pool.release([2])
    assert pool.num_free == 3


def test_releasing_the_null_page_raises():
    pool = PagePool(4)
    pool.allocate(3)
    with pytest.raises(RuntimeError):
        pool.release([NULL_PAGE])


def test_released_pages_are_reused():
    pool = PagePool(3)
    first = pool.allocate(2)
    pool.release(first)
    second = pool.allocate(2)
    assert sorted(second) == sorted(first)


@settings(max_examples=200, deadline=None)
@given(
    num_pages=st.integers(2, 40),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=60),
)
def test_random_allocate_release_balance(num_pages, ops):
    """Random allocate/release sequences: free + held == usable, no page twice, never the null page."""
    pool = PagePool(num_pages)
    held: list[list[int]] = []
    for is_allocate, amount in ops:
        if is_allocate:
            if amount > pool.num_free:
                with pytest.raises(RuntimeError):
                    pool.allocate(amount)
            else:
                held.append(pool.allocate(amount))
        elif held:
            pool.release(held.pop(amount % len(held)))
        flat = [page for group in held for page in group]
        assert NULL_PAGE not in flat
        assert len(flat) == len(set(flat))
        assert all(pool.ref_count(page) == 1 for page in flat)
        assert pool.num_free + len(flat) == pool.num_usable
        assert pool.usage() == pytest.approx(len(flat) / pool.num_usable)
    for group in held:
        pool.release(group)
    assert pool.num_free == pool.num_usable
    assert all(pool.ref_count(page) == 0 for page in range(num_pages))


# ---- KVCacheManager ------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [8, 16])
def test_pages_for_tokens(page_size):
    assert pages_for_tokens(0, page_size) == 0
    assert pages_for_tokens(1, page_size) == 1
    assert pages_for_tokens(page_size, page_size) == 1
    assert pages_for_tokens(page_size + 1, page_size) == 2
    assert pages_for_tokens(3 * page_size, page_size) == 3


def test_allocate_slots_grows_in_page_steps():
    kv = KVCacheManager(PagePool(10), page_size=8)
    assert kv.allocate_slots("a", 0, 1)
    assert len(kv.page_ids("a")) == 1
    assert kv.allocate_slots("a", 0, 8)
    assert len(kv.page_ids("a")) == 1
    assert kv.allocate_slots("a", 0, 9)
    assert len(kv.page_ids("a")) == 2
    before = list(kv.page_ids("a"))
    assert kv.allocate_slots("a", 0, 3)  # never shrinks
    assert kv.page_ids("a") == before
    assert kv.num_pages_needed("a", 24) == 1
    assert kv.num_pages_needed("a", 16) == 0
    assert kv.num_requests == 1
    assert kv.pool.num_free == 9 - 2


def test_allocate_slots_returns_false_and_changes_nothing_when_short():
    kv = KVCacheManager(PagePool(5), page_size=8)  # 4 usable
    assert kv.allocate_slots("a", 0, 16)  # 2 pages
    assert kv.allocate_slots("b", 0, 8)  # 1 page
    a_before, b_before = list(kv.page_ids("a")), list(kv.page_ids("b"))
    free_before = kv.pool.num_free
    assert not kv.allocate_slots("a", 0, 8 * 4)  # needs 2 more, 1 free
    assert not kv.allocate_slots("c", 0, 8 * 2)  # new request needing 2, 1 free
    assert kv.page_ids("a") == a_before and kv.page_ids("b") == b_before
    assert kv.page_ids("c") == []
    assert kv.pool.num_free == free_before
    assert kv.num_requests == 2  # "c" was not registered
    assert kv.allocate_slots("a", 0, 8 * 3)  # exactly the last free page
    assert kv.pool.num_free == 0


def test_allocate_slots_for_zero_tokens_holds_nothing():
    kv = KVCacheManager(PagePool(3), page_size=16)
    assert kv.allocate_slots("a", 0, 0)
    assert kv.page_ids("a") == []
    assert kv.num_requests == 0


def test_free_returns_everything_and_is_safe_to_repeat():
    kv = KVCacheManager(PagePool(6), page_size=8)
    kv.allocate_slots("a", 0, 20)
    kv.allocate_slots("b", 0, 5)
    kv.free("a")
    assert kv.page_ids("a") == []
    assert kv.pool.num_free == 4
    kv.free("a")  # already freed
    kv.free("never-seen")
    assert kv.pool.num_free == 4
    kv.free("b")
    assert kv.pool.num_free == kv.pool.num_usable
    assert kv.num_requests == 0


class KVCacheMachine(RuleBasedStateMachine):
    """Random grow/free over a few requests against a simple model of who holds how many pages."""

    def __init__(self):
        super().__init__()
        self.page_size = 8
        self.kv = KVCacheManager(PagePool(12), self.page_size)
        self.tokens: dict[str, int] = {}  # request -> tokens it has asked for (max so far)

    @rule(request_id=st.sampled_from("abcd"), total_tokens=st.integers(0, 100))
    def grow(self, request_id, total_tokens):
        before = {rid: list(self.kv.page_ids(rid)) for rid in "abcd"}
        free_before = self.kv.pool.num_free
        have = len(before[request_id])
        want = max(have, pages_for_tokens(total_tokens, self.page_size))
        ok = self.kv.allocate_slots(request_id, 0, total_tokens)
        assert ok == (want - have <= free_before)
        if ok:
            assert len(self.kv.page_ids(request_id)) == want
            assert self.kv.page_ids(request_id)[:have] == before[request_id]  # existing pages keep their order
        else:
            assert {rid: list(self.kv.page_ids(rid)) for rid in "abcd"} == before
            assert self.kv.pool.num_free == free_before

    @precondition(lambda self: self.kv.num_requests > 0)
    @rule(request_id=st.sampled_from("abcd"))
    def free(self, request_id):
        held = len(self.kv.page_ids(request_id))
        free_before = self.kv.pool.num_free
        self.kv.free(request_id)
        assert self.kv.page_ids(request_id) == []
        assert self.kv.pool.num_free == free_before + held

    @invariant()
    def pages_balance(self):
        held = [page for rid in "abcd" for page in self.kv.page_ids(rid)]
        assert NULL_PAGE not in held
        assert len(held) == len(set(held))
        assert all(self.kv.pool.ref_count(page) == 1 for page in held)
        assert self.kv.pool.num_free + len(held) == self.kv.pool.num_usable
        assert self.kv.num_requests == sum(1 for rid in "abcd" if self.kv.page_ids(rid))

    def teardown(self):
        for rid in "abcd":
            self.kv.free(rid)
        assert self.kv.pool.num_free == self.kv.pool.num_usable


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("page", [-1, -3, 4, 100])
def test_release_of_an_out_of_range_page_raises_and_changes_nothing(page):
    """Page ids outside [1, num_pages) are caller bugs; a negative id must not alias a real page."""
    pool = PagePool(4)
    held = pool.allocate(3)
    with pytest.raises((RuntimeError, ValueError, IndexError)):
        pool.release([page])
    assert pool.num_free == 0
    assert all(pool.ref_count(p) == 1 for p in held)
