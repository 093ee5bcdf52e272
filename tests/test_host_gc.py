"""The engine's garbage-collector tuning (engine/host_gc.py): raised from CPython's default, a process's own kept;
the objects alive after start-up frozen."""

import gc
import weakref

import pytest

from jaxserve.engine.host_gc import (
    CPYTHON_FIRST_THRESHOLD,
    ENGINE_FIRST_THRESHOLD,
    freeze_start_up_objects,
    tune_garbage_collector,
)


@pytest.fixture
def thresholds():
    """Restore the process's thresholds after the test."""
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


def test_default_threshold_is_raised_older_generations_kept(thresholds):
    gc.set_threshold(CPYTHON_FIRST_THRESHOLD, 7, 9)
    assert tune_garbage_collector()
    assert gc.get_threshold() == (ENGINE_FIRST_THRESHOLD, 7, 9)
    assert not tune_garbage_collector()  # already tuned: nothing to do


def test_a_threshold_the_process_chose_is_kept(thresholds):
    gc.set_threshold(1234, 10, 10)
    assert not tune_garbage_collector()
    assert gc.get_threshold() == (1234, 10, 10)


def test_the_objects_alive_at_the_end_of_start_up_are_frozen_and_garbage_is_collected_first():
    class Cycle:
        pass

    garbage, kept = Cycle(), Cycle()
    garbage.self = garbage  # only the collector frees a cycle
    collected = weakref.ref(garbage)
    del garbage
    gc.unfreeze()
    try:
        freeze_start_up_objects()
        assert collected() is None  # collected, not frozen
        assert gc.get_freeze_count() > 0
        assert all(o is not kept for o in gc.get_objects())  # frozen: outside every generation the collector walks
    finally:
        gc.unfreeze()
