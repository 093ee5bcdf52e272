"""Sequence classifiers (`XForSequenceClassification` checkpoints: `LLM.classify`, a cross-encoder's `LLM.score`)
against Hugging Face: each prompt's class logits (tests/fixtures/checkpoints/*/expected_classes.json, made by
scripts/make_classifier_fixtures.py) through the model's activation.

The engines run 32-token steps, so the longer prompts are computed over several chunks before their last token is
pooled; the classifiers are a Llama (3 named labels, softmax), a Qwen3 cross-encoder (1 label, sigmoid) and a
Gemma 2 (2 labels, multi-label: sigmoid each; no final soft cap on a score head).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from helpers import checkpoint, small_engine_args
from jaxserve import LLM, ClassificationOutput, PoolingParams, SamplingParams
from jaxserve.model.registry import model_for, registered_architectures
from jaxserve.model_spec import ClassifierHead, classifier_head
from jaxserve.model.registry import load_model_spec

TOLERANCE = 3e-5
CHUNKED = dict(max_num_batched_tokens=32)
CLASSIFIERS = ("llama-classifier", "qwen3-cross-encoder", "gemma2-classifier")


def _expected(name: str) -> dict:
    with open(os.path.join(checkpoint(name), "expected_classes.json")) as f:
        return json.load(f)


def _prompts(cases: list[dict]) -> list[dict]:
    return [{"prompt_token_ids": case["prompt_token_ids"]} for case in cases]


def _softmax(logits) -> np.ndarray:
    exp = np.exp(np.asarray(logits, np.float64) - np.max(logits))
    return exp / exp.sum()


def _sigmoid(logits) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))


@pytest.fixture(scope="module")
def llama() -> LLM:
    """The 3-label Llama classifier, every bucket compiled at start-up."""
    return LLM(checkpoint("llama-classifier"), **small_engine_args(**CHUNKED, skip_precompile=False))


@pytest.fixture(scope="module")
def cross_encoder() -> LLM:
    return LLM(checkpoint("qwen3-cross-encoder"), **small_engine_args(**CHUNKED, skip_precompile=True))


@pytest.mark.parametrize("name", CLASSIFIERS)
def test_class_probabilities_match_hugging_face(name, request):
    fixture = {"llama-classifier": "llama", "qwen3-cross-encoder": "cross_encoder"}.get(name)
    llm = request.getfixturevalue(fixture) if fixture else LLM(
        checkpoint(name), **small_engine_args(**CHUNKED, skip_precompile=True))
    cases = _expected(name)["cases"]
    activation = {"llama-classifier": _softmax}.get(name, _sigmoid)
    probs, logits = (llm.classify(_prompts(cases), params, use_tqdm=False)
                     for params in (None, PoolingParams(use_activation=False)))
    for prob, logit, case in zip(probs, logits, cases):
        assert prob.finished and prob.error is None and isinstance(prob.outputs, ClassificationOutput)
        assert prob.prompt_token_ids == case["prompt_token_ids"]
        assert prob.outputs.num_classes == len(case["logits"])
        np.testing.assert_allclose(logit.outputs.probs, case["logits"], atol=TOLERANCE, rtol=TOLERANCE)
        np.testing.assert_allclose(prob.outputs.probs, activation(case["logits"]), atol=TOLERANCE)
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["generation_tokens"] == 0
    assert stats["prefix_cache_hits"] > 0  # the second pass read the first one's full pages
    if name == "llama-classifier":  # the first engine of the file: nothing else compiles meanwhile
        assert stats["compilations_after_warmup"] == 0


def test_the_classes_do_not_depend_on_the_batch_or_the_devices(llama):
    """One prompt alone, or split over two devices (the score head replicated), classifies as in a full batch."""
    cases = _expected("llama-classifier")["cases"]
    (alone,) = llama.classify(_prompts(cases[-1:]), use_tqdm=False)
    np.testing.assert_allclose(alone.outputs.probs, _softmax(cases[-1]["logits"]), atol=TOLERANCE)
    split = LLM(checkpoint("llama-classifier"), **small_engine_args(**CHUNKED, tensor_parallel_size=2,
                                                                    skip_precompile=True))
    for output, case in zip(split.classify(_prompts(cases), use_tqdm=False), cases):
        np.testing.assert_allclose(output.outputs.probs, _softmax(case["logits"]), atol=TOLERANCE)


def test_a_cross_encoder_scores_text_pairs_as_transformers(cross_encoder):
    pairs = _expected("qwen3-cross-encoder")["pairs"]
    outputs = cross_encoder.score([pair["text_1"] for pair in pairs], [pair["text_2"] for pair in pairs],
                                  use_tqdm=False)
    for output, pair in zip(outputs, pairs):
        assert output.prompt_token_ids == pair["prompt_token_ids"]  # the tokenizer's encoding of the text pair
        np.testing.assert_allclose(output.outputs.score, _sigmoid(pair["logits"][0]), atol=TOLERANCE)
    query = pairs[0]["text_1"]  # one text against many: the pairs that share it
    against = cross_encoder.score(query, [pair["text_2"] for pair in pairs[:2]], use_tqdm=False)
    np.testing.assert_allclose([output.outputs.score for output in against],
                               [output.outputs.score for output in outputs[:2]], atol=1e-6)
    with pytest.raises(ValueError, match="pairs of non-empty texts"):
        cross_encoder.score([1, 2, 3], "import os", use_tqdm=False)
    stats = cross_encoder.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_a_classifier_refuses_what_it_cannot_do(llama, cross_encoder):
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match="cannot generate text; classify with LLM.classify"):
        llama.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="class probabilities, not embeddings; use classify"):
        llama.embed(prompt, use_tqdm=False)
    with pytest.raises(ValueError, match="needs a cross-encoder .* has 3 labels"):
        llama.score("def f():", "return 1", use_tqdm=False)
    for params, field in ((PoolingParams(dimensions=2), "dimensions"), (PoolingParams(normalize=True), "normalize")):
        with pytest.raises(ValueError, match=f"^{field} is for embeddings"):
            llama.classify(prompt, params, use_tqdm=False)
    with pytest.raises(ValueError, match="use_activation must be true, false or None"):
        PoolingParams(use_activation=1)
    with pytest.raises(ValueError, match="cannot generate; start it with runner pooling"):
        LLM(checkpoint("llama-classifier"), runner="generate", **small_engine_args(skip_precompile=True))
    with pytest.raises(ValueError, match="speculative_config: a sequence classifier generates nothing"):
        LLM(checkpoint("llama-classifier"), speculative_config={"method": "ngram", "num_speculative_tokens": 2},
            **small_engine_args(skip_precompile=True))
    stats = llama.stats()
    assert stats["num_requests_running"] + stats["num_requests_waiting"] == 0
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_an_embedding_model_refuses_classification():
    embedder = LLM(checkpoint("llama"), runner="pooling", **small_engine_args(skip_precompile=True))
    with pytest.raises(ValueError, match="classification needs a sequence classifier"):
        embedder.classify("def f():", use_tqdm=False)
    with pytest.raises(ValueError, match="use_activation is for a sequence classifier"):
        embedder.embed("def f():", PoolingParams(use_activation=True), use_tqdm=False)


def test_classifier_configs_are_read_as_transformers_reads_them():
    head = classifier_head({"id2label": {"1": "b", "0": "a", "2": "c"}})
    assert head == ClassifierHead(("a", "b", "c"), "softmax", "softmax") and head.counted == "3 labels"
    assert classifier_head({}).labels == ("LABEL_0", "LABEL_1")  # transformers' default: 2 labels
    assert classifier_head({"num_labels": 1}) == ClassifierHead(("LABEL_0",), "sigmoid", "sigmoid")
    assert classifier_head({"num_labels": 4, "problem_type": "regression"}).activation == "identity"
    assert classifier_head({"problem_type": "multi_label_classification"}).activation == "sigmoid"
    cross_encoder = {"num_labels": 1, "sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}
    assert classifier_head(cross_encoder) == ClassifierHead(("LABEL_0",), "sigmoid", "identity")
    for bad, message in (({"id2label": {"0": "a", "2": "c"}}, "label ids 0..N-1"),
                         ({"id2label": {"x": "a"}}, "label ids 0..N-1"), ({"num_labels": 0}, "positive int"),
                         ({"problem_type": "ranking"}, "problem_type must be"),
                         ({"sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"},
                          "unsupported cross-encoder activation")):
        with pytest.raises(ValueError, match=message):
            classifier_head(bad)


def test_every_language_model_architecture_has_its_classifier():
    names = registered_architectures()
    for causal in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                   "Gemma2ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        classifier = causal.replace("ForCausalLM", "ForSequenceClassification")
        assert classifier in names and model_for(classifier) is model_for(causal)
    assert model_for("Gemma3TextForSequenceClassification") is model_for("Gemma3ForCausalLM")
    assert "Gemma3ForSequenceClassification" not in names  # transformers' image-text classifier
    spec = load_model_spec(checkpoint("qwen3-cross-encoder"))
    assert spec.architecture == "Qwen3ForCausalLM" and spec.qk_norm and spec.classifier.num_labels == 1
    assert load_model_spec(checkpoint("qwen3")).classifier is None
