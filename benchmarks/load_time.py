"""Weight loading time: a Hugging Face folder against the same model converted to an orbax checkpoint (issue 16).

    PYTHONPATH=. python benchmarks/load_time.py [--model-shape llama-small] [--repeats 5] [--quantization int8]

Converts the model (`jaxserve convert`, into a temporary folder), then times `model/checkpoint.load_weights` (the
engine's weight loading alone: no compilation, no KV pool) for each source, alternating the order, with a warm-up
load of each first. Prints the mean and best seconds of each and their ratio, as a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import jax  # noqa: E402

from jaxserve.bench.models import SHAPE_NAMES, ensure_model  # noqa: E402
from jaxserve.config import VALID_QUANTIZATIONS, EngineConfig  # noqa: E402
from jaxserve.model.checkpoint import convert, load_weights  # noqa: E402
from jaxserve.model.quantize import weight_bytes  # noqa: E402
from jaxserve.model.sharding import cache_kv_heads, make_mesh  # noqa: E402
from jaxserve.model.spec import ModelSpec  # noqa: E402


def timed_load(folder: str, quantization: str) -> tuple[float, int]:
    """(seconds to load the folder's weights onto the device and wait for them, their bytes)."""
    config = EngineConfig(model=folder, quantization=quantization)
    spec = ModelSpec.from_pretrained(folder)
    start = time.perf_counter()
    params, _ = load_weights(config, folder, spec, make_mesh(1), cache_kv_heads(spec, 1))
    jax.block_until_ready(params)
    return time.perf_counter() - start, weight_bytes(params)


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
    print(f"{args.model_shape} ({source}), quantization {args.quantization}; conversion took {convert_s:.2f}s")
    print("| source | weights MiB | mean s | best s | runs (s) |")
    print("|---|---:|---:|---:|---|")
    for name, runs in seconds.items():
        print(f"| {name} | {sizes[name] / 2**20:.1f} | {sum(runs) / len(runs):.3f} | {min(runs):.3f} | "
              f"{', '.join(f'{s:.3f}' for s in runs)} |")
    hf, orbax = seconds["hugging face"], seconds["orbax"]
    print(f"\norbax / hugging face: {sum(orbax) / sum(hf):.2f}x mean, {min(orbax) / min(hf):.2f}x best")


if __name__ == "__main__":
    main()
