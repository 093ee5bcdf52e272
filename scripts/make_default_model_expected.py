"""Record Hugging Face transformers' greedy outputs on the bundled default model, as a test fixture.

Run after `scripts/train_default_model.py` (needs torch):
    python scripts/make_default_model_expected.py
Writes tests/fixtures/default_model_expected.json, so the test needs no torch in CI.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from make_test_checkpoints import greedy_decode  # noqa: E402

MODEL = ROOT / "jaxserve" / "assets" / "tiny-stdlib-llama"
OUT = ROOT / "tests" / "fixtures" / "default_model_expected.json"
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "    for i in range(", "# Copyright"]
NUM_NEW_TOKENS = 32


def main() -> None:
    """Tokenize the prompts with the HF tokenizer and greedy-decode each with the HF model."""
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(MODEL, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(MODEL, local_files_only=True, attn_implementation="eager").eval()
    cases = []
    for prompt in PROMPTS:
        prompt_ids = tokenizer.encode(prompt)
        tokens, margin, _ = greedy_decode(model, prompt_ids, NUM_NEW_TOKENS)
        cases.append({"prompt": prompt, "prompt_token_ids": prompt_ids, "output_token_ids": tokens,
                      "min_margin": margin, "text": tokenizer.decode(tokens)})
        print(repr(prompt + tokenizer.decode(tokens)), f"(min margin {margin:.4f})")
    OUT.write_text(json.dumps({"cases": cases, "torch_version": torch.__version__,
                               "transformers_version": transformers.__version__}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
