#!/usr/bin/env bash
# Download (here, where pip reaches a registry) the server packages that the H200 image lacks, as Python 3.12
# wheels into .whl/, for benchmarks/gpu_bench.sh's online benchmark. The image already has jax, transformers,
# tokenizers, safetensors, prometheus-client, httpx, anyio, h11, click, uvloop and tqdm.
#     bash benchmarks/gpu_wheels.sh      # then: run carry=[".whl"] command="bash benchmarks/gpu_bench.sh"
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
packages=(fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection uvicorn
          opentelemetry-api)
for package in "${packages[@]}"; do
    version=$(python3 -m pip show "$package" 2>/dev/null | sed -n 's/^Version: //p')
    python3 -m pip download -q --no-warn-script-location --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$package${version:+==$version}"
done
du -sh .whl && ls .whl
