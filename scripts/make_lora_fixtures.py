"""Make two LoRA adapters for the bundled model with PEFT, and record Hugging Face's greedy outputs with each.

Needs torch and peft (fixtures only, not the runtime):
    python scripts/make_lora_fixtures.py
Writes tests/fixtures/lora/{alpha,beta}/ (PEFT folders, as `save_pretrained` writes them) and
tests/fixtures/lora/expected.json (prompts, the greedy tokens of the base model and of each adapter, the smallest
top-1 minus top-2 logit gap), so the test needs neither torch nor peft in CI.

- alpha: rank 8, lora_alpha 16, every attention and MLP projection;
- beta: rank 4, lora_alpha 8 with rsLoRA's scale (alpha / sqrt(r)), q_proj and v_proj only, layers 1 and 3 only
  (exercises rank padding, partial targets and layers without the adapter).

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

MODEL = ROOT / "jaxserve" / "assets" / "tiny-stdlib-llama"
OUT = ROOT / "tests" / "fixtures" / "lora"
PROMPTS = [[0, 459, 286, 1228, 269, 1166, 559, 10, 80, 303], [0, 728, 621, 201], [0, 1132, 1478, 1036, 26],
           [0, 40, 17, 3000, 88, 912, 1544]]
NUM_NEW_TOKENS = 16
MIN_MARGIN = 0.02
ADAPTERS = {
    "alpha": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"]),
    "beta": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"], layers_to_transform=[1, 3]),
}


def base_model():
    return AutoModelForCausalLM.from_pretrained(MODEL, local_files_only=True, attn_implementation="eager").eval()


def outputs_of(model) -> tuple[list[list[int]], float]:
    """Greedy tokens of every prompt and the smallest margin over all steps."""
    outputs, margins = [], []
    for prompt in PROMPTS:
        tokens, margin, _ = greedy_decode(model, prompt, NUM_NEW_TOKENS)
        outputs.append(tokens)
        margins.append(margin)
    return outputs, min(margins)


def make_adapter(name: str, options: dict, base_outputs: list[list[int]]) -> tuple[list[list[int]], float, int]:
    """Save adapter `name` and return (its greedy outputs, min margin, seed)."""
    for seed in range(100):
        torch.manual_seed(seed)
        config = peft.LoraConfig(lora_dropout=0.0, init_lora_weights=False, task_type="CAUSAL_LM", **options)
        model = peft.get_peft_model(base_model(), config).eval()
        with torch.no_grad():  # random A and B are too small to change a greedy token: make them count
            for module_name, parameter in model.named_parameters():
                if "lora_" in module_name:
                    parameter.mul_(4.0)
        outputs, margin = outputs_of(model)
        changed = sum(a != b for a, b in zip(outputs, base_outputs))
        if margin >= MIN_MARGIN and changed == len(PROMPTS):
            folder = OUT / name
            shutil.rmtree(folder, ignore_errors=True)
            model.save_pretrained(folder)
            (folder / "README.md").unlink()  # PEFT's model card template: nothing the tests read
            return outputs, margin, seed
        print(f"  {name}: seed {seed} margin {margin:.3g}, {changed} of {len(PROMPTS)} outputs changed; re-rolling")
    raise RuntimeError(f"no seed gave adapter {name} clear margins")


def main() -> None:
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    base_outputs, base_margin = outputs_of(base_model())
    expected = {"prompts": PROMPTS, "base": {"outputs": base_outputs, "min_margin": base_margin}}
    for name, options in ADAPTERS.items():
        outputs, margin, seed = make_adapter(name, options, base_outputs)
        expected[name] = {"outputs": outputs, "min_margin": margin, "seed": seed}
        print(f"{name}: seed {seed}, min margin {margin:.3g}")
    expected.update(torch_version=torch.__version__, transformers_version=transformers.__version__,
                    peft_version=peft.__version__)
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main()
