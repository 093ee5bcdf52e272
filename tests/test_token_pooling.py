"""Token-wise pooling (vLLM's token_classify and token_embed tasks: `LLM.reward`, `LLM.encode(pooling_task=...)`,
/pooling with `task`): every prompt token's class probabilities (a sequence classifier's score head over each
token's final state, against transformers' in tests/fixtures/checkpoints/*-classifier/expected_classes.json) or
its embedding. The engines run 32-token steps, so the longer prompts come back over several chunks, and a step
that holds a token-wise request pools every token apart while the rows beside it still pool as they do.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from helpers import checkpoint, small_engine_args
from jaxserve import LLM, PoolingParams, TokenPoolingOutput

TOLERANCE = 3e-5
CHUNKED = dict(max_num_batched_tokens=32)


def _cases(name: str, kind: str = "classes") -> list[dict]:
    with open(os.path.join(checkpoint(name), f"expected_{kind}.json")) as f:
        return json.load(f)["cases"]


def _prompts(cases: list[dict]) -> list[dict]:
    return [{"prompt_token_ids": case["prompt_token_ids"]} for case in cases]


def _softmax(logits) -> np.ndarray:
    exp = np.exp(np.asarray(logits, np.float64) - np.max(logits, axis=-1, keepdims=True))
    return exp / exp.sum(axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def classifier() -> LLM:
    """The 3-label Llama classifier, every bucket compiled at start-up (the token-wise pooling buckets among them),
    the prefix cache on."""
    return LLM(checkpoint("llama-classifier"), **small_engine_args(**CHUNKED, skip_precompile=False))


def test_token_classify_gives_every_tokens_classes_as_transformers(classifier):
    """`LLM.reward` and `encode(pooling_task="token_classify")`: one entry per prompt token, the softmax of
    transformers' score head over that token's state (raw logits with use_activation false), twice (every token
    computed again: the prefix cache is not read for them), every page back, nothing compiled after warm-up."""
    cases = _cases("llama-classifier")
    for _ in range(2):
        probs = classifier.reward(_prompts(cases), use_tqdm=False)
        logits = classifier.encode(_prompts(cases), PoolingParams(use_activation=False), use_tqdm=False,
                                   pooling_task="token_classify")
        for prob, logit, case in zip(probs, logits, cases):
            assert isinstance(prob.outputs, TokenPoolingOutput) and prob.error is None and prob.finished
            assert len(prob.outputs.data) == len(case["prompt_token_ids"]) and prob.num_cached_tokens == 0
            np.testing.assert_allclose(logit.outputs.data, case["token_logits"], atol=TOLERANCE, rtol=TOLERANCE)
            np.testing.assert_allclose(prob.outputs.data, _softmax(case["token_logits"]), atol=TOLERANCE)
    stats = classifier.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["compilations_after_warmup"] == 0  # the first engine of the file: nothing else compiles meanwhile


def test_rows_pooled_whole_and_token_by_token_share_steps(classifier):
    """classify and token_classify requests in the same steps: the token-wise rows get every token's classes and
    the others their last token's, each as it gets it alone."""
    cases = _cases("llama-classifier")[-4:]  # 31 to 70 tokens: several 32-token steps, rows side by side
    engine, made = classifier.engine, []
    for index, case in enumerate(cases + cases):
        task = "classify" if index < len(cases) else "token_classify"
        request_id = f"mixed-{index}"
        made.append(request_id)
        engine.submit(request_id, engine.make_pooling_requests(request_id, case["prompt_token_ids"], None, task=task))
    outputs = classifier._run(made, use_tqdm=False)
    for output, case in zip(outputs[: len(cases)], cases):
        np.testing.assert_allclose(output.outputs.probs, _softmax(case["logits"]), atol=TOLERANCE)
    for output, case in zip(outputs[len(cases):], cases):
        np.testing.assert_allclose(output.outputs.data, _softmax(case["token_logits"]), atol=TOLERANCE)
    (whole,) = classifier.encode(_prompts(cases[-1:]), use_tqdm=False, pooling_task="classify")
    assert whole.outputs.data == whole.outputs.probs  # vLLM's name for every task's result, too
    np.testing.assert_allclose(whole.outputs.data, outputs[len(cases) - 1].outputs.probs, atol=1e-6)
    stats = classifier.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_token_embed_gives_every_tokens_state():
    """An embedding model's token_embed: each token's final state, whose mean is transformers' MEAN pooling and
    whose last is its LAST; L2-normalized one by one when asked (the pooler's normalize is the default)."""
    embedder = LLM(checkpoint("llama"), runner="pooling", pooler_config={"pooling_type": "MEAN", "normalize": False},
                   **small_engine_args(**CHUNKED, skip_precompile=True))
    cases = _cases("llama", "embeddings")
    raw = embedder.encode(_prompts(cases), PoolingParams(normalize=False), use_tqdm=False, pooling_task="token_embed")
    for output, case in zip(raw, cases):
        states = np.asarray(output.outputs.data)  # (prompt tokens, H)
        assert states.shape == (len(case["prompt_token_ids"]), len(case["MEAN"]))
        np.testing.assert_allclose(states.mean(axis=0), case["MEAN"], atol=TOLERANCE, rtol=TOLERANCE)
        np.testing.assert_allclose(states[-1], case["LAST"], atol=TOLERANCE, rtol=TOLERANCE)
    (normalized,) = embedder.encode(_prompts(cases[-1:]), PoolingParams(normalize=True), use_tqdm=False,
                                    pooling_task="token_embed")
    np.testing.assert_allclose(np.linalg.norm(normalized.outputs.data, axis=1), 1.0, atol=1e-5)
    (whole,) = embedder.encode(_prompts(cases[-1:]), use_tqdm=False, pooling_task="embed")
    np.testing.assert_allclose(whole.outputs.data, case["MEAN"], atol=TOLERANCE, rtol=TOLERANCE)
    with pytest.raises(ValueError, match="token classification needs a sequence classifier"):
        embedder.reward("def f():", use_tqdm=False)
    with pytest.raises(ValueError, match="the pooling task must be one of .* got None"):
        embedder.encode("def f():", use_tqdm=False)
    stats = embedder.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_a_classifier_refuses_token_embed_and_embedding_options(classifier):
    with pytest.raises(ValueError, match="not embeddings; use classify or token_classify"):
        classifier.encode("def f():", use_tqdm=False, pooling_task="token_embed")
    with pytest.raises(ValueError, match="^dimensions is for embeddings"):
        classifier.reward("def f():", PoolingParams(dimensions=2), use_tqdm=False)


def test_a_token_classifier_classifies_every_token_as_transformers():
    """qwen3 as Qwen3ForTokenClassification (its score head with a bias, 4 labels): `LLM.reward` gives transformers'
    per-token logits through the softmax, over one device and two; it does nothing else."""
    cases = _cases("qwen3-token-classifier")
    for tensor_parallel_size in (1, 2):
        llm = LLM(checkpoint("qwen3-token-classifier"), **small_engine_args(
            **CHUNKED, tensor_parallel_size=tensor_parallel_size, skip_precompile=True))
        assert llm.engine.core.spec.classifier.per_token
        raw = llm.reward(_prompts(cases), PoolingParams(use_activation=False), use_tqdm=False)
        for output, case in zip(raw, cases):
            np.testing.assert_allclose(output.outputs.data, case["token_logits"], atol=TOLERANCE, rtol=TOLERANCE)
    (probs,) = llm.reward(_prompts(cases[-1:]), use_tqdm=False)
    np.testing.assert_allclose(probs.outputs.data, _softmax(cases[-1]["token_logits"]), atol=TOLERANCE)
    with pytest.raises(ValueError, match="token classifier .* classifies every token; use token_classify"):
        llm.classify("def f():", use_tqdm=False)
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
