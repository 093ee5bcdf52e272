"""HostSwap (jaxserve/runner/host_swap.py): page copies between a device pool and the host pool, on tiny pools.

Pages swapped out and back in land whole in their new places, in every cache array of the layout; a swap-in
reads the host pool before the same call's swap-outs land in it and writes the device after they read it;
copies of more pages than the largest bucket go in several calls; the bandwidth probe leaves the pool as it
was and reports positive rates.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.runner.host_swap import HostSwap, swap_buckets

SHAPE = (2, 12, 4, 2, 3)  # (L, P, S, heads, D): 12 device pages of 4 slots


@pytest.fixture(scope="module")
def swap():
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("model",)), P())
    host = HostSwap(((2, 9, 4, 2, 3), (2, 9, 4, 2, 3)), np.float32, (sharding, sharding), max_pages=6)
    caches = _pool(sharding)
    host.compile(caches)
    return host, sharding


def _pool(sharding) -> tuple[jax.Array, jax.Array]:
    """K and V pools whose every value names its (array, layer, page, slot, head, dim)."""
    values = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    return jax.device_put((values, values + 0.5), (sharding, sharding))


def test_buckets_are_powers_of_four_up_to_the_pages_of_a_request():
    assert swap_buckets(1) == (1,)
    assert swap_buckets(6) == (4, 6)
    assert swap_buckets(100) == (4, 16, 64, 100)
    assert swap_buckets(10_000) == (4, 16, 64, 256)


def test_pages_come_back_whole_in_their_new_places(swap):
    host, sharding = swap
    caches = _pool(sharding)
    original = [np.asarray(c).copy() for c in caches]
    caches = host.swap(caches, [(3, 1), (7, 2), (5, 3)], [])  # device pages 3, 7, 5 -> host 1, 2, 3
    host.flush()
    for pool, before in zip(host.pages, original):
        np.testing.assert_array_equal(pool[:, [1, 2, 3]], before[:, [3, 7, 5]])
    caches = host.swap(caches, [], [(1, 9), (2, 10), (3, 11)])  # and back into device pages 9, 10, 11
    for after, before in zip(caches, original):
        after = np.asarray(after)
        np.testing.assert_array_equal(after[:, [9, 10, 11]], before[:, [3, 7, 5]])
        np.testing.assert_array_equal(after[:, 1:9], before[:, 1:9])  # nothing else moved (page 0 is scratch)
    assert host.bytes_out == host.bytes_in == 3 * host.page_bytes


def test_one_call_swaps_in_before_its_swap_outs_land_and_after_they_read(swap):
    """Host page 4 is read by a swap-in and written by a swap-out of the same call; device page 2 is read by the
    swap-out and written by the swap-in."""
    host, sharding = swap
    caches = _pool(sharding)
    original = [np.asarray(c).copy() for c in caches]
    caches = host.swap(caches, [(6, 4)], [])
    host.flush()
    caches = host.swap(caches, [(2, 4)], [(4, 2)])  # page 6's content comes back into 2 while 2 goes out to 4
    host.flush()
    for after, pool, before in zip(caches, host.pages, original):
        np.testing.assert_array_equal(np.asarray(after)[:, 2], before[:, 6])
        np.testing.assert_array_equal(pool[:, 4], before[:, 2])


def test_more_pages_than_the_largest_bucket_go_in_several_calls(swap):
    host, sharding = swap
    caches = _pool(sharding)
    original = [np.asarray(c).copy() for c in caches]
    copies = [(page, page - 1) for page in range(2, 10)]  # 8 pages; buckets (4, 6)
    caches = host.swap(caches, copies, [])
    host.flush()
    for pool, before in zip(host.pages, original):
        np.testing.assert_array_equal(pool[:, 1:9], before[:, 2:10])


def test_bandwidth_probe(swap):
    host, sharding = swap
    caches = _pool(sharding)
    original = [np.asarray(c).copy() for c in caches]
    caches, rates = host.measure_bandwidth(caches, 6, repeats=2)
    for after, before in zip(caches, original):
        np.testing.assert_array_equal(np.asarray(after)[:, 1:], before[:, 1:])  # out and back: the same pool
    for way in ("out_gbps", "in_gbps"):
        mean, best = rates[way]
        assert 0 < mean <= best
