#!/usr/bin/env bash
# One prepared H200 check (issue 12, part 6; issue 46): the Pallas kernels, the fallback attention path, where an
# engine step's time goes, Hugging Face on the same GPU and the engine's throughput, under 8 minutes, ending with
# a decision about the Triton kernels.
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
#    4 bandwidth  device-to-device copy bandwidth: the best three ways of earlier runs (each printed)
#    5 decode     decode kernel bandwidth and share of copy, B {8, 64} x ctx {2k, 8k, 32k}, at its default settings
#                 (the best of the earlier sweeps); then cuDNN's paged attention (jax's) on the same shapes and pages,
#                 its time over the kernel's best (issue 46)
#    6 fallback   the engine's `xla` attention backend against the Pallas one on decode, B {8, 64} x ctx 8k
#    7 prefill    the ragged kernel on 4 x 512-token chunks (0 and 2k cached) in TFLOP/s, against cuDNN causal
#    8 kv_write   the KV write kernel for T {64, 2048} tokens
#    9 fp8        a whole decode step at the 8B shape (random weights, B 64 x ctx 2k): bf16, fp8 weights, and fp8
#                 weights with an fp8 KV cache (issue 16)
#   10 flags      the fp8 step's bf16 decode step again under XLA flag variants, each in its own process:
#                 dynamic-slice fusion on and off (does each layer's slice of the stacked weights cost a copy?) and
#                 command buffers (CUDA graphs) off; time against step 9's bf16 (issue 46). The tiny plan runs the
#                 first only (the CPU ignores the flags: the others would run the same code) and lists the others
#                 as not run
#   11 profile    where an 8B-shape engine step's time goes, by op, from a jax.profiler trace: a decode step of 128
#                 rows at ctx 1500 and a mixed one (the same rows plus a 512-token prompt chunk), forward, KV write
#                 and sampler; device time per category, the host gap, the top kernels (issue 46)
#   12 hf_peer    Hugging Face transformers on the same GPU, same shape and request shape: its continuous batching
#                 and `generate` in static batches, output tokens/s (issue 46)
#   13 e2e        `jaxserve bench throughput`, Llama-3.1-8B shape, random weights, 256 requests of 1000 in / 1000
#                 out tokens, 256 rows and 4096 tokens a step, for what is left of the budget
#   14 summary    a compact table, the headline figures and the DECISION line; gpu_check.json and gpu_check.md
# Budget: GPU_CHECK_BUDGET_S seconds in all (default 480); each step gets its own cap or what the budget leaves
# after SUMMARY_RESERVE_S for the summary and (while the end-to-end run is still to come) E2E_RESERVE_S for it,
# whichever is less (the end-to-end run: all that is left). Planned seconds on an H200, guessed from the 2026-12-04
# run's 411 s in all (its steps' own times were not kept; caps in brackets): env 6 [30], compiles 10 [60], checks
# 12 [60], bandwidth 5 [30], decode 30 [60], fallback 20 [45], prefill 10 [40], kv_write 5 [25], fp8 25 [60],
# flags 75 [75], profile 40 [75], hf_peer 90 [100], e2e about 150 (start-up 60-80, the timed run 50-90) [the rest], summary 2.
# GPU_CHECK_STEPS="env decode ..." runs only the steps it names (for a lease with little device time left).
# Output under $OUT (else /tmp/gpu_check): the whole log (gpu_check.log), gpu_check.json and gpu_check.md, their
# copies named for committing (gpu_check-<UTC date>-<device>.json and .md, device h200 / h100 / ...; cpu in the
# tiny plan), the profile's trace (profile.trace.json.gz) and e2e_bench.json when the end-to-end run wrote it.
# Exit status 0 when every step succeeded, else 1 (the summary's table says which did not).
set -uo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-/tmp/gpu_check}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-480}"
SUMMARY_RESERVE_S=20
E2E_RESERVE_S=150  # the end-to-end run's start-up (about a minute) and its timed run
NUM_STEPS=14
MODE=()
PLAN="the H200 plan"
if [ "${GPU_CHECK_TINY:-0}" = 1 ]; then
    export JAX_PLATFORMS=cpu
    MODE=(--tiny)
    PLAN="the tiny plan, on the CPU in Pallas interpret mode"
    E2E_RESERVE_S=30
fi
if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ " $GPU_CHECK_STEPS " != *" e2e "* ]]; then
    E2E_RESERVE_S=0  # no end-to-end run to keep time for
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

# run_step NUMBER NAME CAP_S [RESERVE_S]: `python -m benchmarks.gpu NAME` under min(CAP_S, what the budget leaves
# after RESERVE_S for the steps still to come)
run_step() {
    local number=$1 name=$2 cap=$3 reserve=${4:-0}
    if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ " $GPU_CHECK_STEPS " != *" $name "* ]]; then
        echo "== [$number/$NUM_STEPS] $name: SKIPPED (not in GPU_CHECK_STEPS)"
        record "$number" "$name" 0 0 "not in GPU_CHECK_STEPS"
        return
    fi
    local left=$((BUDGET_S - (SECONDS - START) - SUMMARY_RESERVE_S - reserve))
    local limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 10 ]; then
        echo "== [$number/$NUM_STEPS] $name: SKIPPED (time budget spent${reserve:+; $reserve s kept for later steps})"
        record "$number" "$name" 0 0 "time budget spent"
        FAILED=1
        return
    fi
    echo "== [$number/$NUM_STEPS] $name (limit $limit s; $((SECONDS - START)) s elapsed)"
    local began=$SECONDS rc=0 state
    timeout --kill-after=5 "$limit" "$PY" -m benchmarks.gpu "$name" ${MODE[@]+"${MODE[@]}"} --work-dir "$WORK" \
        --limit-s "$limit" || rc=$?
    case $rc in
        0) state=ok ;;
        124) state="TIMED OUT" ;;
        137) state="KILLED" ;;
        *) state="FAILED (exit $rc)" ;;
    esac
    echo "-- [$number/$NUM_STEPS] $name: $state in $((SECONDS - began)) s"
    record "$number" "$name" "$rc" "$((SECONDS - began))"
    [ "$rc" -eq 0 ] || FAILED=1
}

main() {
    echo "== $(date -u +%FT%TZ) $(hostname): GPU check, $PLAN, budget $BUDGET_S s"
    run_step 1 env 30 "$E2E_RESERVE_S"
    run_step 2 compiles 60 "$E2E_RESERVE_S"
    run_step 3 checks 60 "$E2E_RESERVE_S"
    run_step 4 bandwidth 30 "$E2E_RESERVE_S"
    run_step 5 decode 60 "$E2E_RESERVE_S"
    run_step 6 fallback 45 "$E2E_RESERVE_S"
    run_step 7 prefill 40 "$E2E_RESERVE_S"
    run_step 8 kv_write 25 "$E2E_RESERVE_S"
    run_step 9 fp8 60 "$E2E_RESERVE_S"
    run_step 10 flags 75 "$E2E_RESERVE_S"
    run_step 11 profile 75 "$E2E_RESERVE_S"
    run_step 12 hf_peer 100 "$E2E_RESERVE_S"
    run_step 13 e2e "$BUDGET_S"
    echo "== [$NUM_STEPS/$NUM_STEPS] summary ($((SECONDS - START)) s elapsed)"
    local kept
    for kept in e2e_bench.json profile.trace.json.gz; do
        if [ -f "$WORK/$kept" ]; then cp "$WORK/$kept" "$OUT_DIR/"; fi
    done
    timeout --kill-after=5 "$SUMMARY_RESERVE_S" "$PY" -m benchmarks.gpu summary ${MODE[@]+"${MODE[@]}"} \
        --work-dir "$WORK" --out-dir "$OUT_DIR" || { echo "-- [$NUM_STEPS/$NUM_STEPS] summary: FAILED"; FAILED=1; }
    echo "== done in $((SECONDS - START)) s"
    rm -rf "$WORK"
    return "$FAILED"
}

mkdir -p "$OUT_DIR"
main 2>&1 | tee "$OUT_DIR/gpu_check.log"
