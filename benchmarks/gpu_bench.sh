#!/usr/bin/env bash
# `jaxserve bench` for a Llama-3.1-8B shape with random weights (made on the device: load_format dummy) on one
# H200: the offline table (continuous batching with paging against static batching with reservation, at one
# KV budget) and an online sweep of four request rates against a launched `jaxserve serve`.
#
# With the device tool (its image has jax with CUDA, transformers, tokenizers, httpx, tqdm, matplotlib, but
# not fastapi/uvicorn/pydantic, which the server needs):
#     bash benchmarks/gpu_wheels.sh                                   # here, once: those as wheels in .whl/
#     run  carry=[".whl"]  command="bash benchmarks/gpu_bench.sh"  timeout_s=540
# Hard limits keep it under ~8 minutes: the offline run gets 270 s, the online run 200 s. Without .whl/ the
# online run is skipped with a message. Results (logs, JSON, PNGs) go to $OUT (or /tmp/gpu_bench).
# Not yet run on an H200: no device was lent to the session that wrote it.
set -euo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-/tmp/gpu_bench}"
CACHE=/tmp/jaxserve-bench  # model folder (config + tokenizer) and the shared XLA compilation cache
mkdir -p "$OUT_DIR"

# One KV budget for both offline systems: 2048 pages of 16 tokens (4 GiB of bfloat16 KV for this shape).
# Static batching reserves max_model_len = 2048 tokens (128 pages) per sequence, so 16 sequences fit it.
ENGINE=(--max-model-len 2048 --page-size 16 --max-num-seqs 256 --max-num-batched-tokens 2048 --min-token-bucket 64
        --compilation-cache-dir "$CACHE/xla-cache")
WORKLOAD=(--num-requests 512 --input-len-dist uniform --input-len-range 32 1024 --output-len-dist lognormal
          --output-len 128 --output-len-range 16 1024 --seed 0)

main() {
    echo "== $(date -u +%FT%TZ) $(hostname)"
    nvidia-smi -L || true
    "$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())'

    echo "== offline: jaxserve bench throughput (Llama-3.1-8B shape, dummy weights)"
    local offline_rc=0
    timeout --kill-after=10 270 "$PY" -m jaxserve bench throughput --model-shape llama-3.1-8b \
        --cache-dir "$CACHE" --systems jaxserve jaxserve-static "${ENGINE[@]}" --num-pages 2049 "${WORKLOAD[@]}" \
        --repeats 2 --warmup-requests 16 --json "$OUT_DIR/offline.json" --plot-dir "$OUT_DIR" \
        || offline_rc=$?
    echo "== offline exit $offline_rc (124 = timed out)"

    if [ -d .whl ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
    fi
    if ! "$PY" -c 'import fastapi, uvicorn, pydantic' 2>/dev/null; then
        echo "== online skipped: fastapi/uvicorn/pydantic missing (run benchmarks/gpu_wheels.sh and carry .whl)"
        return "$offline_rc"
    fi
    local folder
    folder=$("$PY" -c "from jaxserve.bench.models import ensure_model; print(ensure_model('llama-3.1-8b', '$CACHE'))")
    echo "== online: jaxserve bench serve --launch, rates 8 16 32 inf"
    local online_rc=0
    timeout --kill-after=10 200 "$PY" -m jaxserve bench serve --launch --launch-timeout 150 \
        --server-args "--model $folder --load-format dummy ${ENGINE[*]} --gpu-memory-utilization 0.85" \
        --request-rate 8 16 32 inf --num-requests 200 "${WORKLOAD[@]:2}" --no-progress \
        --slo-ttft 500 --slo-tpot 50 --json "$OUT_DIR/online.json" --plot-dir "$OUT_DIR" || online_rc=$?
    echo "== online exit $online_rc (124 = timed out)"
    [ "$offline_rc" -eq 0 ] && return "$online_rc" || return "$offline_rc"
}

main 2>&1 | tee "$OUT_DIR/gpu_bench.log"
