"""Make the block-wise fp8 test checkpoint (Qwen3-FP8's and DeepSeek's form) and record what Hugging Face
transformers generates from it, the reference for serving such checkpoints as they are stored.

Needs torch, transformers and accelerate (transformers reads an fp8 checkpoint only with accelerate; none of them
is needed by CI). From the repository root:
    python scripts/make_fp8_block_fixtures.py
Writes tests/fixtures/checkpoints/qwen3-fp8-block/: the qwen3 test checkpoint with every decoder linear weight
(q, k, v, o, gate, up, down) stored float8_e4m3fn (out, in) with a float32 `weight_scale_inv` per block (the
block's largest magnitude over 448, e4m3's largest value), and config.json's quantization_config
{"quant_method": "fp8", "weight_block_size": [rows, columns], ...} as Qwen3-FP8 ships it; the embeddings, norms
and LM head as they were. Then transformers loads the folder (on the CPU it dequantizes each weight block by
block at load) and greedy-decodes the prompts of qwen3/expected.json: expected.json (tokens, the smallest top-1
margin) and expected_logits.npy (each prompt's last-position logits) as the other checkpoints have. The block is
the first of BLOCKS whose greedy tokens keep every top-1 margin above make_test_checkpoints.py's MIN_MARGIN (so
float rounding cannot flip a token).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = ROOT / "tests" / "fixtures" / "checkpoints"
SOURCE, DESTINATION = CHECKPOINTS / "qwen3", CHECKPOINTS / "qwen3-fp8-block"
BLOCKS = ((32, 32), (32, 64), (64, 32), (64, 64))  # (rows, columns): all divide the qwen3 checkpoint's shapes
FP8_MAX = 448.0
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

sys.path.insert(0, str(ROOT / "scripts"))
from make_test_checkpoints import MIN_MARGIN, reference_outputs  # noqa: E402


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight (out, in), float32 scales (out / rows, in / columns)) of a float weight (out, in)."""
    rows, columns = block
    out, inputs = weight.shape
    blocks = weight.to(torch.float32).reshape(out // rows, rows, inputs // columns, columns)
    absmax = blocks.abs().amax(dim=(1, 3))  # (out / rows, in / columns)
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    scaled = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return scaled.reshape(out, inputs).to(torch.float8_e4m3fn), scale


def write_checkpoint(block: tuple[int, int]) -> None:
    """The qwen3 checkpoint with its decoder linear weights quantized in blocks of `block`, in DESTINATION."""
    DESTINATION.mkdir(exist_ok=True)
    tensors = {}
    for name, tensor in load_file(SOURCE / "model.safetensors").items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEAR:
            tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(tensor, block)
        else:
            tensors[name] = tensor
    save_file(tensors, DESTINATION / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        shutil.copy(SOURCE / name, DESTINATION / name)
    config = json.loads((SOURCE / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": list(block)}
    (DESTINATION / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    prompts = json.loads((SOURCE / "expected.json").read_text())["prompts"]
    for block in BLOCKS:
        write_checkpoint(block)
        model = AutoModelForCausalLM.from_pretrained(DESTINATION, local_files_only=True,
                                                     attn_implementation="eager", dtype=torch.float32).eval()
        kinds = {type(module).__name__ for module in model.modules()}
        assert "FP8Linear" not in kinds, f"transformers kept fp8 layers ({kinds}): the reference must be dequantized"
        outputs, min_margin, logits = reference_outputs(model, prompts)
        print(f"block {block}: min margin {min_margin:.4f}")
        if min_margin >= MIN_MARGIN:
            break
    else:
        raise SystemExit(f"no block of {BLOCKS} keeps every margin above {MIN_MARGIN}")
    expected = {"prompts": prompts, "outputs": outputs, "min_margin": min_margin, "block": list(block),
                "torch_version": torch.__version__, "transformers_version": transformers.__version__,
                "python_version": platform.python_version()}
    (DESTINATION / "expected.json").write_text(json.dumps(expected) + "\n")
    np.save(DESTINATION / "expected_logits.npy", logits)
    size = (DESTINATION / "model.safetensors").stat().st_size
    print(f"wrote {DESTINATION} ({size / 1e3:.0f} KB), block {block}, min margin {min_margin:.4f}")


if __name__ == "__main__":
    main()
