"""StepTiming: where the host's time goes in each engine step, and how long the device sat idle.

The host phases are timed with time.perf_counter(). The device is not observed directly: a helper
thread of the runner notes when each dispatched step's outputs are computed (PendingStep.ready), and
the device counts as busy from a step's dispatch (or the end of the step before it, if later) until
then. Without a profiler this is the overlap's measure: with synchronous scheduling the device idles
while the host schedules, builds and processes outputs; with asynchronous scheduling it should not.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import time

# The host's work in one step ("send": an engine-core process's messages to its front ends)
PHASES = ("schedule", "swap", "build", "dispatch", "wait", "update", "output", "send")


class StepTiming:
    """Host seconds per phase of the step loop, and the device's busy seconds."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Start counting afresh (between benchmark runs, with no step in flight)."""
        # "step": a whole EngineCore.step(); "propose": a speculative proposer's share of "schedule"
        self.seconds = dict.fromkeys(PHASES + ("step", "propose"), 0.0)
        self.num_steps = 0  # dispatched steps
        self.device_busy_s = 0.0
        self._last_ready = 0.0  # perf_counter time the last folded step's outputs were computed
        self._unfolded: collections.deque[tuple[float, concurrent.futures.Future]] = collections.deque()

    @contextlib.contextmanager
    def measure(self, phase: str):
        """Add the time spent inside the block to `phase`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def dispatched(self, started: float, ready: concurrent.futures.Future) -> None:
        """Note a step dispatched at perf_counter time `started`, whose `ready` resolves to the time its
        outputs were computed."""
        self.num_steps += 1
        self._unfolded.append((started, ready))
        self._fold()

    def _fold(self) -> None:
        """Add the busy time of every step whose outputs are computed, in dispatch order."""
        while self._unfolded and self._unfolded[0][1].done():
            started, ready_future = self._unfolded.popleft()
            ready = ready_future.result()
            self.device_busy_s += max(0.0, ready - max(started, self._last_ready))
            self._last_ready = max(ready, self._last_ready)

    def summary(self) -> dict:
        """Mean host milliseconds per dispatched step for each phase, the wall seconds of the step loop
        (engine steps plus output processing), and the fraction of it the device was idle."""
        self._fold()
        steps = max(self.num_steps, 1)
        wall = self.seconds["step"] + self.seconds["output"]
        idle = min(1.0, max(0.0, 1.0 - self.device_busy_s / wall)) if wall else 0.0
        return {"steps": self.num_steps,
                **{f"{phase}_ms": 1e3 * self.seconds[phase] / steps for phase in PHASES + ("propose",)},
                "wall_s": wall, "device_busy_s": self.device_busy_s, "device_idle_fraction": idle}
