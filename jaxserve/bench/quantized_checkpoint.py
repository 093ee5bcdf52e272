"""Write a float Hugging Face checkpoint again as a quantized one, for the quantization quality benchmark and the
test fixtures (scripts/make_quantized_fixtures.py); the other tensors, the tokenizer and the generation config
are copied as they are, the LM head and MoE routers left in float.

- Block-wise fp8 (`write_fp8_block_checkpoint`, Qwen3-FP8's and DeepSeek's form): each decoder linear weight
  (out, in) float8_e4m3fn with a float32 `weight_scale_inv` per block of (rows, columns), the block's largest
  magnitude over 448 (e4m3's largest value; an all-zero block keeps 1), the last blocks of a dimension partial
  where the block does not divide it.
- int4 (`write_int4_checkpoint`, compressed-tensors' pack-quantized W4A16, llm-compressor's form): each weight
  rounded to integers in [-8, 7] under a float32 `weight_scale` per group of `group_size` input columns (the
  group's largest magnitude over 7.5, compressed-tensors' symmetric range), packed eight to an int32
  (`weight_packed`, (out, in / 8): the first value in the lowest 4 bits, each stored plus 8), with its
  `weight_shape`. Asymmetric (`symmetric=False`, llm-compressor's W4A16_ASYM): each group's range from its
  minimum to its maximum (widened to hold 0) over 15 levels, `weight = (q - zero) * scale` with the zero point
  `round(-minimum / scale) - 8` clamped to [-8, 7], the zero points packed eight output channels to an int32
  (`weight_zero_point`, (out / 8, groups), along the outputs as compressed-tensors packs them).
- AWQ (`write_awq_checkpoint`, AutoAWQ's GEMM form): the asymmetric groups above as unsigned values, `qweight`
  (in, out / 8) and `qzeros` (groups, out / 8) packed along the outputs in AWQ's order, float16 `scales`.
- GPTQ (`write_gptq_checkpoint`, AutoGPTQ's and GPTQModel's "gptq" format): the groups above (symmetric, zero
  point 8, or not), rounded to nearest rather than by GPTQ's error-compensating algorithm (the format is what
  the tests read), in 4 bits or 8 (then [-128, 127], a symmetric group's largest magnitude over 127.5), as unsigned
  values: `qweight` (in * bits / 32, out) packed along the inputs, `qzeros` (groups, out * bits / 32) packed along
  the outputs and stored less one, float16 `scales`, `g_idx` (in,) = row // group size, or under act-order each
  row's group after the rows are taken in a permuted order.
- MXFP4 (`write_mxfp4_checkpoint`, gpt-oss's release: openai/gpt-oss-20b, -120b): each expert projection X
  (transformers' (E, in, out)), first rounded to bfloat16 (the release's experts were bfloat16, and transformers'
  own quantizer casts to it before it quantizes), as `X_blocks` uint8 (E, out, in / 32, 16) and `X_scales` uint8
  (E, out, in / 32), quant_method mxfp4. Each block of 32 inputs of an output row gets a power-of-two scale 2 ** e,
  stored e + 127 (E8M0), and each value over it is rounded to the nearest FP4 e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4,
  6 and their negatives; ties to the even code, as IEEE rounds; clamped to +-6). The scale rule "fit" takes the
  smallest e under which the block's largest magnitude fits FP4's largest value, 6: e = ceil(log2(max / 6)), so
  nothing saturates (triton_kernels' default, which transformers quantizes with); "ocp" takes OCP MX v1.0's
  e = floor(log2(max)) - 2 (max / 2 ** e in [4, 8): finer steps, the largest values clamped to 6). e is kept to
  [-127, 127] (an all-zero block: -127). Codes are packed two to a byte, the first input in the low nibble. The
  biases, attention, routers, embeddings and LM head stay as they were.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Callable

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxserve.model.loader import (
    AWQ_ORDER,
    E8M0_BIAS,
    FP4_VALUES,
    GPTQ_ZERO_STORED_LESS,
    MXFP4_BLOCK,
    SafetensorsFolder,
    pack_int4_rows,
)

FP8_MAX = 448.0
# experts' too; DeepSeek-V3's latent attention's projections last
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
          "kv_a_proj_with_mqa", "kv_b_proj")
COPIED = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "vocab.json",
          "merges.txt", "generation_config.json", "chat_template.jinja")


def quantize_blocks(weight: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn weight (out, in), float32 scales (ceil(out / rows), ceil(in / columns))) of a float one."""
    rows, columns = block
    out, inputs = weight.shape
    grid = (-(-out // rows), -(-inputs // columns))
    padded = np.zeros((grid[0] * rows, grid[1] * columns), np.float32)  # zeros leave each block's max alone
    padded[:out, :inputs] = weight
    blocks = padded.reshape(grid[0], rows, grid[1], columns)
    absmax = np.abs(blocks).max(axis=(1, 3))  # (out blocks, in blocks)
    scale = np.where(absmax > 0, absmax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    scaled = np.clip(blocks / scale[:, None, :, None], -FP8_MAX, FP8_MAX).reshape(padded.shape)[:out, :inputs]
    return scaled.astype(ml_dtypes.float8_e4m3fn), scale


def quantize_int4(weight: np.ndarray, group_size: int, symmetric: bool = True) -> dict[str, np.ndarray]:
    """{"weight_packed": int32 (out, in / 8), "weight_scale": float32 (out, in / group_size), "weight_shape":
    int64 (2,)} of a float weight (out, in), and "weight_zero_point": int32 (out / 8, groups) unless `symmetric`;
    `in` a multiple of the group size and of 8 (and `out` of 8 when asymmetric)."""
    values, scale, zero = _integer_groups(weight, group_size, symmetric)
    tensors = {"weight_packed": pack_int4_rows(values + 8), "weight_scale": scale,
               "weight_shape": np.array(weight.shape, np.int64)}
    return tensors if symmetric else {**tensors, "weight_zero_point": pack_int4_rows(zero.T + 8).T}  # along out


def quantize_awq(weight: np.ndarray, group_size: int) -> dict[str, np.ndarray]:
    """AutoAWQ's GEMM tensors of a float weight (out, in), asymmetric in groups of `group_size` inputs:
    {"qweight": int32 (in, out / 8), "qzeros": int32 (groups, out / 8), "scales": float16 (groups, out)}, unsigned
    values packed along the outputs in AWQ's order (model/loader.py's AWQ_ORDER); the values rounded under the
    float32 scales, which are then stored in float16 as AWQ keeps them."""
    values, scale, zero = _integer_groups(weight, group_size, symmetric=False)

    def packed(unsigned: np.ndarray) -> np.ndarray:  # (rows, columns) -> (rows, columns / 8) in AWQ's order
        rows, columns = unsigned.shape
        return pack_int4_rows(unsigned.reshape(rows, columns // 8, 8)[:, :, list(AWQ_ORDER)].reshape(rows, columns))

    return {"qweight": packed(values.T + 8), "qzeros": packed(zero.T + 8), "scales": scale.T.astype(np.float16)}


def quantize_gptq(weight: np.ndarray, group_size: int | None, symmetric: bool = True,
                  order: np.ndarray | None = None, bits: int = 4) -> dict[str, np.ndarray]:
    """GPTQ's tensors of a float weight (out, in) in groups of `group_size` inputs (None: one group, per output
    channel), the input rows taken in `order` (act-order: group g holds rows order[g * group_size:][:group_size];
    default consecutive), 4 or 8 `bits`: {"qweight": int32 (in * bits / 32, out), "qzeros": int32 (groups, out * bits
    / 32), "scales": float16 (groups, out), "g_idx": int32 (in,) each row's group}, unsigned values packed from the
    lowest bits up, each zero point stored less one (0 wraps to the largest value); the values rounded under the
    float32 scales, then stored in float16 as GPTQ keeps them."""
    inputs = weight.shape[1]
    group_size = group_size or inputs
    order = np.arange(inputs) if order is None else order
    in_order, scale, zero = _integer_groups(weight[:, order], group_size, symmetric, bits)  # (out, in) rows in `order`
    values, row_groups = np.empty_like(in_order), np.empty(inputs, np.int32)
    values[:, order], row_groups[order] = in_order, np.arange(inputs) // group_size
    half = 2 ** (bits - 1)
    stored_zeros = (zero.T + half - GPTQ_ZERO_STORED_LESS) % (2 * half)  # (groups, out)
    return {"qweight": _pack_rows(values + half, bits).T.copy(), "qzeros": _pack_rows(stored_zeros, bits),
            "scales": scale.T.astype(np.float16), "g_idx": row_groups}


def quantize_mxfp4(weight: np.ndarray, rule: str = "fit") -> dict[str, np.ndarray]:
    """{"blocks": uint8 (..., out, in / 32, 16), "scales": uint8 (..., out, in / 32)} of a float weight (..., in, out)
    (transformers' layout of gpt-oss's experts) in MXFP4, each block's scale by `rule` ("fit" or "ocp"), as the
    module docstring says; `in` a multiple of 32."""
    rows = np.swapaxes(np.asarray(weight, np.float64), -1, -2)  # (..., out, in)
    if rows.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"a weight of {weight.shape} has {rows.shape[-1]} inputs, not a multiple of {MXFP4_BLOCK}")
    groups = rows.reshape(*rows.shape[:-1], rows.shape[-1] // MXFP4_BLOCK, MXFP4_BLOCK)  # (..., out, in / 32, 32)
    largest = np.abs(groups).max(axis=-1)  # (..., out, in / 32)
    fp4_max = FP4_VALUES.max()
    with np.errstate(divide="ignore"):
        exponent = np.ceil(np.log2(largest / fp4_max))  # then made exact: the smallest e with largest <= 6 * 2^e
    exponent = np.where(largest > 0, exponent, -E8M0_BIAS)
    exponent += largest > fp4_max * np.exp2(exponent)
    exponent -= (largest > 0) & (largest <= fp4_max * np.exp2(exponent - 1))
    if rule == "ocp":  # floor(log2(largest)) - 2: largest / 2^e in [4, 8) rather than (3, 6]
        exponent -= (largest > 0) & (largest < 4 * np.exp2(exponent))
    exponent = np.clip(exponent, -E8M0_BIAS, E8M0_BIAS)
    scaled = np.minimum(np.abs(groups) / np.exp2(exponent)[..., None], fp4_max)  # (..., 32) magnitudes to round
    magnitudes = FP4_VALUES[:8].astype(np.float64)  # codes 0..7
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2  # between codes i and i + 1: up above it, at it to the even
    codes = (scaled[..., None] > midpoints).sum(-1) + (
        (scaled[..., None] == midpoints) & (np.arange(7) % 2 == 1)).sum(-1)
    codes = (codes + 8 * (groups < 0)).astype(np.uint8)  # the sign bit
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # (..., out, in / 32, 16): the first input in the low nibble
    return {"blocks": np.ascontiguousarray(blocks, np.uint8),
            "scales": np.ascontiguousarray(exponent + E8M0_BIAS, np.uint8)}


def _pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned `bits`-bit values (rows, columns) packed 32 / bits columns to an int32 (rows, columns * bits / 32),
    the first in the lowest bits."""
    return pack_int4_rows(values) if bits == 4 else np.ascontiguousarray(values.astype(np.uint8)).view("<i4")


def _integer_groups(weight: np.ndarray, group_size: int, symmetric: bool, bits: int = 4) -> tuple[np.ndarray, ...]:
    """(values int64 (out, in) in [-8, 7] (with `bits`, [-2 ** (bits - 1), 2 ** (bits - 1) - 1]), scales float32
    (out, groups), zero points int64 (out, groups), all 0 when `symmetric`) of a float weight (out, in) rounded to
    nearest per group of `group_size` inputs: a symmetric group's largest magnitude over 7.5 (127.5 for 8 bits), an
    asymmetric one's range (widened to hold 0) over 15 levels (255)."""
    out, inputs = weight.shape
    if inputs % group_size or inputs % 8 or (not symmetric and out % 8):
        raise ValueError(f"a weight of {(out, inputs)} does not pack in groups of {group_size}")
    half = 2 ** (bits - 1)
    limits = (-half, half - 1)
    groups = weight.astype(np.float32).reshape(out, inputs // group_size, group_size)
    zero = np.zeros(groups.shape[:2], np.int64)  # (out, groups)
    if symmetric:
        absmax = np.abs(groups).max(axis=2)  # (out, groups)
        scale = np.where(absmax > 0, absmax / np.float32(half - 0.5), np.float32(1.0)).astype(np.float32)
    else:
        low, high = np.minimum(groups.min(axis=2), 0), np.maximum(groups.max(axis=2), 0)  # (out, groups)
        scale = np.where(high > low, (high - low) / np.float32(2 * half - 1), np.float32(1.0)).astype(np.float32)
        zero = np.clip(np.round(-low / scale) - half, *limits).astype(np.int64)
    values = np.clip(np.round(groups / scale[:, :, None]) + zero[:, :, None], *limits).astype(np.int64)
    return values.reshape(out, inputs), scale, zero


def write_fp8_block_checkpoint(source: str, destination: str, block: tuple[int, int]) -> None:
    """`source`'s checkpoint in `destination` with its decoder linear weights quantized in blocks of `block` and
    config.json's quantization_config saying so."""
    def quantize(name: str, weight: np.ndarray) -> dict[str, np.ndarray]:
        quantized, scale = quantize_blocks(weight, block)
        return {name: quantized, name + "_scale_inv": scale}

    def describe(config: dict) -> dict:
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block),
                "modules_to_not_convert": ["lm_head", *_routers(config)]}

    _write(source, destination, quantize, describe)


def write_awq_checkpoint(source: str, destination: str, group_size: int) -> None:
    """`source`'s checkpoint in `destination` with its decoder linear weights in AutoAWQ's GEMM form (4 bits, a
    scale and a zero point per `group_size` input rows) and config.json's quantization_config saying so."""
    def quantize(name: str, weight: np.ndarray) -> dict[str, np.ndarray]:
        module = name[: -len("weight")]  # "model.layers.0.mlp.up_proj."
        return {module + part: array for part, array in quantize_awq(weight, group_size).items()}

    def describe(config: dict) -> dict:
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": _routers(config) or None}

    _write(source, destination, quantize, describe)


def write_gptq_checkpoint(source: str, destination: str, group_size: int | None, symmetric: bool = True,
                          act_order: bool = False, bits: int = 4) -> None:
    """`source`'s checkpoint in `destination` with its decoder linear weights in GPTQ's form (4 or 8 `bits`, a scale
    and unless `symmetric` a zero point per `group_size` input rows; None: per output channel; with `act_order` each
    weight's rows grouped in an order of their own, a permutation seeded by the weight's name, where GPTQ sorts them
    by their activations' size) and config.json's quantization_config saying so."""
    def quantize(name: str, weight: np.ndarray) -> dict[str, np.ndarray]:
        module = name[: -len("weight")]  # "model.layers.0.mlp.up_proj."
        order = np.random.default_rng(zlib.crc32(name.encode())).permutation(weight.shape[1]) if act_order else None
        return {module + part: array for part, array in quantize_gptq(weight, group_size, symmetric, order,
                                                                      bits).items()}

    def describe(config: dict) -> dict:
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size or -1, "sym": symmetric,
                "desc_act": act_order, "static_groups": False, "true_sequential": True, "damp_percent": 0.01,
                "lm_head": False, "checkpoint_format": "gptq"}

    _write(source, destination, quantize, describe)


def write_int4_checkpoint(source: str, destination: str, group_size: int, symmetric: bool = True) -> None:
    """`source`'s checkpoint in `destination` with its decoder linear weights in compressed-tensors' int4
    pack-quantized form, a scale (and unless `symmetric`, a zero point) per `group_size` input columns, and
    config.json's quantization_config saying so."""
    def quantize(name: str, weight: np.ndarray) -> dict[str, np.ndarray]:
        module = name[: -len("weight")]  # "model.layers.0.mlp.up_proj."
        return {module + part: array for part, array in quantize_int4(weight, group_size, symmetric).items()}

    def describe(config: dict) -> dict:
        weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
                   "group_size": group_size, "dynamic": False, "observer": "minmax"}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                              "output_activations": None}},
                "ignore": ["lm_head", *_routers(config)]}

    _write(source, destination, quantize, describe)


def write_mxfp4_checkpoint(source: str, destination: str, rule: str = "fit") -> None:
    """`source`'s gpt-oss checkpoint in `destination` with its experts' gate_up_proj and down_proj rounded to
    bfloat16 and then MXFP4 (each block's scale by `rule`, `quantize_mxfp4`'s), as gpt-oss's release stores them,
    and config.json's quantization_config saying so (the release's)."""
    def quantize(name: str, weight: np.ndarray) -> dict[str, np.ndarray]:
        as_bfloat16 = weight.astype(ml_dtypes.bfloat16).astype(np.float32)  # as the release's were
        return {name + "_" + part: array for part, array in quantize_mxfp4(as_bfloat16, rule).items()}

    def describe(config: dict) -> dict:
        return {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}

    _write(source, destination, quantize, describe,
           lambda name: name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")))


def _routers(config: dict) -> list[str]:
    """A mixture of experts' router modules, which the quantized checkpoints leave in float."""
    return [f"model.layers.{i}.mlp.gate" for i in range(config["num_hidden_layers"])] if "num_experts" in config \
        else []


def _write(source: str, destination: str, quantize: Callable[[str, np.ndarray], dict[str, np.ndarray]],
           describe: Callable[[dict], dict], quantized: Callable[[str], bool] | None = None) -> None:
    """`source` in `destination` with each decoder linear weight (each tensor whose name `quantized` accepts)
    replaced by `quantize(name, float32 weight)`'s tensors and config.json's quantization_config
    `describe(config)`."""
    quantized = quantized or (lambda name: name.endswith(".weight") and name.split(".")[-2] in LINEAR)
    os.makedirs(destination, exist_ok=True)
    reader, tensors = SafetensorsFolder(source), {}
    for file in sorted(f for f in os.listdir(source) if f.endswith(".safetensors")):
        with safe_open(os.path.join(source, file), framework="numpy") as f:
            names = list(f.keys())
        for name in names:
            tensor = reader.get(name)
            if quantized(name):
                tensors.update(quantize(name, tensor.astype(np.float32)))
            else:
                tensors[name] = tensor
    tensors = {name: np.ascontiguousarray(tensor) for name, tensor in tensors.items()}  # (safetensors 0.8's numpy
    # save_file writes an array's memory as it lies, so a transposed view would be stored scrambled)
    save_file(tensors, os.path.join(destination, "model.safetensors"), metadata={"format": "pt"})
    for name in COPIED:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), destination)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = describe(config)
    with open(os.path.join(destination, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
