"""Record Hugging Face transformers' pooled final hidden states, the reference for embeddings (`LLM.embed`,
/v1/embeddings).

Needs torch and transformers (not needed by CI). From the repository root:
    python scripts/make_embedding_fixtures.py
Writes tests/fixtures/checkpoints/<name>/expected_embeddings.json for llama, qwen3 (the architecture of
Qwen3-Embedding) and gemma2, over the token-id prompts of that folder's expected.json: for each prompt, the
base model's `last_hidden_state` (after the final norm; float32, eager attention, one full forward) pooled
three ways, not normalized: LAST (the last prompt token's state), MEAN (the mean over the prompt), CLS (the first
token's).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModel  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = ROOT / "tests" / "fixtures" / "checkpoints"
CHECKPOINT_NAMES = ("llama", "qwen3", "gemma2")


def pooled_states(model: torch.nn.Module, token_ids: list[int]) -> dict[str, list]:
    """The prompt's final hidden states (T, H) pooled LAST, MEAN and CLS, each (H,)."""
    with torch.no_grad():
        states = model(input_ids=torch.tensor([token_ids]), use_cache=False).last_hidden_state[0]  # (T, H)
    states = states.to(torch.float32)
    return {"prompt_token_ids": list(token_ids), "LAST": states[-1].tolist(), "MEAN": states.mean(dim=0).tolist(),
            "CLS": states[0].tolist()}


def main() -> None:
    for name in CHECKPOINT_NAMES:
        folder = CHECKPOINTS / name
        model = AutoModel.from_pretrained(folder, local_files_only=True, attn_implementation="eager",
                                          dtype=torch.float32).eval()
        prompts = json.loads((folder / "expected.json").read_text())["prompts"]
        cases = [pooled_states(model, prompt) for prompt in prompts]
        fixture = {"cases": cases, "torch_version": torch.__version__,
                   "transformers_version": transformers.__version__, "python_version": platform.python_version()}
        path = folder / "expected_embeddings.json"
        path.write_text(json.dumps(fixture) + "\n")
        print(f"wrote {path} ({len(cases)} prompts, hidden size {len(cases[0]['LAST'])})")


if __name__ == "__main__":
    main()
