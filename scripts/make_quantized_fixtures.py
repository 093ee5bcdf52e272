"""Make the quantized test checkpoints and record what Hugging Face transformers generates from them, the
reference for serving quantized checkpoints as they are stored.

Needs torch, transformers, accelerate, compressed-tensors and auto-gptq (transformers reads an fp8 checkpoint only
with accelerate and an int4 one only with compressed-tensors; auto-gptq's QuantLinear is the GPTQ reference; none of
them is needed by CI). From the repository root:
    python scripts/make_quantized_fixtures.py
Writes, each written by jaxserve/bench/quantized_checkpoint.py from a float test checkpoint:
- tests/fixtures/checkpoints/qwen3-fp8-block/, qwen3-moe-fp8-block/ and deepseek-v3-fp8-block/: every decoder
  linear weight (q, k, v, o, and gate, up, down, each expert's in the MoE; DeepSeek-V3's q_a, q_b, kv_a, kv_b and
  its shared experts' too) float8_e4m3fn with a float32 `weight_scale_inv` per block, and config.json's
  quantization_config {"quant_method": "fp8", "weight_block_size": [rows, columns], ...} as Qwen3-FP8 and
  DeepSeek-V3 ship it. Transformers dequantizes each weight block by block at load on the CPU.
- tests/fixtures/checkpoints/llama-int4/ and qwen3-moe-int4/: the weights of `llama` (`qwen3-moe`, each expert's
  too) in compressed-tensors' pack-quantized W4A16 form (int4 packed eight to an int32, a scale per group of
  input columns), as llm-compressor writes it. Transformers reads it through compressed-tensors, which unpacks
  and dequantizes it (into transformers' fused experts too).
- tests/fixtures/checkpoints/qwen3-int4-asym/ and qwen3-moe-int4-asym/: the same form asymmetric (a zero point per
  group, `weight_zero_point` packed along the outputs: llm-compressor's W4A16_ASYM, which its AWQ writes).
  Transformers 5.24 with compressed-tensors 0.20 cannot load this form (it makes the zero-point parameters in
  their unpacked shape, (out, groups), and refuses the packed (out / 8, groups) that compressed-tensors' own
  compressor writes), so the reference is the float model with each linear weight replaced by what
  compressed-tensors' `PackedQuantizationCompressor.decompress` makes of the stored tensors, run by transformers.
- tests/fixtures/checkpoints/qwen2-awq/ and qwen3-moe-awq/: `qwen2` (Qwen2.5's architecture) and `qwen3-moe`
  (each expert's projections) in AutoAWQ's GEMM form (`qweight`,
  `qzeros`, `scales`; quant_method awq), as the published -AWQ checkpoints are. Transformers reads AWQ only through
  gptqmodel (a CUDA build), so the reference is compressed-tensors' own AutoAWQ converter
  (`AutoAWQConverter.process`) followed by the decompression above.
- tests/fixtures/checkpoints/qwen2-gptq-asym/, qwen3-moe-gptq/ and qwen3-gptq-channel/: GPTQ's "gptq" format
  (`qweight`, `qzeros` stored less one, `scales`, `g_idx`; quant_method gptq) as AutoGPTQ and GPTQModel save it:
  qwen2 asymmetric in groups, the MoE symmetric in groups (Qwen's GPTQ-Int4 form), qwen3 symmetric per output
  channel (group_size -1); qwen2-gptq-act-order/ and qwen3-moe-gptq-act-order/ (symmetric, and asymmetric)
  with act-order (`desc_act`: each weight's rows grouped in a permuted order, `g_idx` saying which);
  llama-gptq-int8/ in 8 bits, symmetric in groups (Qwen's GPTQ-Int8 form).
  Transformers reads GPTQ only through gptqmodel (a CUDA build), so the reference is the
  float model with each linear weight replaced by what AutoGPTQ's own QuantLinear (auto_gptq 0.7.1's
  nn_modules/qlinear/qlinear_cuda.py, its torch path; only that file is loaded, not the package) computes from
  the stored tensors, its scales in float32. Install it apart, since its wheel also holds a top-level `tests`
  package that would shadow this repository's: `pip install --no-deps --target /tmp/auto-gptq auto-gptq==0.7.1`,
  then `PYTHONPATH=/tmp/auto-gptq python scripts/make_quantized_fixtures.py qwen2-gptq-asym ...`.
- tests/fixtures/checkpoints/gpt-oss-mxfp4/: `gpt-oss` with its experts' gate_up_proj and down_proj in MXFP4 as
  openai/gpt-oss-20b and -120b store them (`_blocks` uint8 (E, out, in / 32, 16), two FP4 e2m1 codes to a byte,
  `_scales` uint8 (E, out, in / 32), a power-of-two scale per 32 inputs; quant_method mxfp4), written by our own
  quantizer from the weights rounded to bfloat16 (the rules: jaxserve/bench/quantized_checkpoint.py's docstring;
  the candidates are its scale rules, "fit" then "ocp", the block being the format's 32; the biases stay float32).
  The reference is transformers loading the folder with Mxfp4Config(dequantize=True) (on the CPU it dequantizes
  the experts as they load, into the model's float32), checked to hold exactly what jaxserve's own reader
  (model/loader.py's Mxfp4Experts) makes of the stored blocks; its expected.json also records the smallest router
  margin (k-th minus (k + 1)-th router logit) over every token, which must stay above make_test_checkpoints.py's
  MIN_ROUTER_MARGIN too, since the quantized experts move the later layers' router inputs.
The embeddings, norms, routers and LM head stay as they were. Each folder gets expected.json (the source's
prompts, greedy tokens, the smallest top-1 margin) and expected_logits.npy (each prompt's last-position logits)
as the other checkpoints have. The block or group is the first of the candidates whose greedy tokens keep every
top-1 margin above make_test_checkpoints.py's MIN_MARGIN (so float rounding cannot flip a token).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = ROOT / "tests" / "fixtures" / "checkpoints"
# fixture -> (source, writer, candidate blocks or groups), each dividing every weight's shape: the MoE's experts
# are (32, 64) and (64, 32); blocks of 16 columns leave whole blocks to each of two tensor-parallel devices.
FIXTURES = {"qwen3-fp8-block": ("qwen3", "fp8", ((32, 32), (32, 64), (64, 32), (64, 64))),
            "qwen3-moe-fp8-block": ("qwen3-moe", "fp8", ((16, 16), (32, 16), (16, 32), (32, 32))),
            # DeepSeek-V3's inputs are 24 (kv_b_proj), 32, 48 and 64 wide: columns of 8; a block taller than wide
            "deepseek-v3-fp8-block": ("deepseek-v3", "fp8", ((16, 8), (8, 8))),
            "llama-int4": ("llama", "int4", (16, 32, 8, 64)),
            "qwen3-moe-int4": ("qwen3-moe", "int4", (16, 8, 32)),
            "qwen3-int4-asym": ("qwen3", "int4-asym", (16, 32, 8)),
            "qwen3-moe-int4-asym": ("qwen3-moe", "int4-asym", (16, 8, 32)),
            "qwen2-awq": ("qwen2", "awq", (16, 32, 8)),
            "qwen3-moe-awq": ("qwen3-moe", "awq", (16, 8, 32)),
            "qwen2-gptq-asym": ("qwen2", "gptq-asym", (16, 32, 8)),
            "qwen3-moe-gptq": ("qwen3-moe", "gptq", (16, 8, 32)),
            "qwen3-gptq-channel": ("qwen3", "gptq", (None,)),
            "qwen2-gptq-act-order": ("qwen2", "gptq-act-order", (16, 32, 8)),
            "qwen3-moe-gptq-act-order": ("qwen3-moe", "gptq-asym-act-order", (16, 8, 32)),
            "llama-gptq-int8": ("llama", "gptq-int8", (16, 32, 8)),
            "gpt-oss-mxfp4": ("gpt-oss", "mxfp4", ("fit", "ocp"))}  # MXFP4's block is 32: its scale rule varies

# fixtures whose routers' margins are kept too (make_test_checkpoints.py's, its DeepSeek floor), since their
# quantized weights move the later layers' router inputs
ROUTERS_CHECKED = ("gpt-oss-mxfp4", "deepseek-v3-fp8-block")

sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
from make_test_checkpoints import (  # noqa: E402
    MIN_MARGIN,
    MIN_ROUTER_MARGIN,
    ROUTER_MARGIN_OVERRIDES,
    reference_outputs,
    router_margins,
)

from jaxserve.bench.quantized_checkpoint import (  # noqa: E402
    write_awq_checkpoint, write_fp8_block_checkpoint, write_gptq_checkpoint, write_int4_checkpoint,
    write_mxfp4_checkpoint,
)

WRITERS = {"fp8": write_fp8_block_checkpoint, "int4": write_int4_checkpoint,
           "int4-asym": lambda source, destination, group: write_int4_checkpoint(source, destination, group, False),
           "awq": write_awq_checkpoint, "gptq": write_gptq_checkpoint,
           "gptq-asym": lambda source, destination, group: write_gptq_checkpoint(source, destination, group, False),
           "gptq-act-order": lambda source, destination, group: write_gptq_checkpoint(source, destination, group,
                                                                                      act_order=True),
           "gptq-asym-act-order": lambda source, destination, group: write_gptq_checkpoint(source, destination, group,
                                                                                           False, True),
           "gptq-int8": lambda source, destination, group: write_gptq_checkpoint(source, destination, group, bits=8),
           "mxfp4": write_mxfp4_checkpoint}


def make(name: str) -> None:
    """Write fixture `name` with the first candidate block or group that keeps the margins, and its expected
    outputs."""
    source_name, form, candidates = FIXTURES[name]
    source, destination = CHECKPOINTS / source_name, CHECKPOINTS / name
    prompts = json.loads((source / "expected.json").read_text())["prompts"]
    for block in candidates:
        WRITERS[form](str(source), str(destination), block)
        decompressed = form in ("int4-asym", "awq") or form.startswith("gptq")
        extra = {"quantization_config": transformers.Mxfp4Config(dequantize=True)} if form == "mxfp4" else {}
        model = AutoModelForCausalLM.from_pretrained(source if decompressed else destination, local_files_only=True,
                                                     attn_implementation="eager", dtype=torch.float32, **extra).eval()
        if decompressed:
            tensors = stored_tensors(destination, form, block)
            copy_into(model, gptq_weights(tensors) if form.startswith("gptq") else decompressed_weights(tensors, block))
        kinds = {type(module).__name__ for module in model.modules()}
        assert not kinds & {"FP8Linear", "Mxfp4GptOssExperts"}, \
            f"transformers kept quantized layers ({kinds}): the reference must be dequantized"
        if form == "mxfp4":
            check_mxfp4_experts(model, destination, source, block)
        with router_margins(model) as routers:
            outputs, min_margin, logits = reference_outputs(model, prompts)
        min_router = min(routers) if routers and name in ROUTERS_CHECKED else None
        router_floor = ROUTER_MARGIN_OVERRIDES.get(source_name, MIN_ROUTER_MARGIN)
        print(f"{name} block {block}: min margin {min_margin:.4f}, min router margin {min_router}")
        if min_margin >= MIN_MARGIN and (min_router is None or min_router >= router_floor):
            break
    else:
        raise SystemExit(f"no block of {candidates} keeps every margin of {name} above {MIN_MARGIN} (routers': "
                         f"{router_floor})")
    expected = {"prompts": prompts, "outputs": outputs, "min_margin": min_margin,
                **({"min_router_margin": min_router} if min_router is not None else {}), "block": block,
                "torch_version": torch.__version__, "transformers_version": transformers.__version__,
                "python_version": platform.python_version()}
    (destination / "expected.json").write_text(json.dumps(expected) + "\n")
    np.save(destination / "expected_logits.npy", logits)
    size = (destination / "model.safetensors").stat().st_size
    print(f"wrote {destination} ({size / 1e3:.0f} KB), block {block}, min margin {min_margin:.4f}")


def check_mxfp4_experts(model: torch.nn.Module, folder: Path, source: Path, rule: str) -> None:
    """Assert that transformers dequantized `folder`'s MXFP4 experts into `model` exactly as jaxserve's reader does
    (model/loader.py's Mxfp4Experts over the stored blocks and scales), each within half an FP4 step of the float
    `source`'s weight (a step is at most 2 at the block's scale, the gap between 4 and 6; under the "ocp" scale rule
    2, a value up to 8 clamped to 6) and bfloat16's rounding of it."""
    from jaxserve.model.loader import Mxfp4Experts, SafetensorsFolder

    stored, floats = Mxfp4Experts(SafetensorsFolder(str(folder))), SafetensorsFolder(str(source))
    for i, layer in enumerate(model.model.layers):
        for projection in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{projection}"
            assert name not in SafetensorsFolder(str(folder)) and name + "_blocks" in stored, name
            loaded = getattr(layer.mlp.experts, projection).detach().numpy()  # (E, in, out)
            ours = stored.get(name).astype(np.float32)
            assert loaded.dtype == np.float32 and np.array_equal(loaded, ours), f"{name}: transformers differs"
            scale = np.repeat(np.ldexp(1.0, stored.source.get(name + "_scales").astype(np.int64) - 127), 32, axis=-1)
            weight = floats.get(name)  # (E, in, out)
            bound = np.swapaxes(scale, -1, -2) * (2 if rule == "ocp" else 1) + np.abs(weight) * 2.0**-8
            assert np.all(np.abs(ours - weight) <= bound), f"{name}: off the float"


def stored_tensors(folder: Path, form: str, group_size: int) -> dict[str, torch.Tensor]:
    """`folder`'s tensors as stored, or an AWQ checkpoint's in compressed-tensors' asymmetric int4 form (through
    compressed-tensors' AutoAWQ converter)."""
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    if form != "awq":
        return tensors
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    return AutoAWQConverter(group_size=group_size).process(tensors)


def decompressed_weights(tensors: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    """Each quantized linear weight (out, in) of asymmetric int4 `tensors` as compressed-tensors decompresses it."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=group_size))
    weights = {}
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        module = name[: -len("weight_packed")]
        stored = {part: tensors[module + part] for part in ("weight_packed", "weight_scale", "weight_zero_point",
                                                            "weight_shape")}
        stored["weight_scale"] = stored["weight_scale"].float()  # AWQ's float16 scales: dequantize in float32
        weights[module + "weight"] = PackedQuantizationCompressor.decompress(stored, scheme)["weight"]
    return weights


def gptq_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each linear weight (out, in) of GPTQ `tensors` as AutoGPTQ's QuantLinear computes it (its torch path, the
    product of the identity), its float16 scales in float32."""
    import importlib.util

    package = importlib.util.find_spec("auto_gptq").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location("qlinear_cuda", f"{package}/nn_modules/qlinear/qlinear_cuda.py")
    qlinear = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qlinear)
    weights = {}
    for name in [n for n in tensors if n.endswith(".qweight")]:
        module = name[: -len("qweight")]
        words, out = tensors[name].shape
        groups, inputs = tensors[module + "scales"].shape[0], tensors[module + "g_idx"].shape[0]
        bits = 32 * words // inputs
        layer = qlinear.QuantLinear(bits, inputs // groups, inputs, out, bias=False, weight_dtype=torch.float32)
        layer.qweight, layer.qzeros = tensors[name], tensors[module + "qzeros"]
        layer.scales, layer.g_idx = tensors[module + "scales"].float(), tensors[module + "g_idx"]
        with torch.no_grad():
            weights[module + "weight"] = layer(torch.eye(inputs)).T.contiguous()
    return weights


def copy_into(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Overwrite each quantized linear weight of `model` (the float source's, in transformers' layout) with its
    dequantized `weights` (out, in) by name."""
    fused = {}  # transformers' fused MoE experts: (E, 2 * I, H) gate_up_proj, (E, H, I) down_proj
    for name, weight in weights.items():
        if ".experts." not in name:
            model.get_parameter(name).data.copy_(weight)
            continue
        prefix, rest = name.split(".experts.")
        expert, projection = rest.split(".")[:2]
        fused.setdefault(prefix, {}).setdefault(projection, {})[int(expert)] = weight
    for prefix, projections in fused.items():
        stacked = {p: torch.stack([e[i] for i in sorted(e)]) for p, e in projections.items()}
        experts = model.get_submodule(prefix + ".experts")
        experts.gate_up_proj.data.copy_(torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1))
        experts.down_proj.data.copy_(stacked["down_proj"])
    model.config.quantization_config = None


def main() -> None:
    for name in sys.argv[1:] or FIXTURES:
        make(name)


if __name__ == "__main__":
    main()
