"""Benchmark and device-check scripts (a package, so `python -m benchmarks.gpu STEP` runs one GPU-check step)."""
