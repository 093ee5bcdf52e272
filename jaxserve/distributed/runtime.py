"""Joining JAX's distributed runtime: one process per host, every process's devices in one global mesh.

Process 0 runs the coordinator (`jax.distributed.initialize`'s) and leads: it alone schedules, tokenizes and
serves HTTP. A start-up that cannot complete (a coordinator nobody answers at, a process that never comes) ends
with a message saying what to fix instead of JAX's abort trace.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import sys
import threading
import time

import jax
from jax._src import distributed as jax_distributed

logger = logging.getLogger("jaxserve")
# Exit status of a process whose distributed start-up did not complete in time.
EXIT_START_FAILED = 3
# Extra seconds JAX's own start-up deadline gets past ours, so ours (with its message) always fires first.
JAX_DEADLINE_MARGIN_S = 30


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """This process's place in a multi-host launch."""

    process_id: int
    num_processes: int
    coordinator_host: str  # process 0's host, as every process reaches it

    @property
    def is_leader(self) -> bool:
        """Process 0 schedules, tokenizes and serves; the others follow its steps."""
        return self.process_id == 0


_joined: tuple[tuple, ProcessGroup] | None = None  # (launch arguments, group) once this process has joined
_before_leaving: list = []  # what runs at exit before this process leaves the runtime (the leader's STOP)


def before_leaving(callback) -> None:
    """Run `callback()` at exit, before this process leaves the distributed runtime."""
    _before_leaving.append(callback)


def _leave() -> None:
    """At exit: the callbacks, then JAX's shutdown (every process meets at its barrier)."""
    for callback in _before_leaving:
        callback()
    jax.distributed.shutdown()


def join(coordinator: str | None, num_processes: int, process_id: int, timeout_s: float) -> ProcessGroup | None:
    """Start JAX's distributed runtime for these launch arguments (`coordinator` HOST:PORT, or "auto" for what a
    cluster launcher set), before anything uses a device; None for a one-process engine. A process joins once:
    later engines of the same launch reuse it, other launch arguments are a ValueError."""
    global _joined
    if coordinator is None:
        return None
    arguments = (coordinator, num_processes, process_id)
    if _joined is not None:
        if _joined[0] != arguments:
            raise ValueError(f"this process already joined a distributed launch as {_joined[0]}; one process "
                             f"cannot join another ({arguments})")
        return _joined[1]
    if coordinator != "auto" and process_id > 0:
        wait_for_coordinator(coordinator, timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices of several processes
    deadline = _StartDeadline(timeout_s, process_id, num_processes, coordinator)
    try:
        if coordinator == "auto":
            jax.distributed.initialize(initialization_timeout=int(timeout_s) + JAX_DEADLINE_MARGIN_S,
                                       shutdown_timeout_seconds=int(timeout_s))
            coordinator = jax_distributed.global_state.coordinator_address
        else:
            jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                                       initialization_timeout=int(timeout_s) + JAX_DEADLINE_MARGIN_S,
                                       shutdown_timeout_seconds=int(timeout_s))
        group = ProcessGroup(jax.process_index(), jax.process_count(), coordinator.rpartition(":")[0])
    finally:
        deadline.cancel()
    logger.info("process %d of %d joined (coordinator %s): %d local and %d global devices", group.process_id,
                group.num_processes, coordinator, jax.local_device_count(), jax.device_count())
    _joined = (arguments, group)
    atexit.register(_leave)
    return group


def wait_for_coordinator(coordinator: str, timeout_s: float) -> None:
    """Return once something accepts connections at `coordinator` (HOST:PORT); ValueError after `timeout_s`."""
    host, _, port = coordinator.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise ValueError(f"cannot reach the coordinator at {coordinator} within {timeout_s:g} s ({error}): "
                                 f"start process 0 there first, and check the address and port") from error
            time.sleep(0.2)


class _StartDeadline:
    """Ends the process with a clear message if the distributed start-up has not completed in `timeout_s` (JAX
    itself would abort later with a trace that names neither cause)."""

    def __init__(self, timeout_s: float, process_id: int, num_processes: int, coordinator: str):
        message = (f"process {process_id}: the {num_processes} processes did not all join the coordinator at "
                   f"{coordinator} within {timeout_s:g} s: start every process with the same "
                   f"--distributed-coordinator and --num-processes, each with its own --process-id")
        self._timer = threading.Timer(timeout_s, self._expire, args=(message,))
        self._timer.daemon = True
        self._timer.start()

    @staticmethod
    def _expire(message: str) -> None:
        logger.error(message)
        print(f"jaxserve: error: {message}", file=sys.stderr, flush=True)
        os._exit(EXIT_START_FAILED)

    def cancel(self) -> None:
        self._timer.cancel()


def check_mesh_spans_processes(tensor_parallel_size: int, group: ProcessGroup) -> None:
    """ValueError unless a tensor-parallel mesh of this size holds every device of every process, equally (each
    process must hold a share of every sharded array and run every collective)."""
    local, total = jax.local_device_count(), jax.device_count()
    if total != local * group.num_processes:
        raise ValueError(f"the {group.num_processes} processes hold {total} devices, not {local} each: give every "
                         f"process as many devices")
    if tensor_parallel_size != total:
        raise ValueError(f"a multi-host mesh spans every process's devices: tensor_parallel_size must be {total} "
                         f"({group.num_processes} processes x {local} devices), got {tensor_parallel_size}")


# How long processes wait for each other to finish starting (loading and compiling, which a follower does without
# the leader's persistent cache); a process that dies meanwhile is noticed through the step channel.
START_BARRIER_TIMEOUT_S = 3600


def barrier(name: str, timeout_s: float = START_BARRIER_TIMEOUT_S) -> None:
    """Wait until every process reaches the barrier `name` (JAX's coordination service, not a device collective:
    CPU collectives give a late peer only 30 s)."""
    jax_distributed.global_state.client.wait_at_barrier(f"jaxserve/{name}", int(timeout_s * 1000))


def agreed_minimum(name: str, value: int, group: ProcessGroup, timeout_s: float = START_BARRIER_TIMEOUT_S) -> int:
    """The smallest `value` any process of the launch has (each publishes its own in the key-value store)."""
    client = jax_distributed.global_state.client
    client.key_value_set(f"jaxserve/{name}/{group.process_id}", str(value))
    return min(int(client.blocking_key_value_get(f"jaxserve/{name}/{process}", int(timeout_s * 1000)))
               for process in range(group.num_processes))
