"""Make the sequence classifier test checkpoints and record Hugging Face transformers' outputs for them, the
reference for `LLM.classify`, /classify, /pooling and a cross-encoder's score and rerank.

Needs torch and transformers (not needed by CI). From the repository root:
    python scripts/make_classifier_fixtures.py
Each classifier is a test language model's body (tests/fixtures/checkpoints/<base>) under a seeded random score
head, saved by transformers' `XForSequenceClassification.save_pretrained` with the base's tokenizer files:
- llama-classifier: LlamaForSequenceClassification, 3 named labels (softmax);
- qwen3-cross-encoder: Qwen3ForSequenceClassification, 1 label (a cross-encoder or reward model: sigmoid);
- gemma2-classifier: Gemma2ForSequenceClassification, 2 labels, multi-label (sigmoid each);
- qwen3-token-classifier: Qwen3ForTokenClassification (`AutoModelForTokenClassification`), 4 named labels, its
  score head with a bias (softmax per token).
The score head is drawn with a larger spread than transformers' initializer (std 3 / sqrt(hidden); 0.2 over
Gemma's larger final states), so the classes' probabilities differ clearly. expected_classes.json holds, for each
token-id prompt of the base's expected.json, the logits (float32, eager attention, one full forward; no prompt
ends with the pad token, so transformers pools its last token as the engine does), the score head over every
prompt token's final state (`token_logits`, the token_classify reference) and, for the cross-encoder, the logit
of each text pair of PAIRS tokenized together.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer,
)

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = ROOT / "tests" / "fixtures" / "checkpoints"
SEED = 20261203
# (name, base checkpoint, the score head's spread times sqrt(hidden), classifier config fields)
CLASSIFIERS = (
    ("llama-classifier", "llama", 3.0, {"id2label": {0: "negative", 1: "neutral", 2: "positive"}}),
    ("qwen3-cross-encoder", "qwen3", 3.0, {"num_labels": 1}),
    ("gemma2-classifier", "gemma2", 0.2, {"id2label": {0: "toxic", 1: "spam"},  # Gemma's final states are larger
                                          "problem_type": "multi_label_classification"}),
    ("qwen3-token-classifier", "qwen3", 3.0, {"id2label": {0: "O", 1: "B-NAME", 2: "I-NAME", 3: "KEYWORD"}}),
)
TOKEN_CLASSIFIERS = ("qwen3-token-classifier",)  # XForTokenClassification: a score head with a bias, every token
PAIRS = (  # (query, document) text pairs the cross-encoder scores
    ("def fibonacci(n):", "return fibonacci(n - 1) + fibonacci(n - 2)"),
    ("def fibonacci(n):", "import os"),
    ("class Stack:", "def push(self, item):"),
    ("how to sort a list", "sorted(items, key=len)"),
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def make_classifier(name: str, base: str, spread: float, fields: dict) -> None:
    """Save the classifier `name` over `base`'s body and its expected_classes.json."""
    source, folder = CHECKPOINTS / base, CHECKPOINTS / name
    if "id2label" in fields:
        fields = {**fields, "label2id": {label: index for index, label in fields["id2label"].items()}}
    torch.manual_seed(SEED)
    per_token = name in TOKEN_CLASSIFIERS
    auto = AutoModelForTokenClassification if per_token else AutoModelForSequenceClassification
    model = auto.from_pretrained(source, local_files_only=True, attn_implementation="eager", dtype=torch.float32,
                                 **fields).eval()
    hidden = model.config.hidden_size
    with torch.no_grad():
        model.score.weight.normal_(0.0, spread / hidden**0.5)
        if per_token:
            model.score.bias.normal_(0.0, 0.5)
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    for file in TOKENIZER_FILES:
        if (source / file).exists():
            shutil.copy(source / file, folder / file)
    prompts = json.loads((source / "expected.json").read_text())["prompts"]
    pad = model.config.pad_token_id
    assert all(prompt[-1] != pad for prompt in prompts), "a prompt ends with the pad token"
    cases = [{"prompt_token_ids": list(prompt), **({} if per_token else {"logits": logits(model, prompt)}),
              "token_logits": token_logits(model, prompt, per_token)} for prompt in prompts]
    fixture = {"cases": cases, "torch_version": torch.__version__, "transformers_version": transformers.__version__,
               "python_version": platform.python_version(), "seed": SEED}
    if model.config.num_labels == 1:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        pair_ids = [tokenizer(query, document)["input_ids"] for query, document in PAIRS]
        fixture["pairs"] = [{"text_1": query, "text_2": document, "prompt_token_ids": ids,
                             "logits": logits(model, ids)} for (query, document), ids in zip(PAIRS, pair_ids)]
    (folder / "expected_classes.json").write_text(json.dumps(fixture) + "\n")
    print(f"wrote {folder} ({model.config.num_labels} labels, {len(cases)} prompts)")


def logits(model: torch.nn.Module, token_ids: list[int]) -> list[float]:
    """The classifier's logits (labels,) for one unpadded prompt."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([token_ids])).logits[0].to(torch.float32).tolist()


def token_logits(model: torch.nn.Module, token_ids: list[int], per_token: bool) -> list[list[float]]:
    """The score head over every prompt token's final state (prompt tokens, labels): what a token-wise task
    (token_classify) gives; a token classifier's (`per_token`) own logits."""
    with torch.no_grad():
        if per_token:
            return model(input_ids=torch.tensor([token_ids])).logits[0].to(torch.float32).tolist()
        states = model.model(input_ids=torch.tensor([token_ids])).last_hidden_state[0]  # (T, H)
        return model.score(states).to(torch.float32).tolist()


def main() -> None:
    for name, base, spread, fields in CLASSIFIERS:
        make_classifier(name, base, spread, fields)


if __name__ == "__main__":
    main()
