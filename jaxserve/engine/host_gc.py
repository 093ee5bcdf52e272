"""Python's cyclic garbage collector, tuned for the engine's step loop and a front end's output loop.

A step at hundreds of rows allocates thousands of container objects (scheduled chunks, samples, outputs), so with
CPython's default first-generation threshold (700 allocations) the collector ran several times a step, and each
time the survivors it promoted brought the older generations' full scans (the prefix cache's records, the engine's
own state) closer: 1.4-1.5 ms of a 10 ms host step at 512 rows, with pauses of 15-30 ms every 20-60 steps
(benchmarks/host_step.py, docs/benchmarks.md). Collecting the first generation every ENGINE_FIRST_THRESHOLD
allocations instead took it to under 0.1 ms a step. Reference counting still frees every object that is not in a
cycle at once; only cyclic garbage waits a little longer.

An engine-core process's front end (engine/core_client.py: detokenizing, outputs, SSE) allocates as much per token
and ran under CPython's defaults: at 512 streams over a runner with no device time, collections took about a third of
its time, and its CPU per token fell from 43.8 to 30.1 us (means of four rounds) once it was tuned too
(docs/benchmarks.md).
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger("jaxserve")

CPYTHON_FIRST_THRESHOLD = 700  # CPython's default first-generation threshold
ENGINE_FIRST_THRESHOLD = 20_000


def tune_garbage_collector() -> bool:
    """Raise the collector's first-generation threshold to ENGINE_FIRST_THRESHOLD, unless the process already set
    its own (then leave it); True when this changed it."""
    first, *older = gc.get_threshold()
    if first != CPYTHON_FIRST_THRESHOLD:
        return False
    gc.set_threshold(ENGINE_FIRST_THRESHOLD, *older)
    logger.debug("garbage collector: first-generation threshold %d -> %d", first, ENGINE_FIRST_THRESHOLD)
    return True


def freeze_start_up_objects() -> None:
    """Collect once, then move every object alive now out of the collector's reach (`gc.freeze`): start-up leaves
    hundreds of thousands of long-lived objects (jax, transformers, executables, the web app), and a full collection
    that walked them all paused a running engine for ~0.3 s."""
    gc.collect()
    gc.freeze()
