#!/usr/bin/env bash
# GPU check of the Pallas kernels: correctness against the references, then the decode microbenchmark.
#
# With the device tool (one lent H200; its image has jax with CUDA, no installs needed or possible):
#     run  command="bash benchmarks/gpu_check.sh"  timeout_s=540
# Expected to take about 3-5 minutes; hard limits below keep it under ~530 s even if something
# hangs: the checks get 120 s, the benchmark 380 s, and starts no new shape after 330 s. The
# benchmark's table is the last thing printed (the tool returns only the tail of the output);
# the whole log, kernels_bench.json and kernels_bench.md are written under $OUT and come back.
# Locally (any CUDA machine with jax): bash benchmarks/gpu_check.sh; results then go to /tmp.
# Exit status: non-zero when a correctness check failed or the benchmark did not finish.
set -euo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
LOG_DIR="${OUT:-/tmp}"

main() {
    echo "== $(date -u +%FT%TZ) $(hostname) in $(pwd)"
    echo "== nvidia-smi"
    nvidia-smi -L || echo "nvidia-smi -L failed"
    local fields=name,driver_version,memory.total,memory.used,utilization.gpu,temperature.gpu
    fields+=,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit
    nvidia-smi --format=csv --query-gpu="$fields" || echo "nvidia-smi query failed"
    echo "== jax"
    "$PY" -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__); print(jax.devices())'

    echo "== correctness: benchmarks/kernels.py --check"
    local check_rc=0
    timeout --kill-after=10 120 "$PY" benchmarks/kernels.py --check || check_rc=$?
    if [ "$check_rc" -ne 0 ]; then
        echo "== CHECK FAILED (exit $check_rc; 124 = timed out): the timings below may be of wrong kernels"
    else
        echo "== checks passed"
    fi

    echo "== microbenchmark: benchmarks/kernels.py (default grid)"
    local bench_rc=0
    timeout --kill-after=10 380 "$PY" benchmarks/kernels.py --time-budget-s 330 || bench_rc=$?
    if [ "$bench_rc" -ne 0 ]; then
        echo "== BENCHMARK FAILED (exit $bench_rc; 124 = timed out); checks exit $check_rc"
        return "$bench_rc"
    fi
    return "$check_rc"
}

mkdir -p "$LOG_DIR"
main 2>&1 | tee "$LOG_DIR/gpu_check.log"
