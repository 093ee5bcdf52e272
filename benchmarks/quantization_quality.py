"""Quality of quantized weights and an fp8 KV cache against the float model, teacher-forced (issue 16).

    PYTHONPATH=. python benchmarks/quantization_quality.py             # the bundled model and two test checkpoints

For each model and mode (int8 or fp8 weights, an fp8 KV cache with scale 1.0 or calibrated scales, fp8 weights
and KV together, and the model written as a block-wise fp8 checkpoint, Qwen3-FP8's form, or as an int4 W4A16
checkpoint, compressed-tensors' form, symmetric or asymmetric (a zero point per group, W4A16_ASYM), or as an 8-bit
GPTQ checkpoint (symmetric, Qwen's GPTQ-Int8 form), each served as stored: blocks or groups of 128, or of the
largest power of
two dividing a smaller model's shapes), the next-token distribution at
every position of a fixed prompt set (`bench/quality.py`: the bundled model gets six 100-token pieces of
jaxserve's scheduler source, a test checkpoint its expected.json prompts) against the unquantized float32
model's: top-1 agreement and the mean and largest KL divergence, and the bytes of the linear layers and of a KV
page against bfloat16. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import jax.numpy as jnp  # noqa: E402

from jaxserve.bench.quality import (  # noqa: E402
    compare_distributions,
    next_token_logprobs,
    scoring_runner,
    source_prompts,
)
from jaxserve.bench.quantized_checkpoint import (  # noqa: E402
    write_fp8_block_checkpoint,
    write_gptq_checkpoint,
    write_int4_checkpoint,
)
from jaxserve.engine.llm_engine import default_model_path  # noqa: E402
from jaxserve.model.quantize import leaf_at, weight_bytes  # noqa: E402
from jaxserve.model.registry import quantizable_paths  # noqa: E402

MODES = {  # mode -> scoring_runner options
    "int8": {"quantization": "int8"}, "fp8": {"quantization": "fp8"},
    "fp8 KV (scale 1)": {"kv_cache_dtype": "fp8"},
    "fp8 KV (calibrated)": {"kv_cache_dtype": "fp8", "calculate_kv_scales": True},
    "fp8 + fp8 KV (scale 1)": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}
CHECKPOINTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures",
                           "checkpoints")


def prompts_for(model: str) -> list[list[int]]:
    """The test checkpoint's expected.json prompts, or else pieces of jaxserve's source."""
    fixture = os.path.join(model, "expected.json")
    if os.path.isfile(fixture):
        with open(fixture) as f:
            return json.load(f)["prompts"]
    return source_prompts(model, 6, 100)


def checkpoint_runners(model: str, spec, folder: str) -> list[tuple]:
    """(each mode's name, its options, a scoring runner of `model` written into a folder under `folder` as a
    block-wise fp8 checkpoint, as int4 ones, symmetric and asymmetric, and as an 8-bit GPTQ one)."""
    size = math.gcd(128, spec.hidden_size, spec.intermediate_size, spec.num_heads * spec.head_dim)
    write_fp8_block_checkpoint(model, os.path.join(folder, "fp8"), (size, size))
    write_int4_checkpoint(model, os.path.join(folder, "int4"), size)
    write_int4_checkpoint(model, os.path.join(folder, "int4-asym"), size, symmetric=False)
    write_gptq_checkpoint(model, os.path.join(folder, "gptq-int8"), size, bits=8)
    return [(f"fp8 checkpoint, {size}x{size} blocks", {"quantization": "fp8"},
             scoring_runner(os.path.join(folder, "fp8"))),
            (f"int4 checkpoint (W4A16), groups of {size}", {"quantization": "int4"},
             scoring_runner(os.path.join(folder, "int4"))),
            (f"int4 checkpoint (W4A16_ASYM), groups of {size}", {"quantization": "int4"},
             scoring_runner(os.path.join(folder, "int4-asym"))),
            (f"GPTQ checkpoint, 8 bits, groups of {size}", {"quantization": "int8"},
             scoring_runner(os.path.join(folder, "gptq-int8")))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", help="model folders (default: bundled, test llama, test qwen3)")
    args = parser.parse_args()
    models = args.models or [default_model_path(), os.path.join(CHECKPOINTS, "llama"),
                             os.path.join(CHECKPOINTS, "qwen3")]
    print("| model | mode | positions | top-1 agreement | mean KL (nats) | max KL | linear layers vs bf16 "
          "| KV page vs bf16 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for model in models:
        prompts = prompts_for(model)
        reference_runner = scoring_runner(model)
        reference = next_token_logprobs(reference_runner, prompts)
        paths = quantizable_paths(reference_runner.spec)
        linear = {path: leaf_at(reference_runner.params, path) for path in paths}
        bf16_bytes = sum(leaf.size * jnp.dtype(jnp.bfloat16).itemsize for leaf in linear.values())
        def report(mode: str, options: dict, runner) -> None:
            quality = compare_distributions(reference, next_token_logprobs(runner, prompts))
            quantized = weight_bytes([leaf_at(runner.params, path) for path in paths])
            linear_share = f"{quantized / bf16_bytes:.3f}" if "quantization" in options else "-"
            kv_share = runner.cache_structs(1)[0].dtype.itemsize / jnp.dtype(jnp.bfloat16).itemsize
            print(f"| {os.path.basename(os.path.normpath(model))} | {mode} | {quality['positions']} | "
                  f"{quality['top1_agreement']:.1%} | {quality['mean_kl']:.2e} | {quality['max_kl']:.2e} | "
                  f"{linear_share} | {kv_share if 'kv_cache_dtype' in options else '-'} |", flush=True)

        for mode, options in MODES.items():
            report(mode, options, scoring_runner(model, **options))
        with tempfile.TemporaryDirectory() as folder:
            for mode, options, runner in checkpoint_runners(model, reference_runner.spec, folder):
                report(mode, options, runner)

if __name__ == "__main__":
    main()
