"""The process's compiled executables: counting XLA compilations, sharing executables between engines that trace
the same steps, and compiling many on a thread pool."""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm


class CompileCounter:
    """Counts XLA backend compilations in this process (all engines together)."""

    _lock = threading.Lock()
    _count = 0
    _registered = False

    @classmethod
    def install(cls) -> None:
        """Register the jax.monitoring listener once per process."""
        with cls._lock:
            if not cls._registered:
                jax.monitoring.register_event_duration_secs_listener(cls._on_event)
                cls._registered = True

    @classmethod
    def _on_event(cls, event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            with cls._lock:
                cls._count += 1

    @classmethod
    def count(cls) -> int:
        """Backend compilations so far."""
        return cls._count


# Executables of this process by what they were traced from (`Runner.trace_key`, the step function, the shapes,
# dtypes and shardings of its arguments): an engine built like an earlier one (a benchmark comparing scheduler
# options, the tests) takes its executables instead of tracing and compiling them again. An entry holds an
# executable only (no params, no pages); past SHARED_EXECUTABLES the least recently used go.
SHARED_EXECUTABLES = 512
_shared_executables: collections.OrderedDict[tuple, jax.stages.Compiled] = collections.OrderedDict()
_shared_lock = threading.Lock()


def shared_executable(key: tuple) -> jax.stages.Compiled | None:
    """The process's executable under `key`, or None."""
    with _shared_lock:
        if key in _shared_executables:
            _shared_executables.move_to_end(key)
        return _shared_executables.get(key)


def share_executable(key: tuple, executable: jax.stages.Compiled) -> None:
    """Keep `executable` under `key` for later engines of this process."""
    with _shared_lock:
        _shared_executables[key] = executable
        while len(_shared_executables) > SHARED_EXECUTABLES:
            _shared_executables.popitem(last=False)


def clear_shared_executables() -> None:
    """Forget every shared executable, so those no engine holds are freed (a process that builds many engines one
    after another, such as a test run, would otherwise keep up to SHARED_EXECUTABLES alive)."""
    with _shared_lock:
        _shared_executables.clear()


def abstract_arguments(args: tuple) -> tuple:
    """What a call's trace depends on besides its function: the tree of `args` and each leaf's shape, dtype and
    sharding (static leaves, such as layouts, as they are)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return tree, tuple((leaf.shape, jnp.dtype(leaf.dtype), leaf.sharding) if hasattr(leaf, "shape") else leaf
                       for leaf in leaves)


def compile_all(lowered: list[tuple[tuple[dict, tuple, tuple], jax.stages.Lowered]], description: str,
                show_progress: bool) -> None:
    """Compile each ((table, key, shared key), lowered) on a thread pool (XLA releases the GIL) into `table[key]`,
    and share it under its shared key."""
    bar = tqdm(total=len(lowered), desc=description, disable=not show_progress, leave=False)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
    try:
        futures = {pool.submit(low.compile): target for target, low in lowered}
        for future in concurrent.futures.as_completed(futures):
            table, key, shared_key = futures[future]
            table[key] = future.result()
            share_executable(shared_key, table[key])
            bar.update()
    except BaseException:  # a failed compile or a KeyboardInterrupt: drop the compiles queued, wait for none
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        bar.close()
    pool.shutdown()
