"""Correctness checks of the Pallas kernels against their references (step 3 of benchmarks/gpu_check.sh).

    PYTHONPATH=. python benchmarks/kernels.py --check                # on a GPU; exit 1 on any failure
    PYTHONPATH=. python benchmarks/kernels.py --check --interpret    # on the CPU, in the Pallas interpreter
    PYTHONPATH=. python benchmarks/kernels.py --check --only "kv write bfloat16"   # one check, by its name

What the checks do is in benchmarks/gpu/checks.py. The measurements (copy and decode bandwidth,
the fallback, prefill, the KV write, an end-to-end run) are the other steps of
benchmarks/gpu_check.sh, one module each in benchmarks/gpu/.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import jax  # noqa: E402

from benchmarks.gpu.checks import check_names, run_checks  # noqa: E402


def main() -> None:
    """Parse the options and run the checks; exit 1 when one fails, 2 on a usage error or with no GPU to run on."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", required=True,
                        help="run the correctness checks (the benchmarks are benchmarks/gpu_check.sh's steps)")
    parser.add_argument("--interpret", action="store_true", help="Pallas interpreter on the CPU")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only the checks of these names")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    unknown = sorted(set(args.only or ()) - set(check_names()))
    if unknown:
        parser.error(f"no check named {unknown}; the checks: {check_names()}")
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}", flush=True)
    if jax.default_backend() == "cpu" and not args.interpret:
        print("no GPU here: the compiled (Triton) kernels need one; use --interpret on the CPU")
        sys.exit(2)
    rows = run_checks(args.seed, args.interpret, tuple(args.only) if args.only else None)
    failures = sum(not row["ok"] for row in rows)
    print(f"checks: {len(rows) - failures} passed, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
