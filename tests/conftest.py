"""Test setup: CPU only, four simulated devices for tensor-parallel tests, shared engine helpers."""

import os
from unittest import mock

from helpers import FAST_COMPILE_XLA_FLAG  # (helpers imports no jax: the flags below still take effect)

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4 "
                           + FAST_COMPILE_XLA_FLAG)

import pytest  # noqa: E402

API_KEY = "test-key"
# The files that take 12 s or more on a 2-core machine (pytest --durations=0, the mean of two warm runs on
# 2026-12-06), longest first: xdist hands whole files to its two workers in collection order, so these go first and
# the short ones fill in after them, and the workers finish together instead of one running a long file alone at the
# end.
SLOW_FILES = ("test_engine_vs_hf.py", "test_check_config.py", "test_gpu_check_script.py",
              "test_structured_output.py", "test_spec_eagle.py", "test_bench_effects.py",
              "test_engine_core_process.py", "test_first_hour_messages.py", "test_ragged_paged_attention_kernel.py",
              "test_scheduler.py", "test_int4_checkpoint.py", "test_async_and_multistep.py", "test_tpu_attention.py",
              "test_deepseek.py", "test_background_compile.py", "test_quantization.py", "test_multihost.py",
              "test_tensor_parallel.py", "test_fp8_kv_cache.py", "test_reasoning.py", "test_swap_preemption.py",
              "test_spec_draft_model.py", "test_doc_examples.py", "test_interrupt.py", "test_server_fuzz.py",
              "test_gptq_checkpoint.py", "test_vllm_client.py", "test_server_generation_fields.py",
              "test_beam_search.py", "test_data_parallel.py", "test_lora.py", "test_paged_decode_attention.py",
              "test_weight_update.py", "test_xla_attention.py", "test_serving_capacity_benchmark.py",
              "test_fp8_block_checkpoint.py", "test_embeddings.py", "test_spec_decode.py",
              "test_prefix_cache_engine.py", "test_monitoring_dashboard.py", "test_sleep_mode.py",
              "test_model_loading.py", "test_bench_offline.py", "test_wheel_install.py", "test_mxfp4_checkpoint.py",
              "test_responses_api.py", "test_harmony.py")


def pytest_collection_modifyitems(items):
    """Run SLOW_FILES first, longest first; every file's own tests keep their order."""
    rank = {name: index for index, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# A worker keeps the shared step executables (the 160 most recently used on the CPU: runner/executables.py) from one
# test file to the next, for the next files' engines of equal shapes (a sampler bucket is shared by every engine of
# one vocabulary and ladder), unless it then holds more than MAX_KEPT_MAPPINGS memory mappings: each executable of
# XLA's CPU backend holds ~200 mappings of its machine code, and a process may hold 65530 (Linux's default
# vm.max_map_count). Ten engine files in a row in one process: 81.6 s keeping none, 72.2 s keeping 160 (at most
# 28,600 mappings after a file).
MAX_KEPT_MAPPINGS = 40_000


@pytest.fixture(scope="session", autouse=True)
def each_files_garbage_collected_alone():
    """Python's cyclic collector in a worker: everything alive at the end of a test file is frozen (`gc.freeze`), so
    the next file's collections walk only what that file makes. An engine's start-up collects everything and freezes
    it (engine/host_gc.py: once per process in production); a worker builds ~150 engines, each such collection
    walked every object the worker held (~1 s), and each file's end had to unfreeze them all to free its engines and
    walk them again: 70-75 s of a worker's 260-300 s of CPU went to the collector (2026-12-07). Here engines do not
    freeze (the helper's own test is tests/test_host_gc.py); a file's end collects its garbage and freezes the rest."""
    import gc
    import importlib

    from jaxserve.engine import core_client, llm_engine

    importlib.import_module("hypothesis")  # first: its plugins' hooks look for referrers, which frozen objects hide

    gc.collect()
    gc.freeze()  # the imports: never garbage
    with mock.patch.object(llm_engine, "freeze_start_up_objects", lambda: None), \
            mock.patch.object(core_client, "freeze_start_up_objects", lambda: None):
        yield


@pytest.fixture(scope="module", autouse=True)
def release_executables_after_each_file(each_files_garbage_collected_alone):
    """Free the compiled executables a test file leaves behind once its engines are gone, but the shared ones: each
    holds memory mappings of its machine code, and a worker that kept every file's (JAX's jit caches) passed the
    kernel's default limit of 65530 mappings per process (vm.max_map_count) and crashed in XLA. Later files load
    the others from the persistent compilation cache. The file's garbage is collected; what is left is frozen
    (see each_files_garbage_collected_alone), unless the worker holds too many mappings: then everything is
    collected."""
    yield
    import gc

    import jax

    from jaxserve.runner.executables import clear_shared_executables

    jax.clear_caches()
    _forget_fastapi_endpoints()
    gc.collect()  # the file's objects: the older ones are frozen
    if _memory_mappings() > MAX_KEPT_MAPPINGS:
        clear_shared_executables()
        gc.unfreeze()  # and anything older that only the executables kept
        gc.collect()
    gc.freeze()


def _memory_mappings() -> int:
    """How many memory mappings this process holds (0 where /proc does not say)."""
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


def _forget_fastapi_endpoints():
    """Empty FastAPI's module-level caches of endpoint callables (`functools.lru_cache`s of up to 4096 entries in
    fastapi.dependencies.models): they keep every app's bound route methods, so every test server's serving
    objects and LLMEngine, with its executables' memory mappings, would live to the end of the worker."""
    import sys

    models = sys.modules.get("fastapi.dependencies.models")
    for value in vars(models).values() if models else ():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


@pytest.fixture(scope="session", autouse=True)
def children_without_torch():
    """The Python processes the tests start (servers, engine-core processes, commands) import jaxserve as an install
    without the bench extra does, torch hidden (helpers.NO_TORCH): about 3 s less each. This process has started
    already and keeps torch; a test whose child needs it sets the child's PYTHONPATH itself."""
    from helpers import pythonpath_without_torch

    os.environ["PYTHONPATH"] = pythonpath_without_torch(*filter(None, [os.environ.get("PYTHONPATH")]))
    yield


@pytest.fixture(scope="session")
def openai_server():
    """A real uvicorn server on the bundled model (small buckets), shared by the server tests.

    Yields (base URL, the LLMEngine behind it). Every /v1 route needs `Bearer test-key`.
    """
    from helpers import running_server, small_engine_args

    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.server.app import build_app
    from jaxserve.server.config import ServerConfig

    options = small_engine_args(min_token_bucket=16)  # decodes in 16-token steps: many tests generate hundreds
    options.pop("show_progress")
    engine = LLMEngine(EngineConfig.for_model(None, **options), show_progress=False)
    config = ServerConfig(api_key=API_KEY, max_n=4, max_body_bytes=64 * 1024, max_prompts=4)
    with running_server(build_app(engine, config)) as url:
        yield url, engine
