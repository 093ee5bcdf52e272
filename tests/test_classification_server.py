"""vLLM's /classify and /pooling routes on a server of a sequence classifier, and its score and rerank routes on a
cross-encoder's, against Hugging Face's logits (tests/fixtures/checkpoints/*/expected_classes.json); what a
classifier cannot do is a 400 that says so, and every page comes back.
"""

from __future__ import annotations

import base64
import json
import os

import httpx
import numpy as np
import pytest

from conftest import API_KEY
from helpers import checkpoint, http_client, running_server, small_engine_args
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.server.app import build_app
from jaxserve.server.config import ServerConfig

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOLERANCE = 3e-5


def _expected(name: str) -> dict:
    with open(os.path.join(checkpoint(name), "expected_classes.json")) as f:
        return json.load(f)


def _server(name: str):
    options = {k: v for k, v in small_engine_args(skip_precompile=True).items() if k != "show_progress"}
    engine = LLMEngine(EngineConfig.for_model(checkpoint(name), **options), show_progress=False)
    return engine, running_server(build_app(engine, ServerConfig(api_key=API_KEY, max_prompts=4)))


@pytest.fixture(scope="module")
def classifier():
    """(URL, engine) of the 3-label Llama classifier's server (runner auto: pooling)."""
    engine, server = _server("llama-classifier")
    with server as url:
        yield url, engine


@pytest.fixture(scope="module")
def cross_encoder():
    engine, server = _server("qwen3-cross-encoder")
    with server as url:
        yield url, engine


def _post(url: str, path: str, **body) -> httpx.Response:
    return http_client.post(f"{url}{path}", headers=AUTH, json=body, timeout=60)


def _error(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error["message"]


def _softmax(logits) -> np.ndarray:
    exp = np.exp(np.asarray(logits, np.float64) - np.max(logits))
    return exp / exp.sum()


def _all_pages_back(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_classify_gives_each_inputs_probabilities_and_label(classifier):
    url, engine = classifier
    cases = _expected("llama-classifier")["cases"][-4:]
    answer = _post(url, "/classify", input=[case["prompt_token_ids"] for case in cases]).json()
    assert answer["id"].startswith("classify-") and answer["object"] == "list"
    labels = ("negative", "neutral", "positive")
    for index, (item, case) in enumerate(zip(answer["data"], cases)):
        assert item["index"] == index and item["num_classes"] == 3
        np.testing.assert_allclose(item["probs"], _softmax(case["logits"]), atol=TOLERANCE)
        assert item["label"] == labels[int(np.argmax(case["logits"]))]
    tokens = sum(len(case["prompt_token_ids"]) for case in cases)
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                               "prompt_tokens_details": None}
    raw = _post(url, "/classify", input=cases[0]["prompt_token_ids"], use_activation=False).json()["data"][0]
    np.testing.assert_allclose(raw["probs"], cases[0]["logits"], atol=TOLERANCE, rtol=TOLERANCE)
    text = _post(url, "/classify", input="def fibonacci(n):").json()["data"][0]
    by_ids = _post(url, "/classify", input=engine.tokenizer.encode("def fibonacci(n):")).json()["data"][0]
    np.testing.assert_allclose(text["probs"], by_ids["probs"], atol=1e-6)
    _all_pages_back(engine)


def test_a_conversation_is_classified_as_the_chat_template_renders_it(classifier):
    """vLLM's chat-shaped /classify (a reward model's scored exchange): `messages` under the chat template, without
    a generation prompt unless asked, classify as the token ids /tokenize renders."""
    url, engine = classifier
    conversation = [{"role": "user", "content": "Is this code fine?"},
                    {"role": "assistant", "content": "def f(): pass"}]
    for add_generation_prompt in (False, True):
        body = {"messages": conversation, "add_generation_prompt": add_generation_prompt}
        ids = http_client.post(f"{url}/tokenize", json=body).json()["tokens"]
        chat = _post(url, "/classify", messages=conversation, add_generation_prompt=add_generation_prompt).json()
        plain = _post(url, "/classify", input=ids).json()
        assert chat["usage"]["prompt_tokens"] == len(ids)
        np.testing.assert_allclose(chat["data"][0]["probs"], plain["data"][0]["probs"], atol=1e-6)
    assert "not both" in _error(_post(url, "/classify", input="x", messages=conversation), "messages")
    assert "give input" in _error(_post(url, "/classify"), "input")
    _all_pages_back(engine)


def test_pooling_gives_a_classifiers_probabilities_in_either_encoding(classifier):
    url, engine = classifier
    case = _expected("llama-classifier")["cases"][5]
    pooled = _post(url, "/pooling", input=case["prompt_token_ids"]).json()
    assert pooled["id"].startswith("pool-") and pooled["data"][0]["object"] == "pooling"
    np.testing.assert_allclose(pooled["data"][0]["data"], _softmax(case["logits"]), atol=TOLERANCE)
    encoded = _post(url, "/pooling", input=case["prompt_token_ids"], encoding_format="base64").json()
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["data"]), "<f4")
    np.testing.assert_allclose(decoded, pooled["data"][0]["data"], atol=1e-7)
    _all_pages_back(engine)


def test_what_a_classifier_cannot_do_is_a_400_that_says_so(classifier):
    url, engine = classifier
    completion = _post(url, "/v1/completions", prompt="def f():", max_tokens=2)
    assert "cannot generate text; classify with" in completion.json()["error"]["message"]
    assert completion.status_code == 400
    assert "not embeddings; use classify" in _error(_post(url, "/v1/embeddings", input="x"), "model")
    assert "needs a cross-encoder" in _error(_post(url, "/v1/score", text_1="a", text_2="b"), "model")
    assert "is for embeddings" in _error(_post(url, "/pooling", input="x", dimensions=2), "dimensions")
    assert "is for embeddings" in _error(_post(url, "/classify", input="x", normalize=True), "normalize")
    _error(_post(url, "/classify", input="x", messages=[{"role": "user", "content": "hi"}]), "messages")
    _error(_post(url, "/classify", input=[]), "input")
    _error(_post(url, "/classify", input=["a"] * 5), "input")  # max_prompts 4
    _error(_post(url, "/classify", input=[engine.core.spec.vocab_size]), "input")
    assert http_client.post(f"{url}/classify", json={"input": "x"}).status_code == 401
    assert http_client.post(f"{url}/pooling", json={"input": "x"}).status_code == 401
    _all_pages_back(engine)


def test_score_and_rerank_on_a_cross_encoder_score_the_pairs_together(cross_encoder):
    url, engine = cross_encoder
    pairs = _expected("qwen3-cross-encoder")["pairs"]
    expected = [1.0 / (1.0 + np.exp(-pair["logits"][0])) for pair in pairs]
    scored = _post(url, "/v1/score", text_1=[p["text_1"] for p in pairs], text_2=[p["text_2"] for p in pairs]).json()
    np.testing.assert_allclose([item["score"] for item in scored["data"]], expected, atol=TOLERANCE)
    tokens = sum(len(pair["prompt_token_ids"]) for pair in pairs)
    assert scored["usage"]["prompt_tokens"] == tokens  # each pair's tokens, encoded together
    query, documents = pairs[0]["text_1"], [pair["text_2"] for pair in pairs[:2]]
    ranked = _post(url, "/rerank", query=query, documents=documents).json()["results"]
    best_first = sorted(range(2), key=lambda index: -expected[index])
    assert [result["index"] for result in ranked] == best_first
    np.testing.assert_allclose([result["relevance_score"] for result in ranked],
                               [expected[index] for index in best_first], atol=TOLERANCE)
    one = _post(url, "/classify", input=pairs[0]["prompt_token_ids"], use_activation=False).json()["data"][0]
    np.testing.assert_allclose(one["probs"], pairs[0]["logits"], atol=TOLERANCE, rtol=TOLERANCE)
    _all_pages_back(engine)


def test_pooling_with_a_token_task_gives_every_tokens_classes(classifier):
    """/pooling with task token_classify: a list per input, one entry per token (transformers' score head over each
    token's state, through the softmax; raw with use_activation false; base64: the rows' float32 bytes in order);
    task token_embed on a classifier is a 400 naming task."""
    url, engine = classifier
    cases = _expected("llama-classifier")["cases"][-2:]
    inputs = [case["prompt_token_ids"] for case in cases]
    answer = _post(url, "/pooling", input=inputs, task="token_classify").json()
    for item, case in zip(answer["data"], cases):
        np.testing.assert_allclose(item["data"], _softmax_rows(case["token_logits"]), atol=TOLERANCE)
    raw = _post(url, "/pooling", input=inputs[:1], task="token_classify", use_activation=False,
                encoding_format="base64").json()["data"][0]["data"]
    values = np.frombuffer(base64.b64decode(raw), "<f4").reshape(len(inputs[0]), 3)
    np.testing.assert_allclose(values, cases[0]["token_logits"], atol=TOLERANCE, rtol=TOLERANCE)
    assert "use classify or token_classify" in _error(_post(url, "/pooling", input=inputs, task="token_embed"), "task")
    _all_pages_back(engine)


def _softmax_rows(logits) -> np.ndarray:
    exp = np.exp(np.asarray(logits, np.float64) - np.max(logits, axis=-1, keepdims=True))
    return exp / exp.sum(axis=-1, keepdims=True)
