"""The process's compiled executables: counting XLA compilations, sharing executables between engines that trace
the same steps (and, through the executable store, between processes), and compiling many on a thread pool."""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jaxserve.runner.executable_store import FOLDER_NAME, ExecutableStore, open_store


class CompileCounter:
    """Counts XLA backend compilations in this process (all engines together), and each thread's loads from JAX's
    persistent compilation cache."""

    _lock = threading.Lock()
    _count = 0
    _registered = False
    _thread = threading.local()  # cache_hits: this thread's persistent-cache hits

    @classmethod
    def install(cls) -> None:
        """Register the jax.monitoring listeners once per process."""
        with cls._lock:
            if not cls._registered:
                jax.monitoring.register_event_duration_secs_listener(cls._on_event)
                jax.monitoring.register_event_listener(cls._on_cache_hit)
                cls._registered = True

    @classmethod
    def _on_cache_hit(cls, event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            cls._thread.cache_hits = cls.thread_cache_hits() + 1

    @classmethod
    def thread_cache_hits(cls) -> int:
        """Persistent-cache hits of this thread's compiles so far."""
        return getattr(cls._thread, "cache_hits", 0)

    @classmethod
    def _on_event(cls, event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            with cls._lock:
                cls._count += 1

    @classmethod
    def count(cls) -> int:
        """Backend compilations so far."""
        return cls._count


class CacheReads:
    """The serialized executable each thread last loaded from JAX's persistent compilation cache, while it records.

    XLA's CPU backend serializes a loaded executable again without its machine code, so the executable store keeps
    the bytes JAX's cache held instead: a program JAX's cache already had (after an upgrade, an edit elsewhere) is
    then stored too, and a later start skips its tracing and lowering. This reads through JAX internals
    (`jax._src.compilation_cache`); where they are not as expected nothing is recorded, and such executables are
    not stored."""

    _lock = threading.Lock()
    _installed = False
    _thread = threading.local()  # recording: this thread records; read: the bytes it loaded last (None: none)

    @classmethod
    def install(cls) -> None:
        """Wrap JAX's persistent-cache read once per process."""
        with cls._lock:
            if cls._installed:
                return
            cls._installed = True
            try:
                from jax._src import compilation_cache as cache
                read, get_cache = cache.get_executable_and_time, cache._get_cache
                decompress, extract = cache.decompress_executable, cache.extract_executable_and_time
            except (ImportError, AttributeError):
                return

            def recording_read(cache_key, compile_options, backend, executable_devices):
                executable, compile_time = read(cache_key, compile_options, backend, executable_devices)
                if executable is not None and getattr(cls._thread, "recording", False):
                    try:  # (never fails jax's read: at worst the executable is not stored)
                        entry = get_cache(backend).get(cache_key)
                        cls._thread.read = extract(decompress(entry))[0] if entry is not None else None
                    except Exception:
                        cls._thread.read = None
                return executable, compile_time

            cache.get_executable_and_time = recording_read

    @classmethod
    def compile(cls, lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, bytes | None]:
        """`lowered.compile()`, and the serialized executable JAX's persistent cache gave it (None: none)."""
        cls.install()
        cls._thread.recording, cls._thread.read = True, None
        try:
            executable = lowered.compile()
            return executable, cls._thread.read
        finally:
            cls._thread.recording, cls._thread.read = False, None


# Executables of this process by what they were traced from (`Runner.trace_key`, the step function, the shapes,
# dtypes and shardings of its arguments): an engine built like an earlier one (a benchmark comparing scheduler
# options, the tests) takes its executables instead of tracing and compiling them again. An entry holds an
# executable only (no params, no pages); past SHARED_EXECUTABLES the least recently used go. On the CPU fewer
# (SHARED_CPU_EXECUTABLES): each executable of XLA's CPU backend maps its machine code in ~200 pieces and a process
# may hold 65530 mappings (Linux's default vm.max_map_count), so 512 kept executables (~100,000) would crash XLA in a
# process that builds many engines one after another, such as a benchmark sweep on the CPU.
SHARED_EXECUTABLES = 512
SHARED_CPU_EXECUTABLES = 160
_shared_executables: collections.OrderedDict[tuple, jax.stages.Compiled] = collections.OrderedDict()
_shared_lock = threading.Lock()
_store: list[ExecutableStore | None] = [None]  # on disk, for later processes (use_executable_store)


def use_executable_store(cache_dir: str | None) -> ExecutableStore | None:
    """Keep executables on disk inside the compilation cache folder `cache_dir` too (None or empty: in memory
    only)."""
    folder = os.path.join(cache_dir, FOLDER_NAME) if cache_dir else None
    if _store[0] is None or _store[0].folder != folder:
        _store[0] = open_store(cache_dir)
    return _store[0]


def shared_executable(key: tuple) -> jax.stages.Compiled | None:
    """The process's executable under `key` (from the executable store when an earlier process stored it), or
    None."""
    with _shared_lock:
        if key in _shared_executables:
            _shared_executables.move_to_end(key)
            return _shared_executables[key]
    executable = _store[0].load(key) if _store[0] is not None else None
    if executable is not None:
        _remember(key, executable)
    return executable


def compile_here(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, bool, bytes | None]:
    """Compile `lowered`; also whether the executable can be stored, and the bytes to store it by when it came from
    JAX's persistent cache (None: serialize the executable). Storable: XLA compiled it in this call, or JAX's cache
    gave it and its bytes were recorded (CacheReads); and it calls back into no Python (a host callback, such as a
    Pallas kernel in interpret mode, cannot be serialized: XLA crashes trying)."""
    CompileCounter.install()
    hits = CompileCounter.thread_cache_hits()
    executable, cached = CacheReads.compile(lowered)
    compile_args = getattr(getattr(lowered, "_lowering", None), "compile_args", {})
    loads = CompileCounter.thread_cache_hits() - hits
    storable = (loads == 0 or (loads == 1 and cached is not None)) and compile_args.get("host_callbacks", True) == []
    return executable, storable, cached


def share_executable(key: tuple, executable: jax.stages.Compiled, storable: bool, cached: bytes | None = None) -> None:
    """Keep `executable` under `key` for later engines of this process, and in the executable store when it is
    `storable` (by the bytes JAX's cache held, `cached`, where given: compile_here)."""
    _remember(key, executable)
    if _store[0] is not None and storable:
        _store[0].save(key, executable, cached)


def _remember(key: tuple, executable: jax.stages.Compiled) -> None:
    """Keep `executable` under `key` in memory (the shared_capacity() most recently used)."""
    capacity = shared_capacity()
    with _shared_lock:
        _shared_executables[key] = executable
        while len(_shared_executables) > capacity:
            _shared_executables.popitem(last=False)


def shared_capacity() -> int:
    """How many executables the process keeps for later engines: SHARED_CPU_EXECUTABLES on XLA's CPU backend,
    SHARED_EXECUTABLES on an accelerator."""
    return SHARED_CPU_EXECUTABLES if jax.default_backend() == "cpu" else SHARED_EXECUTABLES


def clear_shared_executables() -> None:
    """Forget every shared executable, so those no engine holds are freed (a test worker near the limit of memory
    mappings, a benchmark that compares compiling with loading)."""
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
        futures = {pool.submit(compile_here, low): target for target, low in lowered}
        for future in concurrent.futures.as_completed(futures):
            table, key, shared_key = futures[future]
            table[key], storable, cached = future.result()
            share_executable(shared_key, table[key], storable, cached)
            bar.update()
    except BaseException:  # a failed compile or a KeyboardInterrupt: drop the compiles queued, wait for none
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        bar.close()
    pool.shutdown()


def enable_compilation_cache(cache_dir: str | None) -> None:
    """Turn on JAX's persistent compilation cache and jaxserve's executable store in `cache_dir`, so a restart
    skips compilation (and, for the step buckets, tracing and lowering)."""
    use_executable_store(cache_dir)
    if not cache_dir:
        return
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
