"""Write a float Hugging Face checkpoint again as a block-wise fp8 one (Qwen3-FP8's and DeepSeek's form), for
the quantization quality benchmark and the test fixtures (scripts/make_fp8_block_fixtures.py): each decoder
linear weight (out, in) float8_e4m3fn with a float32 `weight_scale_inv` per block of (rows, columns), the
block's largest magnitude over 448 (e4m3's largest value; an all-zero block keeps 1), the last blocks of a
dimension partial where the block does not divide it; the other tensors, the tokenizer and the generation
config copied as they are.
"""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxserve.model.loader import SafetensorsFolder

FP8_MAX = 448.0
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # experts' too
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


def write_fp8_block_checkpoint(source: str, destination: str, block: tuple[int, int]) -> None:
    """`source`'s checkpoint in `destination` with its decoder linear weights quantized in blocks of `block` and
    config.json's quantization_config saying so (the LM head and MoE routers left in float, as Qwen3-FP8's)."""
    os.makedirs(destination, exist_ok=True)
    reader, tensors = SafetensorsFolder(source), {}
    for file in sorted(f for f in os.listdir(source) if f.endswith(".safetensors")):
        with safe_open(os.path.join(source, file), framework="numpy") as f:
            names = list(f.keys())
        for name in names:
            tensor = reader.get(name)
            if name.endswith(".weight") and name.split(".")[-2] in LINEAR:
                tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(tensor.astype(np.float32), block)
            else:
                tensors[name] = tensor
    save_file(tensors, os.path.join(destination, "model.safetensors"), metadata={"format": "pt"})
    for name in COPIED:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), destination)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    routers = [f"model.layers.{i}.mlp.gate" for i in range(config["num_hidden_layers"])] \
        if "num_experts" in config else []
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": list(block), "modules_to_not_convert": ["lm_head", *routers]}
    with open(os.path.join(destination, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
