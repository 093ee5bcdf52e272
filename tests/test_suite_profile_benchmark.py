"""benchmarks/suite_profile.py: the per-file seconds it reads from pytest's --durations report, and the JAX events
its plugin counts."""

import collections

import jax
import numpy as np

from benchmarks import suite_profile


def test_durations_are_summed_per_file():
    report = ("12.50s setup    tests/test_a.py::test_x\n 1.25s call     tests/test_a.py::test_x[p-1]\n"
              "0.25s teardown tests/test_b.py::test_y\n2.00s call     benchmarks/other.py::test_z\n")
    assert suite_profile.file_durations(report) == {"test_a.py": 13.75, "test_b.py": 0.25}


def test_the_plugin_counts_a_compile_against_the_current_file(monkeypatch):
    monkeypatch.setattr(suite_profile, "_counts", collections.defaultdict(collections.Counter))
    monkeypatch.setattr(suite_profile, "_current_file", ["test_here.py"])
    jax.monitoring.register_event_duration_secs_listener(suite_profile._on_duration)
    try:
        jax.jit(lambda x: x * 3 + 1).lower(np.zeros((7, 5), np.float32)).compile()  # one program
    finally:
        jax.monitoring.unregister_event_duration_listener(suite_profile._on_duration)
    counts = suite_profile._counts["test_here.py"]  # (twice as many under suite_profile: its listener is on too)
    assert counts["backend_compile_duration:count"] in (1, 2) and counts["backend_compile_duration"] > 0
    assert counts["jaxpr_to_mlir_module_duration:count"] in (1, 2)
