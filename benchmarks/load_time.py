"""Weight loading time: a Hugging Face folder against the same model converted to an orbax checkpoint (issue 16).

    PYTHONPATH=. python benchmarks/load_time.py [--model-shape llama-small] [--repeats 5] [--quantization int8]

Converts the model (`jaxserve convert`, into a temporary folder), then times `model/checkpoint.load_weights` (the
engine's weight loading alone: no compilation, no KV pool) for each source, alternating the order, with a warm-up
load of each first. Prints the mean and best seconds of each and their ratio, as a markdown table; then the bytes
the process reads (Linux's /proc/self/io) restoring the orbax folder at tensor parallelism 1 and 2 (two virtual
CPU devices), against the size of its files: each shard should be read once.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # TP 2 on the CPU

import jax  # noqa: E402

from jaxserve.bench.models import SHAPE_NAMES, ensure_model  # noqa: E402
from jaxserve.config import VALID_QUANTIZATIONS, EngineConfig  # noqa: E402
from jaxserve.model.checkpoint import convert, load_weights  # noqa: E402
from jaxserve.model.quantize import weight_bytes  # noqa: E402
from jaxserve.sharding import cache_kv_heads, make_mesh  # noqa: E402
from jaxserve.model.registry import load_model_spec  # noqa: E402


def timed_load(folder: str, quantization: str, tensor_parallel_size: int = 1) -> tuple[float, int]:
    """(seconds to load the folder's weights onto the devices and wait for them, their bytes)."""
    config = EngineConfig(model=folder, quantization=quantization, tensor_parallel_size=tensor_parallel_size)
    spec = load_model_spec(folder)
    start = time.perf_counter()
    params, _ = load_weights(config, folder, spec, make_mesh(tensor_parallel_size),
                             cache_kv_heads(spec, tensor_parallel_size))
    jax.block_until_ready(params)
    return time.perf_counter() - start, weight_bytes(params)


def bytes_read(folder: str, tensor_parallel_size: int) -> int:
    """Bytes this process reads (read() calls, /proc/self/io `rchar`) loading `folder` at a tensor parallelism,
    after a first load that compiles."""
    timed_load(folder, "none", tensor_parallel_size)

    def rchar() -> int:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar"))

    before = rchar()
    timed_load(folder, "none", tensor_parallel_size)
    return rchar() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", choices=SHAPE_NAMES, default="llama-small")
    parser.add_argument("--cache-dir", default="/tmp/jaxserve-bench")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quantization", choices=VALID_QUANTIZATIONS, default="none",
                        help="quantize at load (Hugging Face) and at conversion (orbax)")
    args = parser.parse_args()
    source = ensure_model(args.model_shape, args.cache_dir)
    with tempfile.TemporaryDirectory() as scratch:
        converted = os.path.join(scratch, "converted")
        start = time.perf_counter()
        convert(source, converted, quantization=args.quantization)
        convert_s = time.perf_counter() - start
        sides = {"hugging face": (source, args.quantization), "orbax": (converted, "none")}
        seconds = {name: [] for name in sides}
        sizes = {}
        for name, (folder, mode) in sides.items():  # warm-up
            sizes[name] = timed_load(folder, mode)[1]
        for round_index in range(args.repeats):
            for name in (list(sides) if round_index % 2 == 0 else list(sides)[::-1]):
                seconds[name].append(timed_load(*sides[name])[0])
        files = sum(os.path.getsize(os.path.join(root, name)) for root, _, names in
                    os.walk(os.path.join(converted, "params")) for name in names)
        reads = {tp: bytes_read(converted, tp) for tp in (1, 2)}
    print(f"{args.model_shape} ({source}), quantization {args.quantization}; conversion took {convert_s:.2f}s")
    print("| source | weights MiB | mean s | best s | runs (s) |")
    print("|---|---:|---:|---:|---|")
    for name, runs in seconds.items():
        print(f"| {name} | {sizes[name] / 2**20:.1f} | {sum(runs) / len(runs):.3f} | {min(runs):.3f} | "
              f"{', '.join(f'{s:.3f}' for s in runs)} |")
    hf, orbax = seconds["hugging face"], seconds["orbax"]
    print(f"\norbax / hugging face: {sum(orbax) / sum(hf):.2f}x mean, {min(orbax) / min(hf):.2f}x best")
    print(f"orbax restore reads {reads[1] / 2**20:.2f} MiB at TP 1 and {reads[2] / 2**20:.2f} MiB at TP 2; its files "
          f"hold {files / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
