"""Make LoRA adapters with PEFT for the bundled model and two test checkpoints, and record Hugging Face's greedy
outputs with each.

Needs torch and peft (fixtures only, not the runtime):
    python scripts/make_lora_fixtures.py
Writes tests/fixtures/lora/<adapter>/ (PEFT folders, as `save_pretrained` writes them) and
tests/fixtures/lora/expected.json (per base model: its prompts, the greedy tokens of the base model and of each
of its adapters, the smallest top-1 minus top-2 logit gap), so the tests need neither torch nor peft in CI.

The bundled model:
- alpha: rank 8, lora_alpha 16, every attention and MLP projection;
- beta: rank 4, lora_alpha 8 with rsLoRA's scale (alpha / sqrt(r)), q_proj and v_proj only, layers 1 and 3 only
  (exercises rank padding, partial targets and layers without the adapter).
tests/fixtures/checkpoints/gemma2: gemma-lora, rank 8, every attention and MLP projection.
tests/fixtures/checkpoints/qwen3-moe: moe-lora, rank 8, the attention projections (experts take no adapters).
tests/fixtures/checkpoints/phi3: phi3-lora, rank 8, every projection as Phi-3 has them (qkv_proj, gate_up_proj
fused).

The adapters' A and B are random (`init_lora_weights=False`), scaled up until the greedy outputs differ from the
base model's; the seed is re-rolled until every greedy step has a clear margin.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from make_test_checkpoints import greedy_decode  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "lora"
CHECKPOINTS = ROOT / "tests" / "fixtures" / "checkpoints"
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# base model name -> (its folder, its prompts, {adapter name: LoraConfig options})
BASES = {
    "bundled": (ROOT / "jaxserve" / "assets" / "tiny-stdlib-llama",
                [[0, 459, 286, 1228, 269, 1166, 559, 10, 80, 303], [0, 728, 621, 201], [0, 1132, 1478, 1036, 26],
                 [0, 40, 17, 3000, 88, 912, 1544]],
                {"alpha": dict(r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS),
                 "beta": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"],
                              layers_to_transform=[1, 3])}),
    "gemma2": (CHECKPOINTS / "gemma2", None, {"gemma-lora": dict(r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS)}),
    "qwen3-moe": (CHECKPOINTS / "qwen3-moe", None,
                  {"moe-lora": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])}),
    "phi3": (CHECKPOINTS / "phi3", None,
             {"phi3-lora": dict(r=8, lora_alpha=16,
                                target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])}),
}
NUM_NEW_TOKENS = 16
MIN_MARGIN = 0.02


def base_model(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="eager").eval()


def prompts_of(folder: Path, prompts: list[list[int]] | None) -> list[list[int]]:
    """The given prompts, or the first three of a test checkpoint's expected.json."""
    return prompts or json.loads((folder / "expected.json").read_text())["prompts"][:3]


def outputs_of(model, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    """Greedy tokens of every prompt and the smallest margin over all steps."""
    outputs, margins = [], []
    for prompt in prompts:
        tokens, margin, _ = greedy_decode(model, prompt, NUM_NEW_TOKENS)
        outputs.append(tokens)
        margins.append(margin)
    return outputs, min(margins)


def make_adapter(folder: Path, prompts: list[list[int]], name: str, options: dict,
                 base_outputs: list[list[int]]) -> tuple[list[list[int]], float, int]:
    """Save adapter `name` of the model in `folder` and return (its greedy outputs, min margin, seed)."""
    for seed in range(100):
        torch.manual_seed(seed)
        config = peft.LoraConfig(lora_dropout=0.0, init_lora_weights=False, task_type="CAUSAL_LM", **options)
        model = peft.get_peft_model(base_model(folder), config).eval()
        with torch.no_grad():  # random A and B are too small to change a greedy token: make them count
            for module_name, parameter in model.named_parameters():
                if "lora_" in module_name:
                    parameter.mul_(4.0)
        outputs, margin = outputs_of(model, prompts)
        changed = sum(a != b for a, b in zip(outputs, base_outputs))
        if margin >= MIN_MARGIN and changed == len(prompts):
            folder = OUT / name
            shutil.rmtree(folder, ignore_errors=True)
            model.save_pretrained(folder)
            (folder / "README.md").unlink()  # PEFT's model card template: nothing the tests read
            return outputs, margin, seed
        print(f"  {name}: seed {seed} margin {margin:.3g}, {changed} of {len(prompts)} outputs changed; re-rolling")
    raise RuntimeError(f"no seed gave adapter {name} clear margins")


def main() -> None:
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    expected = {}
    for base, (folder, given_prompts, adapters) in BASES.items():
        prompts = prompts_of(folder, given_prompts)
        base_outputs, base_margin = outputs_of(base_model(folder), prompts)
        cases = {"prompts": prompts, "base": {"outputs": base_outputs, "min_margin": base_margin}}
        for name, options in adapters.items():
            outputs, margin, seed = make_adapter(folder, prompts, name, options, base_outputs)
            cases[name] = {"outputs": outputs, "min_margin": margin, "seed": seed}
            print(f"{base} {name}: seed {seed}, min margin {margin:.3g}")
        expected[base] = cases
    expected.update(torch_version=torch.__version__, transformers_version=transformers.__version__,
                    peft_version=peft.__version__)
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main()
