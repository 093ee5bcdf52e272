"""runner/executable_store.py: step executables kept on disk by the runner's own key, so that a later process skips
tracing, lowering and compiling them; only in a private folder, and never a wrong program for a key."""

import functools
import logging
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from helpers import small_engine_args
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve import LLM, SamplingParams
from jaxserve.runner import executable_store, executables
from jaxserve.runner.executable_store import ExecutableStore, open_store, stable_description


def _scaled(x, factor, offset):
    return x * factor + offset


def _compiled(shape=(3, 4), factor=2.0):
    """An executable of `_scaled` for float32 `shape`, compiled here (a factor no other test run compiled, so not
    one from the persistent cache), and its shared key."""
    offset = float(np.random.default_rng().integers(1, 2**20))  # exact in float32
    function = jax.jit(functools.partial(_scaled, factor=factor, offset=offset))
    args = (jax.ShapeDtypeStruct(shape, np.float32),)
    compiled, storable, cached = executables.compile_here(function.lower(*args))
    assert storable and cached is None
    return compiled, ("test", "_scaled", factor, offset, executables.abstract_arguments(args))


def test_meshes_on_other_devices_are_other_keys():
    devices = jax.devices()
    first, second = (Mesh(np.array(devices[i:i + 2]), ("model",)) for i in (0, 2))
    assert repr(first) == repr(second)  # (the reason for stable_description: a mesh's repr leaves its devices out)
    assert stable_description(first) != stable_description(second)
    spec = PartitionSpec("model")
    assert stable_description(NamedSharding(first, spec)) != stable_description(NamedSharding(second, spec))


def test_large_arrays_that_print_alike_are_other_keys():
    first, second = np.zeros(2000, np.int32), np.zeros(2000, np.int32)
    second[1000] = 1
    assert repr(first) == repr(second)  # (numpy elides the middle)
    assert stable_description(first) != stable_description(second)
    assert stable_description(first) == stable_description(np.zeros(2000, np.int32))


def test_closures_and_lambdas_have_no_stable_description():
    def outer(n):
        return lambda x: x + n

    with pytest.raises(ValueError, match="no stable description"):
        stable_description((1, outer(1)))
    with pytest.raises(ValueError, match="no stable description"):
        stable_description(outer)  # defined in a function: <locals>

    class Local:
        pass

    with pytest.raises(ValueError, match="no stable description"):
        stable_description(Local)
    assert stable_description(Mesh) == ("class", Mesh.__module__, "Mesh")
    assert stable_description(np.mean) == ("function", "numpy", "mean")


def test_an_executable_comes_back_from_another_store_and_computes_the_same(tmp_path):
    compiled, key = _compiled()
    ExecutableStore(str(tmp_path)).save(key, compiled)
    later = ExecutableStore(str(tmp_path))  # (as a later process opens it)
    loaded = later.load(key)
    assert later.num_loaded == 1
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(np.asarray(loaded(x)), x * 2 + key[3])
    assert later.load(_compiled(factor=3.0)[1]) is None  # another captured value
    assert later.load(_compiled(shape=(5, 4))[1]) is None  # another shape


def test_a_torn_entry_is_compiled_instead(tmp_path, caplog):
    compiled, key = _compiled()
    store = ExecutableStore(str(tmp_path))
    store.save(key, compiled)
    (path,) = [entry.path for entry in os.scandir(tmp_path) if entry.name.endswith(".executable")]
    with open(path, "r+b") as f:
        f.truncate(100)
    with caplog.at_level(logging.WARNING):
        assert store.load(key) is None
    assert "could not load" in caplog.text and "compiling instead" in caplog.text


def test_a_store_that_cannot_write_warns_once_and_the_engine_goes_on(tmp_path, caplog):
    store = ExecutableStore(str(tmp_path / "store"))
    os.rmdir(store.folder)  # (removed meanwhile)
    with caplog.at_level(logging.WARNING):
        for factor in (1.0, 2.0):
            compiled, key = _compiled(factor=factor)
            store.save(key, compiled)
    assert store.num_saved == 0 and caplog.text.count("could not write") == 1


def test_a_folder_others_can_write_to_is_not_used(tmp_path, caplog):
    folder = tmp_path / "cache" / executable_store.FOLDER_NAME
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    with caplog.at_level(logging.WARNING):
        assert open_store(str(tmp_path / "cache")) is None
    assert "executable store off" in caplog.text and "not this user's alone" in caplog.text
    assert open_store(None) is None


def test_a_store_keeps_its_most_recent_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(executable_store, "MAX_ENTRIES", 2)
    store = ExecutableStore(str(tmp_path))
    keys = []
    for factor in (1.0, 2.0, 3.0):
        compiled, key = _compiled(factor=factor)
        store.save(key, compiled)
        keys.append(key)
        os.utime(store._path(key), (factor, factor))  # written in this order
    later = ExecutableStore(str(tmp_path))
    assert [later.load(key) is not None for key in keys] == [False, True, True]


def test_an_executable_from_the_persistent_cache_is_stored_by_the_bytes_it_was_loaded_from(tmp_path):
    """A program JAX's persistent cache already holds (after an upgrade of jaxserve, whose source is in the store's
    keys) is stored too, by the bytes JAX's cache held: XLA's CPU backend serializes a loaded executable again
    without its machine code (`Function ... not found` when that copy runs), so a later process runs the entry."""
    compile_twice = textwrap.dedent(f"""
        import os, jax, numpy as np
        from jaxserve.runner.executables import enable_compilation_cache
        from jaxserve.runner import executables
        enable_compilation_cache({str(tmp_path)!r})
        store = executables._store[0]
        key = ("test", "tanh", (8, 5))
        for attempt in range(2):
            jax.clear_caches()
            lowered = jax.jit(lambda x: jax.numpy.tanh(x[1:5, :3]) + x[:4, 2:5]).lower(np.zeros((8, 5), np.float32))
            compiled, storable, cached = executables.compile_here(lowered)
            executables.share_executable(key, compiled, storable, cached)
            print(storable, cached is not None, store.num_saved)
            if attempt == 0:
                os.remove(store._path(key))  # (the second compile finds the program only in JAX's cache)
    """)
    done = subprocess.run([sys.executable, "-c", compile_twice], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["True", "False", "1", "True", "True", "2"], done.stderr[-2000:]
    load_and_run = textwrap.dedent(f"""
        import numpy as np
        from jaxserve.runner.executables import enable_compilation_cache
        from jaxserve.runner import executables
        enable_compilation_cache({str(tmp_path)!r})
        compiled = executables.shared_executable(("test", "tanh", (8, 5)))
        x = np.arange(40, dtype=np.float32).reshape(8, 5)
        print(executables._store[0].num_loaded, np.allclose(compiled(x), np.tanh(x[1:5, :3]) + x[:4, 2:5]))
    """)
    done = subprocess.run([sys.executable, "-c", load_and_run], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["1", "True"], done.stderr[-2000:]


def test_an_executable_that_calls_back_into_python_is_not_stored():
    def doubled_on_the_host(x):
        return jax.pure_callback(lambda a: a * 2, jax.ShapeDtypeStruct((3,), np.float32), x) + 1

    lowered = jax.jit(doubled_on_the_host).lower(np.zeros(3, np.float32))
    assert executables.compile_here(lowered)[1] is False


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("store-cache"))


def test_a_second_engine_loads_every_bucket_and_generates_the_same(cache_dir):
    prompts = ["def fibonacci(n):", "hello there"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    executables.clear_shared_executables()  # none kept from an earlier file: the first engine compiles its own
    first = LLM(**small_engine_args(compilation_cache_dir=cache_dir, skip_precompile=False))
    stored = executables._store[0]
    assert stored.folder == os.path.join(cache_dir, executable_store.FOLDER_NAME) and stored.num_saved > 0
    expected = [o.outputs[0].token_ids for o in first.generate(prompts, params, use_tqdm=False)]
    num_buckets = first.engine.core.runner.num_executables()
    del first
    executables.clear_shared_executables()  # as in a new process: nothing in memory
    compiles = executables.CompileCounter.count()
    second = LLM(**small_engine_args(compilation_cache_dir=cache_dir, skip_precompile=False))
    assert executables._store[0].num_loaded == num_buckets
    assert [o.outputs[0].token_ids for o in second.generate(prompts, params, use_tqdm=False)] == expected
    runner = second.engine.core.runner
    assert runner.num_lazy_compiles == 0 and runner.num_executables() == num_buckets
    # none of the buckets compiled (what did is small eager work: the KV pool's zeros, the sampling state)
    assert executables.CompileCounter.count() - compiles < num_buckets


def test_an_engine_without_a_cache_folder_stores_nothing(cache_dir):
    LLM(**small_engine_args(compilation_cache_dir=None))
    assert executables._store[0] is None


def test_the_cpu_keeps_fewer_shared_executables_than_its_mapping_limit_allows():
    """Past SHARED_CPU_EXECUTABLES (on this CPU backend) the least recently used shared executables are dropped: 512
    of XLA's CPU executables would hold ~100,000 memory mappings, over Linux's default limit of 65530."""
    assert executables.shared_capacity() == executables.SHARED_CPU_EXECUTABLES < executables.SHARED_EXECUTABLES
    executables.clear_shared_executables()
    compiled, _ = _compiled()
    keys = [("capacity test", index) for index in range(executables.SHARED_CPU_EXECUTABLES + 3)]
    for key in keys:
        executables.share_executable(key, compiled, storable=False)
    assert list(executables._shared_executables) == keys[3:]
    executables.clear_shared_executables()
