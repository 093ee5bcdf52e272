#!/usr/bin/env bash
# One prepared H200 check (issue 12, part 6): the Pallas kernels, the fallback attention path and the engine,
# under 8 minutes, ending with a decision about the Triton kernels.
#
# With the device tool (one lent H200; its image has jax with CUDA, no installs needed):
#     run  command="bash benchmarks/gpu_check.sh"  timeout_s=540
# On the CPU, the same steps at tiny sizes in Pallas interpret mode (tests/test_gpu_check_script.py runs this):
#     GPU_CHECK_TINY=1 bash benchmarks/gpu_check.sh
#
# Steps, each `python -m benchmarks.gpu STEP` (benchmarks/gpu/STEP.py) in its own process under a hard `timeout`,
# printing its measurements as it makes them and a `RESULT STEP: OK|FAIL ...` line, so a step that hangs or
# crashes costs only its own limit and the earlier results stay in the log:
#    1 env        jax, jaxlib, CUDA, cuDNN, nvidia-smi, the exact text of JAX's Pallas Triton deprecation warning
#    2 compiles   the three kernels at Llama-3.1-8B shapes (32/8 heads, head dim 128, bf16), pages of 16 and 8
#    3 checks     the kernels against their references on NaN-poisoned pools
#    4 bandwidth  device-to-device copy bandwidth: the best of several `x + 1` variants (each printed)
#    5 decode     decode kernel bandwidth and share of copy, B {8, 64} x ctx {2k, 8k, 32k}, splits, warps/stages,
#                 pages per loop step
#    6 fallback   the engine's `xla` attention backend against the Pallas one on decode, B {8, 64} x ctx {2k, 8k}
#    7 prefill    the ragged kernel on 4 x 512-token chunks (0 and 2k cached) in TFLOP/s, against cuDNN causal
#    8 kv_write   the KV write kernel for T {64, 2048} tokens
#    9 fp8        a whole decode step at the 8B shape (random weights, B 64 x ctx 2k): bf16, fp8 weights, and fp8
#                 weights with an fp8 KV cache (issue 16)
#   10 e2e        `jaxserve bench throughput`, Llama-3.1-8B shape, random weights, 1000 in / 1000 out tokens,
#                 for what is left of the budget
#   11 summary    a compact table and the DECISION line; gpu_check.json and gpu_check.md
# Budget: GPU_CHECK_BUDGET_S seconds in all (default 450); each step gets its own cap or what the budget leaves
# after SUMMARY_RESERVE_S for the summary, whichever is less (the end-to-end run: all that is left).
# GPU_CHECK_STEPS="env decode ..." runs only the steps it names (for a lease with little device time left).
# Output: the whole log (gpu_check.log), gpu_check.json, gpu_check.md and e2e_bench.json under $OUT (else
# /tmp/gpu_check). Exit status 0 when every step succeeded, else 1 (the summary's table says which did not).
set -uo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-/tmp/gpu_check}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-450}"
SUMMARY_RESERVE_S=20
MODE=()
PLAN="the H200 plan"
if [ "${GPU_CHECK_TINY:-0}" = 1 ]; then
    export JAX_PLATFORMS=cpu
    MODE=(--tiny)
    PLAN="the tiny plan, on the CPU in Pallas interpret mode"
fi
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
START=$SECONDS
FAILED=0

# record NUMBER NAME EXIT SECONDS [WHY_SKIPPED]: one line of $WORK/steps.jsonl for the summary
record() {
    local skipped=null
    [ -n "${5:-}" ] && skipped="\"$5\""
    printf '{"number": %d, "name": "%s", "rc": %d, "seconds": %d, "skipped": %s}\n' "$1" "$2" "$3" "$4" "$skipped" \
        >> "$WORK/steps.jsonl"
}

# run_step NUMBER NAME CAP_S: `python -m benchmarks.gpu NAME` under min(CAP_S, what the budget leaves)
run_step() {
    local number=$1 name=$2 cap=$3
    if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ " $GPU_CHECK_STEPS " != *" $name "* ]]; then
        echo "== [$number/11] $name: SKIPPED (not in GPU_CHECK_STEPS)"
        record "$number" "$name" 0 0 "not in GPU_CHECK_STEPS"
        return
    fi
    local left=$((BUDGET_S - (SECONDS - START) - SUMMARY_RESERVE_S))
    local limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 10 ]; then
        echo "== [$number/11] $name: SKIPPED (time budget spent)"
        record "$number" "$name" 0 0 "time budget spent"
        FAILED=1
        return
    fi
    echo "== [$number/11] $name (limit $limit s; $((SECONDS - START)) s elapsed)"
    local began=$SECONDS rc=0 state
    timeout --kill-after=5 "$limit" "$PY" -m benchmarks.gpu "$name" ${MODE[@]+"${MODE[@]}"} --work-dir "$WORK" \
        --limit-s "$limit" || rc=$?
    case $rc in
        0) state=ok ;;
        124) state="TIMED OUT" ;;
        137) state="KILLED" ;;
        *) state="FAILED (exit $rc)" ;;
    esac
    echo "-- [$number/11] $name: $state in $((SECONDS - began)) s"
    record "$number" "$name" "$rc" "$((SECONDS - began))"
    [ "$rc" -eq 0 ] || FAILED=1
}

main() {
    echo "== $(date -u +%FT%TZ) $(hostname): GPU check, $PLAN, budget $BUDGET_S s"
    run_step 1 env 60
    run_step 2 compiles 90
    run_step 3 checks 90
    run_step 4 bandwidth 60
    run_step 5 decode 150
    run_step 6 fallback 75
    run_step 7 prefill 60
    run_step 8 kv_write 40
    run_step 9 fp8 90
    run_step 10 e2e "$BUDGET_S"
    echo "== [11/11] summary ($((SECONDS - START)) s elapsed)"
    if [ -f "$WORK/e2e_bench.json" ]; then cp "$WORK/e2e_bench.json" "$OUT_DIR/"; fi
    timeout --kill-after=5 "$SUMMARY_RESERVE_S" "$PY" -m benchmarks.gpu summary ${MODE[@]+"${MODE[@]}"} \
        --work-dir "$WORK" --out-dir "$OUT_DIR" || { echo "-- [11/11] summary: FAILED"; FAILED=1; }
    echo "== done in $((SECONDS - START)) s"
    rm -rf "$WORK"
    return "$FAILED"
}

mkdir -p "$OUT_DIR"
main 2>&1 | tee "$OUT_DIR/gpu_check.log"
