"""A step's context (plan, work folder, soft deadline) and the results the steps keep, one JSON file per
step in the work folder. No jax here: the end-to-end step's parent process and the summary never start
a device backend (on a GPU that would take most of its memory away from the child)."""

from __future__ import annotations

import dataclasses
import json
import os
import time

from benchmarks.gpu.config import Plan

STATUS_FILE = "steps.jsonl"  # gpu_check.sh appends one line per step: number, name, exit status, seconds


@dataclasses.dataclass
class Step:
    """One step's run: the plan, where results go, and when to stop starting new work."""

    plan: Plan
    work_dir: str
    deadline: float  # time.monotonic() after which the step starts no new measurement
    seed: int = 0

    def out_of_time(self) -> bool:
        """True once the step's soft deadline has passed."""
        return time.monotonic() > self.deadline

    def load(self, name: str) -> dict | None:
        """An earlier step's saved result, or None when it saved none."""
        return load_result(self.work_dir, name)

    def save_partial(self, name: str, result: dict) -> None:
        """Save what a step has measured so far (failed until the step saves its final result), so a step
        the shell's hard limit kills still leaves its finished measurements to the summary."""
        save_result(self.work_dir, name, {**result, "ok": False, "summary": f"killed early; {result['summary']}"})

    def copy_gbps(self) -> float | None:
        """The device-to-device copy bandwidth step 4 measured (its best variant), or None."""
        return (self.load("bandwidth") or {}).get("gb_per_s")


def error_text(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, cut to `limit` characters."""
    message = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {message[0][:limit] if message else ''}"


def result_path(work_dir: str, name: str) -> str:
    """Where step `name` keeps its result."""
    return os.path.join(work_dir, f"{name}.json")


def save_result(work_dir: str, name: str, result: dict) -> None:
    """Write a step's result as JSON."""
    with open(result_path(work_dir, name), "w") as f:
        json.dump(result, f, indent=1, default=str)


def load_result(work_dir: str, name: str) -> dict | None:
    """A saved step result, or None."""
    try:
        with open(result_path(work_dir, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_statuses(work_dir: str) -> list[dict]:
    """The shell's record of every step it ran or skipped, in order."""
    try:
        with open(os.path.join(work_dir, STATUS_FILE)) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []
