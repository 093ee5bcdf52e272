"""HostSwap: the host-memory pool that preempted requests swap their KV pages to, and the copies both ways.

The host pool is numpy arrays in the device pool's layout (every cache array of the attention backend,
all KV heads), `num_pages` pages of which page 0 is never handed out, like the device pool's null page.
The cache manager decides which pages move (kv/cache_manager.py); this module moves them:

- swap-out: one fixed-shape gather executable per page-count bucket reads the pages from the device
  pool (each device its own KV-head shard) and, where the backend has pinned host memory, sends them
  there (an asynchronous device-to-host copy); the numpy pool takes them later (`flush`), when the
  step they were dispatched before has finished, so the host never waits on the copy.
- swap-in: the host pages are read from numpy, put on the devices (split over the KV heads) and
  written into fresh device pages by one scatter executable per bucket (the pool donated: in place).

Both are dispatched before the step's forward, so the device makes them in order with the steps: a
swap-out reads the pages after the last step wrote them and before anything writes them again.
Padding entries copy the null page (to the host's page 0, or onto the device's null page).
"""

from __future__ import annotations

import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxserve.batch.buckets import geometric_ladder, pick_bucket
from jaxserve.kv.page_pool import NULL_PAGE

PageCopies = list[tuple[int, int]]  # (source page, destination page) pairs


def swap_buckets(max_pages: int) -> tuple[int, ...]:
    """Page counts the copy executables are compiled for: 4, 16, 64 ... up to `max_pages` (capped at 256;
    more pages are copied in several calls)."""
    return geometric_ladder(min(4, max_pages), min(max(max_pages, 1), 256), ratio=4)


def pinned_host(sharding: NamedSharding) -> NamedSharding | None:
    """`sharding` in pinned host memory where the devices have it (GPU, TPU); None on the CPU backend."""
    device = sharding.mesh.devices.flat[0]
    kinds = {memory.kind for memory in device.addressable_memories()}
    if device.platform == "cpu" or "pinned_host" not in kinds:
        return None
    return sharding.with_memory_kind("pinned_host")


class HostSwap:
    """The host pool's arrays and the compiled copies between it and the device pool."""

    def __init__(self, cache_shapes: tuple[tuple[int, ...], ...], dtype, shardings: tuple[NamedSharding, ...],
                 max_pages: int):
        self.pages = tuple(np.zeros(shape, dtype) for shape in cache_shapes)  # each (L, H, S, heads, D), lazy
        self._shardings = shardings
        self._host_shardings = tuple(pinned_host(sharding) for sharding in shardings)
        self.buckets = swap_buckets(max_pages)
        # (host pages, gathered arrays each (L, B, S, heads, D)) of swap-outs the numpy pool has not taken yet
        self._pending: list[tuple[list[int], tuple[jax.Array, ...]]] = []
        self._gather = jax.jit(lambda caches, pages: tuple(cache[:, pages] for cache in caches),
                               out_shardings=shardings)
        self._scatter = jax.jit(
            lambda caches, pages, values: tuple(c.at[:, pages].set(v) for c, v in zip(caches, values)),
            out_shardings=shardings, donate_argnums=(0,),
        )
        self._gather_exec: dict[int, jax.stages.Compiled] = {}  # B -> executable
        self._scatter_exec: dict[int, jax.stages.Compiled] = {}
        self.bytes_out = 0  # bytes copied to the host pool
        self.bytes_in = 0  # bytes copied back
        self.page_bytes = sum(array[:, :1].nbytes for array in self.pages)

    @property
    def num_pages(self) -> int:
        """Pages of the host pool (page 0 included)."""
        return self.pages[0].shape[1]

    def compile(self, caches: tuple[jax.Array, ...]) -> None:
        """AOT-compile the gather and scatter of every bucket against the device pool `caches`."""
        for bucket in self.buckets:
            pages = jax.ShapeDtypeStruct((bucket,), np.int32)
            values = tuple(jax.ShapeDtypeStruct((c.shape[0], bucket, *c.shape[2:]), c.dtype, sharding=s)
                           for c, s in zip(caches, self._shardings))
            self._gather_exec[bucket] = self._gather.lower(caches, pages).compile()
            self._scatter_exec[bucket] = self._scatter.lower(caches, pages, values).compile()

    def swap(self, caches: tuple[jax.Array, ...], swap_out: PageCopies, swap_in: PageCopies) -> tuple[jax.Array, ...]:
        """Dispatch a step's copies: `swap_out` (device page, host page) pairs, then `swap_in` (host page, device
        page) pairs; returns the device pool after them (the one passed in is donated when anything comes in).

        The swap-ins read the host pool before the swap-outs are taken into it (a host page freed by a
        swap-in may take a swap-out of the same step) and write after the swap-outs read the device (a
        device page freed by a swap-out may take a swap-in)."""
        if not swap_out and not swap_in:
            return caches
        self.flush()
        incoming = [(self._host_values(chunk), chunk) for chunk in self._chunks(swap_in)]
        for chunk in self._chunks(swap_out):
            gathered = self._gather_exec[len(chunk)](caches, _padded([device for device, _ in chunk], len(chunk)))
            if all(self._host_shardings):
                gathered = jax.device_put(gathered, self._host_shardings)  # asynchronous, to pinned host memory
            self._pending.append(([host for _, host in chunk if host != NULL_PAGE], gathered))
        self.bytes_out += len(swap_out) * self.page_bytes
        for values, chunk in incoming:
            devices = _padded([device for _, device in chunk], len(chunk))
            caches = self._scatter_exec[len(chunk)](caches, devices, jax.device_put(values, self._shardings))
        self.bytes_in += len(swap_in) * self.page_bytes
        return caches

    def flush(self) -> None:
        """Write the swap-outs dispatched so far into the numpy pool (waits for their copies)."""
        for host_pages, gathered in self._pending:
            for pool, values in zip(self.pages, gathered):
                pool[:, host_pages] = np.asarray(values)[:, : len(host_pages)]
        self._pending.clear()

    def _host_values(self, chunk: PageCopies) -> tuple[np.ndarray, ...]:
        """The host pages of a swap-in chunk, padded to its bucket with page 0, as arrays (L, B, S, heads, D)."""
        pages = _padded([host for host, _ in chunk], len(chunk))
        return tuple(pool[:, pages] for pool in self.pages)

    def _chunks(self, copies: PageCopies) -> list[PageCopies]:
        """`copies` cut into pieces of the largest bucket, each piece padded with null-page pairs to a bucket."""
        largest = self.buckets[-1]
        pieces = [copies[start : start + largest] for start in range(0, len(copies), largest)]
        return [piece + [(NULL_PAGE, NULL_PAGE)] * (pick_bucket(self.buckets, len(piece)) - len(piece))
                for piece in pieces]

    def measure_bandwidth(self, caches: tuple[jax.Array, ...], num_pages: int,
                          repeats: int = 5) -> tuple[tuple[jax.Array, ...], dict]:
        """Time swapping `num_pages` device pages out and back in (pages 1.., host pages 1..), each way until
        the data has arrived, after one untimed round; returns the device pool and {out_gbps, in_gbps: (mean,
        best)} over `repeats` rounds."""
        copies = [(page, page) for page in range(1, num_pages + 1)]
        times = {"out": [], "in": []}
        for _ in range(repeats + 1):
            start = time.perf_counter()
            caches = self.swap(caches, copies, [])
            self.flush()
            times["out"].append(time.perf_counter() - start)
            start = time.perf_counter()
            caches = jax.block_until_ready(self.swap(caches, [], copies))
            times["in"].append(time.perf_counter() - start)
        times = {way: values[1:] for way, values in times.items()}  # the first round warms up
        gigabytes = num_pages * self.page_bytes / 1e9
        return caches, {f"{way}_gbps": (gigabytes / (sum(t) / len(t)), gigabytes / min(t)) for way, t in times.items()}


def _padded(pages: list[int], size: int) -> np.ndarray:
    """(size,) int32 page ids: `pages` then the null page."""
    # returns (size,) int32
    return np.asarray(pages + [NULL_PAGE] * (size - len(pages)), np.int32)
