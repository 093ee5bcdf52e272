"""Record Hugging Face transformers' prompt log-probabilities, the reference for `prompt_logprobs` / `echo`.

Needs torch and transformers (not needed by CI). From the repository root:
    python scripts/make_prompt_logprob_fixtures.py
Writes
  tests/fixtures/default_model_prompt_logprobs.json (text prompts on the bundled tiny-stdlib-llama,
      tokenized as the engine does: `tokenizer.encode(text)`, which prepends BOS), and
  tests/fixtures/checkpoints/<name>/expected_prompt_logprobs.json for llama, qwen2 and mistral
      (the token-id prompts of that folder's expected.json).
Each prompt runs once through the model (float32, eager attention, full forward, no KV cache). Entry i > 0
of every per-token list describes prompt token i under log_softmax(logits at position i - 1); entry 0 is
null (the first token has no context). rank = 1 + number of logits strictly greater than the token's.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "jaxserve" / "assets" / "tiny-stdlib-llama"
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "default_model_prompt_logprobs.json"
CHECKPOINTS = ROOT / "tests" / "fixtures" / "checkpoints"
CHECKPOINT_NAMES = ("llama", "qwen2", "mistral")
TOP_K = 5
DEFAULT_PROMPTS = [
    "def fibonacci(n):\n    return",
    "import os\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    (
        "def read_config(path):\n"
        '    """Read a key=value file into a dict."""\n'
        "    result = {}\n"
        "    with open(path) as f:\n"
        "        for line in f:\n"
        "            line = line.strip()\n"
        "            if not line or line.startswith('#'):\n"
        "                continue\n"
        "            key, _, value = line.partition('=')\n"
        "            result[key.strip()] = value.strip()\n"
        "    return result\n"
    ),
]


def load_model(path: Path) -> torch.nn.Module:
    """The HF causal LM at `path`, float32, eager attention, in eval mode."""
    return AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, attn_implementation="eager", dtype=torch.float32
    ).eval()


def prompt_logprobs(model: torch.nn.Module, token_ids: list[int]) -> dict[str, list]:
    """Per-token log-probabilities, ranks and top-k of `token_ids` under one full forward (no KV cache).

    Every list has one entry per prompt token, the first None. `rank_margins[i]` is the smallest
    |logit_j - logit_token| over j != token (how far rank i is from a tie) and `top5_gaps[i]` the smallest
    gap between consecutive logits of the top 6 (how far the top-5 ids and their order are from a tie), so
    a test can skip positions whose rank or top-5 may flip on float32 rounding.
    """
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0].to(torch.float32)  # (T, V)
    logits = logits[:-1]  # (T-1, V): position i-1 predicts token i
    targets = torch.tensor(token_ids[1:])  # (T-1,)
    logprobs = torch.log_softmax(logits, dim=-1)  # (T-1, V)
    token_logits = logits.gather(1, targets[:, None])  # (T-1, 1)
    ranks = 1 + (logits > token_logits).sum(dim=1)  # (T-1,)
    top_values, top_ids = torch.topk(logprobs, TOP_K + 1, dim=-1)  # (T-1, K+1) each
    others = (logits - token_logits).abs().scatter(1, targets[:, None], float("inf"))  # (T-1, V)
    top_logits = logits.gather(1, top_ids)  # (T-1, K+1)
    none = [None]
    return {
        "prompt_token_ids": list(token_ids),
        "token_logprobs": none + logprobs.gather(1, targets[:, None])[:, 0].tolist(),
        "top1_ids": none + top_ids[:, 0].tolist(),
        "top1_logprobs": none + top_values[:, 0].tolist(),
        "top5_ids": none + top_ids[:, :TOP_K].tolist(),
        "top5_logprobs": none + top_values[:, :TOP_K].tolist(),
        "ranks": none + ranks.tolist(),
        "rank_margins": none + others.min(dim=1).values.tolist(),
        "top5_gaps": none + (top_logits[:, :-1] - top_logits[:, 1:]).min(dim=1).values.tolist(),
    }


def check_case(case: dict[str, list]) -> None:
    """Raise AssertionError when a case's numbers are not sane (logprob <= 0, top-1 >= token, sorted top-5)."""
    for i in range(1, len(case["prompt_token_ids"])):
        token_lp, top1_lp, rank = case["token_logprobs"][i], case["top1_logprobs"][i], case["ranks"][i]
        assert token_lp <= 0.0 and top1_lp <= 0.0, (i, token_lp, top1_lp)
        assert top1_lp >= token_lp, (i, top1_lp, token_lp)
        assert case["top5_logprobs"][i] == sorted(case["top5_logprobs"][i], reverse=True)
        assert case["top5_ids"][i][0] == case["top1_ids"][i]
        assert rank >= 1 and (rank == 1) == (token_lp == top1_lp), (i, rank, token_lp, top1_lp)
        if rank <= TOP_K and case["rank_margins"][i] > 0:
            assert case["top5_ids"][i][rank - 1] == case["prompt_token_ids"][i], (i, rank)


def provenance() -> dict[str, str]:
    """Versions that produced the numbers."""
    return {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "python_version": platform.python_version()}


def to_json(fixture: dict) -> str:
    """`fixture` as JSON with one line per case field (compact, yet diffs show which field changed)."""
    def fields(case: dict) -> str:
        return "{\n" + ",\n".join(f"   {json.dumps(k)}: {json.dumps(v)}" for k, v in case.items()) + "\n  }"
    cases = ",\n  ".join(fields(case) for case in fixture["cases"])
    rest = "".join(f",\n {json.dumps(k)}: {json.dumps(v)}" for k, v in fixture.items() if k != "cases")
    return "{\n \"cases\": [\n  " + cases + "\n ]" + rest + "\n}"


def write(path: Path, cases: list[dict]) -> None:
    """Check every case and write `{"cases": ..., provenance}` to `path`."""
    for case in cases:
        check_case(case)
    path.write_text(to_json({"cases": cases, **provenance()}) + "\n")
    print(f"wrote {path} ({len(cases)} cases)")


def default_model_cases() -> list[dict]:
    """Cases for the text prompts on the bundled default model, tokenized as the engine does."""
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL, local_files_only=True)
    model = load_model(DEFAULT_MODEL)
    cases = []
    for text in DEFAULT_PROMPTS:
        cases.append({"prompt": text, **prompt_logprobs(model, tokenizer.encode(text))})
        print(f"{len(cases[-1]['prompt_token_ids']):3d} tokens, ranks {cases[-1]['ranks'][1:]}")
    return cases


def checkpoint_cases(name: str) -> list[dict]:
    """Cases for the token-id prompts of one fixture checkpoint's expected.json."""
    folder = CHECKPOINTS / name
    prompts = json.loads((folder / "expected.json").read_text())["prompts"]
    model = load_model(folder)
    return [prompt_logprobs(model, prompt) for prompt in prompts]


def main() -> None:
    """Write the default-model fixture and one fixture per checkpoint."""
    torch.set_num_threads(1)
    write(DEFAULT_OUT, default_model_cases())
    for name in CHECKPOINT_NAMES:
        write(CHECKPOINTS / name / "expected_prompt_logprobs.json", checkpoint_cases(name))


if __name__ == "__main__":
    main()
