"""gpu_memory_utilization as vLLM means it: the share of the whole device memory for weights, the largest
step's activations and the KV pool, which gets what is left (jaxserve/kv/sizing.py)."""

import logging
import os

import pytest
from helpers import small_engine_args

from jaxserve import LLM
from jaxserve.engine import sizing as engine_sizing
from jaxserve.kv import sizing
from jaxserve.kv.sizing import GIB, check_allocator_limit, device_memory_bytes, plan_kv_pages, reserve_device_memory


def test_the_pool_gets_what_the_weights_and_activations_leave():
    plan = plan_kv_pages(device_bytes=100 * GIB, utilization=0.9, used_bytes=16 * GIB, activation_bytes=2 * GIB,
                         page_bytes=2 * 2**20)
    assert plan.num_pages == (90 - 16 - 2) * 512
    assert plan.kv_bytes == 72 * GIB
    line = plan.describe()
    for part in ("100.0 GiB", "0.9", "16.00 GiB", "2.00 GiB", "72.00 GiB", f"{plan.num_pages} pages"):
        assert part in line


def test_nothing_left_is_an_error_that_says_what_to_change():
    with pytest.raises(ValueError, match="raise gpu_memory_utilization, lower max_num_batched_tokens"):
        plan_kv_pages(device_bytes=80 * GIB, utilization=0.2, used_bytes=15 * GIB, activation_bytes=GIB,
                      page_bytes=2**20)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            plan_kv_pages(100 * GIB, bad, 0, 0, 2**20)


def test_device_memory_undoes_the_gpu_allocator_fraction(monkeypatch):
    monkeypatch.setenv(sizing.MEM_FRACTION_ENV, "0.5")
    assert device_memory_bytes({"bytes_limit": 40 * GIB}, "gpu") == 80 * GIB
    assert device_memory_bytes({"bytes_limit": 16 * GIB}, "tpu") == 16 * GIB
    with pytest.raises(ValueError, match="set num_pages"):
        device_memory_bytes({}, "gpu")
    monkeypatch.delenv(sizing.MEM_FRACTION_ENV)
    assert device_memory_bytes({"bytes_limit": 60 * GIB}, "gpu") == 80 * GIB  # JAX's default 0.75


def test_a_utilization_above_the_allocator_fraction_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(sizing.MEM_FRACTION_ENV, "0.75")
    check_allocator_limit({"bytes_limit": 60 * GIB}, 0.75)
    with pytest.raises(ValueError, match="XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 before JAX starts"):
        check_allocator_limit({"bytes_limit": 60 * GIB}, 0.9)


def test_the_allocator_fraction_is_raised_only_before_jax_starts(monkeypatch):
    import jax
    from jax._src import xla_bridge

    jax.devices()  # JAX has started in this process: too late to change its allocator, nothing is set
    monkeypatch.delenv(sizing.MEM_FRACTION_ENV, raising=False)
    reserve_device_memory(0.9)
    assert sizing.MEM_FRACTION_ENV not in os.environ
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    reserve_device_memory(0.9)
    assert os.environ[sizing.MEM_FRACTION_ENV] == "0.9"
    monkeypatch.setenv(sizing.MEM_FRACTION_ENV, "0.6")  # the user's own setting wins
    reserve_device_memory(0.9)
    assert os.environ[sizing.MEM_FRACTION_ENV] == "0.6"


def test_an_engine_on_an_accelerator_sizes_its_pool_from_memory_analysis(monkeypatch, caplog):
    """On a (pretended) TPU with 64 MiB of memory, the pool is what 0.5 of it leaves after what is in use
    and the largest step's activations, measured by XLA's memory analysis of the compiled step."""
    device_bytes, in_use = 64 * 2**20, 3 * 2**20
    monkeypatch.setattr(engine_sizing, "device_platform", lambda: "tpu")
    monkeypatch.setattr(engine_sizing, "device_memory_stats",
                        lambda num_devices: {"bytes_limit": device_bytes, "bytes_in_use": in_use})
    args = small_engine_args(gpu_memory_utilization=0.5, max_model_len=32, max_num_batched_tokens=16, max_num_seqs=4)
    args.pop("num_pages")
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        llm = LLM(**args)
    core = llm.engine.core
    activations = core.runner.peak_activation_bytes(3)
    assert activations > 0
    per_page = core.runner.kv_caches[0].nbytes * len(core.runner.kv_caches) // core.num_pages
    left = 0.5 * device_bytes - in_use - activations
    assert core.num_pages == int(left // per_page)
    assert any("KV cache sizing" in record.getMessage() and f"{core.num_pages} pages" in record.getMessage()
               for record in caplog.records)
