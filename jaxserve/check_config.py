"""`jaxserve check-config`: check a config for a GPU (`cuda`) and a TPU on the CPU, with no accelerator and no
checkpoint.

For each config and target platform it
- resolves the model's architecture: the model folder's config.json, or, for a folder that is not here (the
  shipped configs name /models/...), the published config of the model the folder is named after;
- builds the weights abstractly (shapes, dtypes and shardings, no memory) on a CPU mesh of
  `tensor_parallel_size` simulated devices;
- takes the attention backend the engine would pick on that platform;
- lowers the engine's own step functions for every bucket (or the ladders' edges) with `jax.export` for that
  platform, naming each bucket that fails and its error;
- estimates one device's memory: the weights' shards (exact), the activations of the largest step (an
  estimate: XLA's memory analysis of the largest forward and sampler buckets compiled for the CPU with the
  `xla` attention path), and the KV pool `gpu_memory_utilization` leaves (kv/sizing.py), against the memory
  of a named device; with a draft model (speculative_config method draft_model) its weights, its pool of as
  many pages and its proposal buckets count too, as the engine counts them;
- estimates the start-up compile time: the CPU compile time of the largest bucket of each kind, scaled to
  the number of executables (serial; device compiles differ, and the engine compiles on a thread pool).

What lowering on the CPU cannot show: whether the device's compiler (ptxas, the TPU compiler) takes the
module, and any path chosen by probing the local machine at trace time. The cuDNN prefill of the `xla` path
on a GPU is one (JAX finds no cuDNN here, so the tiled path is lowered instead, with a warning; the kernels
column then shows no cuDNN call), and the TPU kernel's block sizes are another (untuned off a TPU, see
attention/tpu.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import re
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.export import DisabledSafetyCheck
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve.attention import fp8
from jaxserve.config import EAGLE_METHODS, VALID_ATTENTION_BACKENDS, EngineConfig
from jaxserve.config.engine import resolve_config_path, shipped_configs
from jaxserve.kv.cache_manager import pages_for_tokens
from jaxserve.kv.sizing import DEVICE_MEMORY_BYTES, GIB, MemoryPlan, plan_kv_pages
from jaxserve.model.registry import load_model_spec, spec_from_hf_config
from jaxserve.model_spec import ModelSpec

PLATFORMS = {"cuda": "gpu", "tpu": "tpu"}  # jax.export platform -> the platform name the attention package takes
DEFAULT_DEVICES = {"cuda": "h100", "tpu": "tpu-v5p"}  # when neither --device nor the config's file name names one
BUCKET_SETS = {  # --buckets: which buckets are lowered
    "all": "every bucket the engine compiles",
    "edges": "the smallest and largest rung of each ladder, and the token rungs either side of max_num_seqs",
    "largest": "the largest bucket of each kind (the quickest check that a config lowers and fits)",
}
# The order of Runner.shapes(), then a draft model's proposal buckets (DraftRunner.propose_call).
KINDS = ("forward", "sampler", "prompt_logprobs", "decode_steps", "verify_rows", "verify", "pooling", "draft")
# Custom calls jax.export does not promise to keep stable, which the step functions use on purpose: Pallas's
# Triton kernels and cuDNN attention. Any other one (a host callback, say) fails its bucket.
EXPECTED_UNSTABLE_CALLS = ("__gpu$xla.gpu.triton", "__cudnn$fmhaSoftmax", "__cudnn$fmhaScaleBiasSoftmax")
# The CPU compiler upcasts bf16 matmul operands to f32, and loop-invariant code motion hoists those converts of
# the stacked weights out of the layer loop (an f32 copy of every layer's weights: ~26 GiB of "activations" for
# an 8B model, which a GPU or TPU, multiplying bf16 natively, never makes). Off, for the activation estimate.
NO_HOISTING_FLAG = "--xla_disable_hlo_passes=while-loop-invariant-code-motion"
MIN_POOL_PAGES = 2  # the null page and one more: the pool of the CPU activation estimate (see cpu_estimates)

# config.json (+ generation_config.json's EOS ids) of the models the shipped configs name, as published on the
# Hugging Face Hub; keyed by the folder's lower-cased name.
_LLAMA_3_1 = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}
PUBLISHED_MODELS = {
    "llama-3.1-8b-instruct": {**_LLAMA_3_1, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                              "num_attention_heads": 32, "num_key_value_heads": 8},
    "llama-3.1-70b-instruct": {**_LLAMA_3_1, "hidden_size": 8192, "intermediate_size": 28672,
                               "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8},
    "llama-3.2-1b-instruct": {  # the draft model of llama-3.1-8b-1xh200-draft.yaml
        **_LLAMA_3_1, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
        "rope_scaling": {**_LLAMA_3_1["rope_scaling"], "factor": 32.0},
    },
    "qwen2.5-7b-instruct": {
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False, "use_sliding_window": False, "bos_token_id": 151643,
        "eos_token_id": [151645, 151643],  # generation_config.json's (config.json has 151645 alone)
    },
    "gpt-oss-20b": {  # its config.json, the experts served in bfloat16 (the release's MXFP4 dequantized at load)
        "architectures": ["GptOssForCausalLM"], "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128, "attention_bias": True,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "swiglu_limit": 7.0, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
        "torch_dtype": "bfloat16", "bos_token_id": 199998, "eos_token_id": 200002,
    },
}


# ---- results ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BucketCheck:
    """One bucket lowered for one platform."""

    kind: str  # one of KINDS
    # forward, decode_steps and draft (T, W), sampler and verify (R, P, M: token bitmask words), prompt_logprobs,
    # verify_rows and pooling (T,)
    shape: tuple[int, ...]
    seconds: float  # CPU seconds of jax.export (tracing and lowering)
    error: str | None = None  # "ErrorType: message" when it failed

    def describe(self) -> str:
        """The bucket, e.g. "forward (T=16, W=1)"."""
        names = {"forward": ("T", "W"), "sampler": ("R", "P", "M"), "prompt_logprobs": ("T",),
                 "decode_steps": ("T", "W"), "verify_rows": ("T",), "verify": ("R", "P", "M"),
                 "draft": ("T", "W")}[self.kind]
        return f"{self.kind} ({', '.join(f'{n}={v}' for n, v in zip(names, self.shape))})"


@dataclasses.dataclass
class PlatformCheck:
    """One config on one target platform."""

    platform: str  # cuda or tpu
    device: str  # a DEVICE_MEMORY_BYTES name
    backend: str | None  # the attention backend picked there (None when none could be)
    buckets: list[BucketCheck]
    custom_calls: list[str]  # custom-call targets in the lowered modules (the kernels), sorted
    memory: MemoryPlan | None  # None when the config does not fit the device (see `error`)
    error: str | None = None  # why no backend could be picked, or why the memory does not fit

    @property
    def failures(self) -> list[str]:
        """Every failure of this platform, one line each."""
        lines = [f"{self.platform}: {self.error}"] if self.error else []
        return lines + [f"{self.platform} {b.describe()}: {b.error}" for b in self.buckets if b.error]


@dataclasses.dataclass
class ConfigCheck:
    """One config on every target platform."""

    config: str  # the YAML file
    model_note: str  # where the architecture came from (and the draft model's)
    tensor_parallel_size: int
    page_size: int  # tokens per KV page
    executables: dict[str, int]  # kind -> buckets the engine compiles at start-up
    weight_bytes: int  # one device's shard of the weights, a draft model's included (exact)
    activation_bytes: int  # the largest step's peak on one device (estimate, CPU-compiled)
    compile_seconds: dict[str, float]  # kind -> CPU seconds of compiling one bucket for the CPU (measured)
    platforms: list[PlatformCheck]

    @property
    def name(self) -> str:
        """The config's file name without its extension."""
        return os.path.splitext(os.path.basename(self.config))[0]

    @property
    def compile_estimate_seconds(self) -> float:
        """Measured CPU compile seconds per kind times that kind's executable count, summed (serial)."""
        return sum(self.compile_seconds[kind] * self.executables[kind] for kind in KINDS)

    @property
    def failures(self) -> list[str]:
        """Every failure, one line each, prefixed with the config's name."""
        return [f"{self.name} {line}" for platform in self.platforms for line in platform.failures]

    def to_json(self) -> dict:
        """Everything, with the derived values, as plain JSON values."""
        return {**dataclasses.asdict(self), "name": self.name,
                "compile_estimate_seconds": self.compile_estimate_seconds,
                "kv_pool_bytes": {p.platform: p.memory.kv_bytes if p.memory else None for p in self.platforms}}


# ---- the process --------------------------------------------------------------------------------------------


def use_host_devices(count: int) -> None:
    """Run JAX on the CPU with `count` simulated devices and without the hoisting that inflates the CPU
    activation estimate (NO_HOISTING_FLAG); both must be set before JAX starts its backends. ValueError when
    it already has, without them."""
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count} {NO_HOISTING_FLAG}"
        jax.config.update("jax_platforms", "cpu")
    ready = jax.default_backend() == "cpu" and jax.device_count() >= count
    if not ready or NO_HOISTING_FLAG not in os.environ.get("XLA_FLAGS", ""):
        raise ValueError(f"check-config needs JAX on the CPU with {count} devices and XLA_FLAGS={NO_HOISTING_FLAG}, "
                         f"set before JAX starts: run it in a fresh process (`jaxserve check-config`)")


def cpu_seconds() -> float:
    """CPU time of this process, all threads: what a step costs an idle machine, whatever else runs on this one."""
    return time.process_time()


# ---- the model ------------------------------------------------------------------------------------------------


def resolve_spec(model: str | None, model_shape: str | None) -> tuple[ModelSpec, str]:
    """The model's architecture and a note saying where it came from: `model_shape` (a PUBLISHED_MODELS name),
    the folder's config.json, or, when the folder is not here, the published config of the model it is named
    after. ValueError when none applies."""
    from jaxserve.engine.llm_engine import default_model_path

    if model_shape is not None:
        return _published_spec(model_shape), f"published config.json of {model_shape} (--model-shape)"
    folder = model or default_model_path()
    if os.path.isfile(os.path.join(folder, "config.json")):
        return load_model_spec(folder), f"{os.path.join(folder, 'config.json')}"
    name = os.path.basename(os.path.normpath(folder)).lower()
    if name not in PUBLISHED_MODELS:
        raise ValueError(f"model folder {folder!r} has no config.json and its name is none of the known models "
                         f"({', '.join(PUBLISHED_MODELS)}): pass --model-shape")
    return _published_spec(name), f"{folder} is not here: the published config.json of {name}"


def _published_spec(name: str) -> ModelSpec:
    """The spec of a PUBLISHED_MODELS entry."""
    if name not in PUBLISHED_MODELS:
        raise ValueError(f"unknown model shape {name!r}; one of {', '.join(PUBLISHED_MODELS)}")
    config = {"hidden_act": "silu", **PUBLISHED_MODELS[name]}
    return spec_from_hf_config(config, {"eos_token_id": config["eos_token_id"]})


def abstract_params(spec: ModelSpec, mesh: jax.sharding.Mesh, dtype, num_cache_kv_heads: int,
                    quantization: str = "none", kv_cache_dtype: str = "auto", declared: dict | None = None) -> dict:
    """Every params leaf as a ShapeDtypeStruct in its final sharding: the shapes the engine's dummy weights
    have (traced, never made), quantized as configured, with the fp8 KV cache's scales under `kv_cache_dtype`
    fp8, the shardings the engine gives them (`declared`: the weights, when not the registered architecture's)."""
    from jaxserve.model.loader import dummy_params
    from jaxserve.model.quantize import quantized_partition_specs, quantized_shapes, replace_at
    from jaxserve.model.registry import map_weights, param_partition_specs, quantizable_paths
    from jaxserve.sharding import named

    shapes = jax.eval_shape(lambda: dummy_params(spec, mesh, dtype, num_cache_kv_heads, seed=0, declared=declared))
    if declared is None:
        specs = param_partition_specs(spec, num_cache_kv_heads, mesh.devices.size)
    else:
        specs = map_weights(lambda _, weight: weight.spec, declared)
    if quantization != "none":
        paths = quantizable_paths(spec)
        block = spec.checkpoint_weight_block  # a checkpoint's block or group scales are served grouped
        extras = spec.checkpoint_zero_points, spec.checkpoint_act_order
        shapes = replace_at(shapes, paths, lambda leaf: quantized_shapes(leaf, quantization, block and block[1],
                                                                         *extras))
        specs = quantized_partition_specs(specs, paths, block is not None, *extras)
    if kv_cache_dtype == "fp8":
        scale = jax.ShapeDtypeStruct((spec.num_layers, num_cache_kv_heads), jnp.float32)  # (L, Hkv)
        shapes, specs = fp8.with_scale_leaves(shapes, scale), fp8.with_scale_leaves(specs, fp8.SCALE_SPEC)
    return jax.tree_util.tree_map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), shapes,
        named(mesh, specs))


def shard_bytes(tree) -> int:
    """Bytes of one device's shard of every ShapeDtypeStruct in `tree` (the largest shard, when uneven)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        total += leaf.dtype.itemsize * math.prod(leaf.sharding.shard_shape(leaf.shape))
    return total


# ---- buckets ------------------------------------------------------------------------------------------------


def select_buckets(ladders, shapes: tuple[list, ...], which: str) -> tuple[list, ...]:
    """Runner.shapes() itself for "all"; for "edges", the smallest and largest rung of each ladder, plus the
    token rungs on either side of max_num_seqs (where rows stop growing with tokens), and for the sampler the
    smallest penalty history besides none; for "largest", the largest bucket of each kind."""
    if which == "all":
        return shapes
    if which == "largest":
        return tuple([max(kind)] if kind else [] for kind in shapes)
    uncapped = [t for t in ladders.tokens if ladders.rows_for(t) == t]
    capped = [t for t in ladders.tokens if ladders.rows_for(t) < t]
    tokens = {ladders.tokens[0], ladders.tokens[-1], *uncapped[-1:], *capped[:1]}
    widths = {ladders.page_widths[0], ladders.page_widths[-1]}
    rows = {min(ladders.row_buckets()), max(ladders.row_buckets())}
    aux = {ladders.aux_widths[0], *ladders.aux_widths[1:2], ladders.aux_widths[-1]}
    forward, sampler, prompt, steps, verify_rows, verify, pool, draft = shapes
    edge_tokens = {ladders.tokens[0], ladders.tokens[-1]}
    return ([s for s in forward if s[0] in tokens and s[1] in widths],
            [s for s in sampler if s[0] in rows and s[1] in aux],
            [s for s in prompt if s[0] in edge_tokens],
            [s for s in steps if s[0] in tokens and s[1] in widths],
            [s for s in verify_rows if s[0] in edge_tokens],
            [s for s in verify if s[0] in rows and s[1] in aux],
            [s for s in pool if s[0] in edge_tokens],
            [s for s in draft if s[0] in tokens and s[1] in widths])


def bucket_calls(runner, draft_runner, num_pages: int) -> dict[str, Callable]:
    """kind -> a function from a bucket's shape to (jitted step function, abstract arguments)."""
    return {
        "forward": lambda shape: runner.forward_call(*shape, num_pages),
        "sampler": lambda shape: runner.sampler_call(*shape),
        "prompt_logprobs": lambda shape: runner.prompt_logprobs_call(*shape),
        "decode_steps": lambda shape: runner.decode_steps_call(*shape, num_pages),
        "verify_rows": lambda shape: runner.verify_rows_call(*shape),
        "verify": lambda shape: runner.verify_call(*shape),
        "pooling": lambda shape: runner.pooling_call(*shape),
        "draft": lambda shape: draft_runner.propose_call(*shape, num_pages),
    }


def lower_bucket(function, args: tuple, platform: str) -> tuple[float, set[str]]:
    """jax.export of one bucket for `platform`: (seconds it took, custom-call targets in the module)."""
    start = cpu_seconds()
    exported = jax.export.export(
        function, platforms=[platform],
        disabled_checks=[DisabledSafetyCheck.custom_call(name) for name in EXPECTED_UNSTABLE_CALLS],
    )(*args)
    seconds = cpu_seconds() - start
    return seconds, set(re.findall(r"stablehlo\.custom_call @([\w$.\-]+)", exported.mlir_module()))


def lower_all(runner, draft_runner, shapes: tuple[list, ...], num_pages: int,
              platform: str) -> tuple[list[BucketCheck], set[str]]:
    """Lower every bucket in `shapes` (one list per kind of KINDS; the draft's empty without `draft_runner`); a
    failure is recorded, not raised."""
    checks, custom_calls = [], set()
    calls = bucket_calls(runner, draft_runner, num_pages)
    for kind, kind_shapes in zip(KINDS, shapes):
        for shape in kind_shapes:
            start = cpu_seconds()
            try:
                seconds, targets = lower_bucket(*calls[kind](shape), platform)
            except Exception as error:  # noqa: BLE001 - any failure of a bucket is the result
                message = (str(error).strip().splitlines() or [""])[0]
                checks.append(BucketCheck(kind, shape, cpu_seconds() - start,
                                          f"{type(error).__name__}: {message}"[:500]))
                continue
            checks.append(BucketCheck(kind, shape, seconds))
            custom_calls |= targets
    return checks, custom_calls


def target_chip(platform: str, device: str) -> contextlib.AbstractContextManager:
    """Lowering for `device`'s chip: the Mosaic TPU kernel's lowering reads the chip generation from the
    default device, a CPU here, so for a TPU attention/tpu.py's `lowering_off_tpu` answers with the device's."""
    if platform != "tpu":
        return contextlib.nullcontext()
    from jax.experimental.pallas import tpu as pltpu

    from jaxserve.attention.tpu import lowering_off_tpu

    return lowering_off_tpu(pltpu.ChipVersion(device.removeprefix("tpu-")))


# ---- estimates on the CPU ---------------------------------------------------------------------------------------


def cpu_estimates(runner, draft_runner) -> tuple[int, dict[str, float]]:
    """(the largest step's activation bytes per device, CPU compile seconds of one bucket of each kind), from
    runners on the CPU with the xla attention path (the target's and None or the draft's): the activations as
    the engine sizes them (Runner.peak_activation_bytes: the largest forward and sampler buckets, compiled; the
    draft's largest proposal bucket when that is larger), the compile seconds measured on the largest bucket of
    each kind (forward and sampler share that call's time).

    The pool is MIN_POOL_PAGES: the CPU compiler writes K/V into a bf16 pool by converting the whole pool to
    f32 and back (two f32 copies of it as temporaries, which grow with the pool), a CPU-only detour that a pool
    of the engine's size would count as activations."""
    start = cpu_seconds()
    activation_bytes = runner.peak_activation_bytes(MIN_POOL_PAGES)
    forward_and_sampler = cpu_seconds() - start
    start = cpu_seconds()
    function, args = runner.prompt_logprobs_call(runner.ladders.tokens[-1])
    function.lower(*args).compile()
    prompt = cpu_seconds() - start
    draft = 0.0
    if draft_runner is not None:
        start = cpu_seconds()
        activation_bytes = max(activation_bytes, draft_runner.peak_activation_bytes(MIN_POOL_PAGES))
        draft = cpu_seconds() - start
    # A multi-step decode bucket is a forward and a sampler in a loop, counted as one of each; a verification
    # bucket (the LM head at each verified position, then a sampler) as a sampler; taking the verified positions'
    # hidden states out of a forward (one gather) as nothing; pooling (a norm and a segment sum) as a prompt-logprob
    # bucket, which it is cheaper than.
    seconds = {"forward": forward_and_sampler / 2, "sampler": forward_and_sampler / 2, "prompt_logprobs": prompt,
               "decode_steps": forward_and_sampler, "verify_rows": 0.0, "verify": forward_and_sampler / 2,
               "pooling": prompt, "draft": draft}
    return activation_bytes, seconds


def memory_plan(device: str, utilization: float, weight_bytes: int, activation_bytes: int, page_bytes: int,
                max_model_len: int, page_size: int) -> MemoryPlan:
    """The device's split (kv/sizing.py); ValueError when nothing is left for the pool or the pool cannot hold
    one request of max_model_len (the engine's own check)."""
    from jaxserve.engine.sizing import check_pool_holds_a_request

    plan = plan_kv_pages(DEVICE_MEMORY_BYTES[device], utilization, weight_bytes, activation_bytes, page_bytes)
    try:
        check_pool_holds_a_request(plan.num_pages, max_model_len, page_size)
    except ValueError as why:
        raise ValueError(f"{why}; {plan.describe()}") from None
    return plan


# ---- one config ---------------------------------------------------------------------------------------------------


def check_config(path: str, platforms: list[str], devices: dict[str, str], model_shape: str | None = None,
                 buckets: str = "all", attention_backend: str | None = None) -> ConfigCheck:
    """Check one YAML config on every platform in `platforms` (see the module docstring), with the config's
    attention backend or `attention_backend`."""
    from jaxserve.engine.sizing import bucket_ladders, resolve_max_model_len
    from jaxserve.model.checkpoint import weight_quantization
    from jaxserve.model.eagle import eagle3_weights, eagle_weights, read_head_config
    from jaxserve.model.loader import resolve_dtype
    from jaxserve.model.lora import lora_slot_structs
    from jaxserve.model.registry import model_for
    from jaxserve.runner.runner import Runner
    from jaxserve.sharding import cache_kv_heads, make_mesh
    from jaxserve.spec_decode.draft_runner import DraftRunner
    from jaxserve.spec_decode.eagle import EagleRunner

    config = EngineConfig.from_yaml(path, **({"attention_backend": attention_backend} if attention_backend else {}))
    cache, lora = config.cache_config, config.lora_config
    spec, note = resolve_spec(config.model_config.model, model_shape)
    max_model_len = resolve_max_model_len(config, spec)
    spec = spec.for_max_model_len(max_model_len)
    tp = config.parallel_config.tensor_parallel_size
    mesh = make_mesh(tp)
    kv_heads = cache_kv_heads(spec, tp)
    dtype = jnp.dtype(resolve_dtype(config.model_config.dtype, spec))
    ladders = bucket_ladders(config, spec, max_model_len)
    params = abstract_params(spec, mesh, dtype, kv_heads, weight_quantization(config, spec), cache.kv_cache_dtype)
    if lora.enable_lora:  # the adapter slots: weights the engine holds, and work in every projection
        lora = lora_slot_structs(model_for(spec.architecture), spec, kv_heads, mesh, lora.max_loras,
                                 lora.max_lora_rank, dtype)
        params = {**params, "layers": {**params["layers"], "lora": lora}}
    needed_pages = pages_for_tokens(max_model_len, cache.page_size) + 1

    speculative = config.speculative_config
    method = speculative.method if speculative is not None else None
    draft = None  # (spec, abstract params, KV heads, dtype) of a draft model or an EAGLE head
    head = None  # an EAGLE head's config (model/eagle.py)
    if method == "draft_model":
        draft_spec, draft_note = resolve_spec(speculative.model, None)
        draft_dtype, declared = jnp.dtype(resolve_dtype(config.model_config.dtype, draft_spec)), None
    elif method in EAGLE_METHODS:
        head = read_head_config(speculative.model, method, spec)
        draft_spec, draft_note, draft_dtype = head.spec, os.path.join(speculative.model, "config.json"), dtype
    if method in ("draft_model", *EAGLE_METHODS):
        draft_spec = draft_spec.for_max_model_len(max_model_len)
        draft_kv_heads = cache_kv_heads(draft_spec, tp)
        if head is not None:  # an EAGLE head's weights (an embedding always: its own or the target's copy)
            declared = (eagle3_weights(draft_spec, draft_kv_heads, tp, True, head.draft_vocab_size)
                        if head.version == 3 else eagle_weights(draft_spec, draft_kv_heads, tp, True, True))
        draft_params = abstract_params(draft_spec, mesh, draft_dtype, draft_kv_heads, "none", cache.kv_cache_dtype,
                                       declared)
        if head is not None and head.draft_vocab_size < draft_spec.vocab_size:  # EAGLE-3's draft ids' tokens
            draft_params["draft_tokens"] = jax.ShapeDtypeStruct((head.draft_vocab_size,), jnp.int32,
                                                                sharding=NamedSharding(mesh, P()))
        draft = (draft_spec, draft_params, draft_kv_heads, draft_dtype)
        note = f"{note}; {'EAGLE head' if head else 'draft model'} {draft_note}"

    def runner(backend: str, platform: str) -> Runner:
        return Runner(spec, params, mesh, page_size=cache.page_size, num_cache_kv_heads=kv_heads,
                      cache_dtype=fp8.cache_dtype(cache.kv_cache_dtype, dtype),
                      ladders=ladders, attention_backend=backend, platform=platform,
                      num_scheduler_steps=config.scheduler_config.num_scheduler_steps,
                      num_speculative_tokens=config.num_speculative_tokens,
                      pooling=config.model_config.runs_pooling(spec), features=head.features if head else None)

    def draft_runner(backend: str, platform: str, target: Runner) -> DraftRunner | None:
        if draft is None:
            return None
        draft_spec, draft_params, draft_kv_heads, draft_dtype = draft
        kind = functools.partial(EagleRunner, target=target, version=head.version) if head else DraftRunner
        return kind(draft_spec, draft_params, mesh, page_size=cache.page_size, num_cache_kv_heads=draft_kv_heads,
                    cache_dtype=fp8.cache_dtype(cache.kv_cache_dtype, draft_dtype), ladders=ladders,
                    attention_backend=backend, platform=platform, num_proposals=config.num_speculative_tokens)

    cpu_runner = runner("xla", "cpu")
    activation_bytes, compile_seconds = cpu_estimates(cpu_runner, draft_runner("xla", "cpu", cpu_runner))
    weight_bytes = shard_bytes(params) + (shard_bytes(draft[1]) if draft else 0)
    target_shapes = cpu_runner.shapes()
    every_shape = target_shapes + ((target_shapes[0] if draft else []),)  # the draft's: the forward's (T, W)
    checks = []
    for platform in platforms:
        device = devices[platform]
        try:
            backend = config.compilation_config.attention_backend
            platform_runner = runner(backend, PLATFORMS[platform])
            platform_draft = draft_runner(backend, PLATFORMS[platform], platform_runner)
        except ValueError as why:
            checks.append(PlatformCheck(platform, device, None, [], [], None, f"attention backend: {why}"))
            continue
        # a page as the platform's backend stores it (the TPU layout pads the head dimension), the draft's too
        page_bytes = sum(r.page_bytes() for r in (platform_runner, platform_draft) if r is not None) // tp
        try:
            plan, error = memory_plan(device, cache.gpu_memory_utilization, weight_bytes, activation_bytes,
                                      page_bytes, max_model_len, cache.page_size), None
        except ValueError as why:
            plan, error = None, f"memory on {device}: {why}"
        pool_pages = plan.num_pages if plan else needed_pages  # the pool the engine would compile against
        with target_chip(platform, device):
            bucket_checks, custom_calls = lower_all(platform_runner, platform_draft,
                                                    select_buckets(ladders, every_shape, buckets), pool_pages, platform)
        checks.append(PlatformCheck(platform, device, platform_runner.attention.name, bucket_checks,
                                    sorted(custom_calls), plan, error))
    return ConfigCheck(path, note, tp, cache.page_size, dict(zip(KINDS, map(len, every_shape))), weight_bytes,
                       activation_bytes, compile_seconds, checks)


# ---- the report ---------------------------------------------------------------------------------------------------


TABLE_HEADER = (
    "| config | platform | attention | executables (fwd / sampler / prompt / multi-step / verify rows / verify "
    "/ pooling / draft) "
    "| lowered "
    "| lowering CPU s: total (slowest) | kernels | weights GiB | activations GiB (est.) | KV pool GiB (tokens) "
    "| device GiB | compile est. min | result |"
)


def table_row(check: ConfigCheck, platform: PlatformCheck) -> str:
    """One markdown table row: one config on one platform."""
    counts = " / ".join(str(check.executables[kind]) for kind in KINDS)
    failed = sum(1 for b in platform.buckets if b.error)
    lowered = f"{len(platform.buckets) - failed} of {len(platform.buckets)}"
    seconds = [b.seconds for b in platform.buckets]
    timing = f"{sum(seconds):.1f} ({max(seconds):.2f})" if seconds else "-"
    plan = platform.memory
    pool = f"{plan.kv_bytes / GIB:.1f} ({(plan.num_pages - 1) * check.page_size:,})" if plan else "does not fit"
    device = f"{DEVICE_MEMORY_BYTES[platform.device] / GIB:.1f} ({platform.device})"
    result = "FAIL" if platform.failures else "ok"
    cells = [check.name, platform.platform, platform.backend or "-", counts, lowered, timing,
             ", ".join(platform.custom_calls) or "none", f"{check.weight_bytes / GIB:.2f}",
             f"{check.activation_bytes / GIB:.2f}", pool, device, f"{check.compile_estimate_seconds / 60:.1f}", result]
    return "| " + " | ".join(cells) + " |"


def report(checks: list[ConfigCheck], buckets: str) -> str:
    """The markdown report: notes on every estimate, the table, the memory split of each row, the failures."""
    lines = [f"Lowered with jax.export on the CPU; buckets: {buckets} ({BUCKET_SETS[buckets]}).",
             "Memory is per device. Weights: exact shard sizes. Activations: an estimate, XLA's memory analysis of the "
             "largest forward and sampler buckets (or a draft model's largest proposal bucket, when larger) compiled "
             "for the CPU with the xla attention path (against a "
             f"{MIN_POOL_PAGES}-page pool: the CPU's f32 detour through the pool left out). KV pool: what "
             "gpu_memory_utilization of the device leaves (kv/sizing.py). Compile estimate: CPU compile seconds of the "
             "largest bucket of each kind times the executable count, serial (not a device measurement). Times are CPU "
             "seconds of this process (as on an idle machine).", ""]
    lines += [f"- {check.name}: model {check.model_note}; tensor_parallel_size {check.tensor_parallel_size}"
              for check in checks]
    lines += ["", TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
    lines += [table_row(check, platform) for check in checks for platform in check.platforms]
    lines += [""] + [f"- {check.name} {p.platform}: {p.memory.describe()}" for check in checks for p in check.platforms
                     if p.memory]
    failures = [line for check in checks for line in check.failures]
    lines += ["", f"{len(failures)} failure(s)" + (":" if failures else ".")] + [f"- {line}" for line in failures]
    return "\n".join(lines)


# ---- the command --------------------------------------------------------------------------------------------------


def device_for(platform: str, config_path: str, named: list[str]) -> str:
    """The device of `platform`: one given with --device, else one the config's file name names (8xh200), else
    DEFAULT_DEVICES."""
    candidates = [name for name in DEVICE_MEMORY_BYTES if name.startswith("tpu-") == (platform == "tpu")]
    for name in named:
        if name in candidates:
            return name
    in_file_name = [name for name in candidates if name in os.path.basename(config_path).lower()]
    return in_file_name[0] if in_file_name else DEFAULT_DEVICES[platform]


def shipped_config_list() -> str:
    """One line per shipped config: its name (what --config takes) and the first sentence of its file's leading
    comment."""
    lines = []
    for name in shipped_configs():
        with open(resolve_config_path(name)) as f:
            comment = " ".join(line.removeprefix("#").strip() for line in itertools.takewhile(
                lambda line: line.startswith("#"), f))
        lines.append(f"{name:28} {comment.split('. ')[0].rstrip('.')}.")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `jaxserve check-config`."""
    parser.add_argument("configs", nargs="*", metavar="CONFIG",
                        help="YAML engine config(s): files, or shipped configs by name (e.g. llama-3.1-8b-1xh200)")
    parser.add_argument("--list", action="store_true", help="list the shipped configs, each with what it is for")
    parser.add_argument("--platforms", nargs="+", choices=list(PLATFORMS), default=list(PLATFORMS),
                        help="targets to lower for (default: %(default)s)")
    parser.add_argument("--device", action="append", default=[], choices=list(DEVICE_MEMORY_BYTES),
                        help="device whose memory to size against, once per platform (default: one the config's file "
                             f"name names, else {', '.join(DEFAULT_DEVICES.values())})")
    parser.add_argument("--model-shape", choices=list(PUBLISHED_MODELS),
                        help="use this published architecture instead of the config's model folder")
    parser.add_argument("--buckets", choices=list(BUCKET_SETS), default="all",
                        help="; ".join(f"{name}: {text}" for name, text in BUCKET_SETS.items()) +
                        " (default: %(default)s)")
    parser.add_argument("--attention-backend", choices=list(VALID_ATTENTION_BACKENDS),
                        help="instead of the config's (e.g. xla: the fallback a GPU takes when the kernels fail)")
    parser.add_argument("--json", metavar="PATH", help="also write every result (each bucket's time) as JSON")


def run(args: argparse.Namespace) -> int:
    """Check every config; print the report; 0 when every bucket lowered and every config fits, else 1 (--list: print
    the shipped configs)."""
    if args.list:
        print(shipped_config_list())
        return 0
    if not args.configs:
        raise ValueError("check-config needs a CONFIG (a file, or a shipped config's name: see --list)")
    configs = [EngineConfig.from_yaml(path) for path in args.configs]
    use_host_devices(max(config.parallel_config.tensor_parallel_size for config in configs))
    checks = []
    for path in args.configs:
        devices = {platform: device_for(platform, path, args.device) for platform in args.platforms}
        checks.append(check_config(path, args.platforms, devices, args.model_shape, args.buckets,
                                   args.attention_backend))
        print(f"checked {path}", flush=True)
    print(report(checks, args.buckets))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([check.to_json() for check in checks], f, indent=1)
    return 1 if any(check.failures for check in checks) else 0
