"""Ctrl-C ends a `jaxserve` command at once (jaxserve/console.py): while jax is imported, while XLA compiles on its
worker threads, and while the server streams a reply; one line, exit status 130, no traceback, nothing left."""

import pytest
from helpers import TEST_CACHE_DIR

from benchmarks.interrupt import measure

EXIT_BOUND_S = 5.0  # generous (measured: 0.01-0.13 s on a busy 2-core machine, docs/benchmarks.md)


@pytest.mark.parametrize("phase", ["import", "compile", "serve-streaming"])
def test_ctrl_c_ends_the_command_at_once(phase):
    run = measure(phase, TEST_CACHE_DIR)
    assert run["exit_code"] == 130, run["stderr_tail"]
    assert run["exit_s"] < EXIT_BOUND_S, run
    assert run["message"] and not run["traceback"], run["stderr_tail"]
