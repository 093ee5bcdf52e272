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


def test_programs_that_differ_in_a_shape_are_distinct(monkeypatch):
    monkeypatch.setattr(suite_profile, "_programs", [])
    monkeypatch.setattr(suite_profile, "_current_file", ["test_here.py"])
    from jax._src import compiler

    monkeypatch.setattr(compiler, "compile_or_get_cached", compiler.compile_or_get_cached)  # undone after the test
    suite_profile._record_programs()

    def twice_plus_one(x):
        return x * 2 + 1

    for shape in ((3, 4), (3, 4), (5, 4)):  # the second is jit's own cache: no compile
        jax.jit(twice_plus_one)(np.zeros(shape, np.float32))
    programs = suite_profile._programs
    assert [p["type"] for p in programs] == ["(tensor<3x4xf32>) -> tensor<3x4xf32>",
                                             "(tensor<5x4xf32>) -> tensor<5x4xf32>"]
    assert {p["module"] for p in programs} == {"jit_twice_plus_one"} and programs[0]["digest"] != programs[1]["digest"]
    table = suite_profile.repeated_programs(programs, top=5)
    assert "| jit_twice_plus_one | 2 | 2 |" in table and "test_here.py 2" in table
