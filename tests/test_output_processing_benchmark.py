"""benchmarks/output_processing.py runs every output kind and reports a time for each (its numbers are in
docs/benchmarks.md; here only that it runs and measures what it says)."""

from benchmarks.output_processing import main


def test_the_output_processing_benchmark_times_every_kind_after_each_length():
    results = main(["--rows", "4", "--after", "0", "3", "--steps", "3", "--repeats", "2"])
    kinds = ("cumulative", "delta", "final_only")
    assert [(r["kind"], r["after"]) for r in results] == [(kind, after) for kind in kinds for after in (0, 3)]
    assert all(len(r["runs_ms"]) == 2 and r["best_ms"] == min(r["runs_ms"]) > 0 for r in results)
