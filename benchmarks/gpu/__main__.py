"""`python -m benchmarks.gpu STEP --work-dir DIR --limit-s S [--tiny]`: one step of benchmarks/gpu_check.sh.

The step prints its measurements as it makes them, then one line `RESULT <step>: OK|FAIL <summary>`,
and saves its result as DIR/<step>.json for the later steps and the summary. It stops starting new
measurements shortly before `--limit-s` (the shell's hard `timeout` is the same limit). Exit status
1 when the step failed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback

from benchmarks.gpu.config import STEP_NAMES, plan_for
from benchmarks.gpu.step import Step, error_text, save_result

MARGIN_S, MARGIN_SHARE = 5.0, 0.1  # the soft deadline: this much (the larger) before the hard limit


def main() -> None:
    """Run one step and save its result."""
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=STEP_NAMES + ("summary",))
    parser.add_argument("--work-dir", required=True, help="where the steps keep their results")
    parser.add_argument("--limit-s", type=float, default=600.0, help="the step's hard time limit")
    parser.add_argument("--tiny", action="store_true", help="the tiny CPU plan (Pallas interpret mode)")
    parser.add_argument("--out-dir", help="summary: where gpu_check.json and gpu_check.md go")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    plan = plan_for(args.tiny)
    if args.step == "summary":
        from benchmarks.gpu import summary

        sys.exit(summary.run(plan, args.work_dir, args.out_dir))
    deadline = started + args.limit_s - max(MARGIN_S, MARGIN_SHARE * args.limit_s)
    step = Step(plan=plan, work_dir=args.work_dir, deadline=deadline, seed=args.seed)
    try:
        result = importlib.import_module(f"benchmarks.gpu.{args.step}").run(step)
    except Exception as exc:  # noqa: BLE001 - report the failure as the step's result
        traceback.print_exc(limit=-8)
        result = {"ok": False, "summary": f"raised {error_text(exc)}"}
    result["seconds"] = time.monotonic() - started
    save_result(args.work_dir, args.step, result)
    print(f"RESULT {args.step}: {'OK' if result['ok'] else 'FAIL'} {result['summary']}", flush=True)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
