"""POST /v1/embeddings (OpenAI's Embeddings API, vLLM's extras) on a server started with runner pooling, through
the openai client and plain HTTP; the same engine still serves completions. A server of runner generate refuses
the route with a 400 that says how to start one that serves it.
"""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from conftest import API_KEY
from helpers import http_client, running_server, small_engine_args
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.server.app import build_app
from jaxserve.server.config import ServerConfig

MODEL = "tiny-stdlib-llama"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEXTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, item):"]


@pytest.fixture(scope="module")
def server():
    """(URL, engine) of a server whose engine pools (LAST, normalized: the defaults) and generates."""
    options = {k: v for k, v in small_engine_args().items() if k != "show_progress"}
    engine = LLMEngine(EngineConfig.for_model(None, runner="pooling", **options), show_progress=False)
    with running_server(build_app(engine, ServerConfig(api_key=API_KEY, max_prompts=4))) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0)


def _embed(url: str, **body) -> httpx.Response:
    return http_client.post(f"{url}/v1/embeddings", headers=AUTH, json={"model": MODEL, **body}, timeout=60)


def _error(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error["message"]


def test_the_openai_client_gets_one_unit_vector_per_input_in_order(server, client):
    url, engine = server
    answer = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    assert [item.index for item in answer.data] == [0, 1, 2] and answer.model == MODEL
    floats = _embed(url, input=TEXTS).json()
    for item, plain in zip(answer.data, floats["data"]):
        assert plain["object"] == "embedding"
        # separate requests: steps of other shapes, whose float rounding differs
        np.testing.assert_allclose(item.embedding, plain["embedding"], rtol=1e-5, atol=1e-6)
        assert len(item.embedding) == engine.core.spec.hidden_size
        assert abs(np.linalg.norm(item.embedding) - 1.0) < 1e-5
    lengths = [len(engine.tokenizer.encode(text)) for text in TEXTS]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(lengths)
    assert floats["usage"]["completion_tokens"] == 0 and floats["object"] == "list"
    assert floats["id"].startswith("embd-")


def test_token_inputs_special_tokens_and_truncation(server):
    url, engine = server
    ids = engine.tokenizer.encode(TEXTS[0])
    by_text = _embed(url, input=TEXTS[0]).json()["data"][0]["embedding"]
    by_ids = _embed(url, input=ids).json()
    np.testing.assert_allclose(by_ids["data"][0]["embedding"], by_text, rtol=1e-5, atol=1e-6)
    batch = _embed(url, input=[ids, ids[1:]]).json()
    plain = _embed(url, input=TEXTS[0], add_special_tokens=False).json()
    np.testing.assert_allclose(plain["data"][0]["embedding"], batch["data"][1]["embedding"], rtol=1e-5, atol=1e-6)
    assert plain["usage"]["prompt_tokens"] == len(ids) - 1
    cut = _embed(url, input=ids, truncate_prompt_tokens=len(ids) - 1).json()
    np.testing.assert_allclose(cut["data"][0]["embedding"], batch["data"][1]["embedding"], rtol=1e-5, atol=1e-6)
    raw = np.asarray(_embed(url, input=TEXTS[0], normalize=False).json()["data"][0]["embedding"])
    np.testing.assert_allclose(raw / np.linalg.norm(raw), by_text, rtol=1e-5, atol=1e-6)


def test_bad_requests_are_400s_naming_the_field(server):
    url, engine = server
    assert "Matryoshka" in _error(_embed(url, input="x", dimensions=8), "dimensions")
    _error(_embed(url, input="x", dimensions=0), "dimensions")
    _error(_embed(url, input=""), "input")
    _error(_embed(url, input=[]), "input")
    _error(_embed(url, input=["a"] * 5), "input")  # max_prompts 4
    _error(_embed(url, input=[engine.core.spec.vocab_size]), "input")
    assert "max_model_len" in _error(_embed(url, input=[5] * (engine.max_model_len + 1)), "input")
    _error(_embed(url, input="x", messages=[{"role": "user", "content": "hi"}]), "messages")
    _error(_embed(url, input="x", priority=1), "priority")
    assert _embed(url, input="x", encoding_format="int8").status_code == 400
    assert _embed(url, model="other", input="x").status_code == 404
    assert http_client.post(f"{url}/v1/embeddings", json={"input": "x"}).status_code == 401
    stats = engine.stats()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0


def test_the_pooling_server_still_completes_and_counts_embeddings_in_its_metrics(server, client):
    url, _ = server
    completion = client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=4, temperature=0)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 4
    client.embeddings.create(model=MODEL, input=TEXTS[:2])
    metrics = http_client.get(f"{url}/metrics").text
    (line,) = [line for line in metrics.splitlines()
               if line.startswith("jaxserve:request_success_total{") and 'finished_reason="stop"' in line]
    assert float(line.split()[-1]) >= 2


def test_score_and_rerank_are_the_embeddings_cosine_similarities(server):
    url, _ = server
    vectors = [np.asarray(item["embedding"]) for item in _embed(url, input=TEXTS).json()["data"]]  # unit vectors
    similarity = [float(vectors[0] @ vector) for vector in vectors[1:]]
    scored = http_client.post(f"{url}/v1/score", headers=AUTH, json={"model": MODEL, "text_1": TEXTS[0],
                                                                     "text_2": TEXTS[1:]}).json()
    assert [item["index"] for item in scored["data"]] == [0, 1] and scored["data"][0]["object"] == "score"
    np.testing.assert_allclose([item["score"] for item in scored["data"]], similarity, atol=1e-5)
    pairwise = http_client.post(f"{url}/score", headers=AUTH, json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]}).json()
    np.testing.assert_allclose(pairwise["data"][0]["score"], similarity[0], atol=1e-5)
    assert _error(http_client.post(f"{url}/v1/score", headers=AUTH, json={"text_1": TEXTS[:2], "text_2": TEXTS}),
                  "text_1")
    body = {"model": MODEL, "query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1}
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = http_client.post(f"{url}{path}", headers=AUTH, json=body).json()
        best = int(np.argmax(similarity))
        assert [r["index"] for r in ranked["results"]] == [best], path
        assert ranked["results"][0]["document"] == {"text": TEXTS[1 + best]}
        np.testing.assert_allclose(ranked["results"][0]["relevance_score"], similarity[best], atol=1e-5)
    every = http_client.post(f"{url}/v1/rerank", headers=AUTH, json={**body, "top_n": 0}).json()["results"]
    assert sorted(r["relevance_score"] for r in every) == [r["relevance_score"] for r in every][::-1]
    _error(http_client.post(f"{url}/v1/rerank", headers=AUTH, json={**body, "documents": []}), "documents")
    assert http_client.post(f"{url}/rerank", json=body).status_code == 401


def test_pooling_gives_an_embedding_models_embeddings_and_classify_is_refused(server):
    url, _ = server
    embedded = _embed(url, input=TEXTS[:2]).json()["data"]
    pooled = http_client.post(f"{url}/pooling", headers=AUTH, json={"model": MODEL, "input": TEXTS[:2]}).json()
    assert [item["object"] for item in pooled["data"]] == ["pooling", "pooling"]
    for item, embedding in zip(pooled["data"], embedded):
        # the two requests may run in steps of other shapes (other requests beside them): float rounding differs
        np.testing.assert_allclose(item["data"], embedding["embedding"], rtol=1e-5, atol=1e-6)
    refused = http_client.post(f"{url}/classify", headers=AUTH, json={"input": TEXTS[0]})
    assert "classification needs a sequence classifier" in _error(refused, "model")
    activation = http_client.post(f"{url}/pooling", headers=AUTH, json={"input": TEXTS[0], "use_activation": True})
    _error(activation, "use_activation")


def test_a_generate_server_says_how_to_serve_embeddings(openai_server):
    url, _ = openai_server
    assert "--runner pooling" in _error(_embed(url, input="import os"), "model")
    score = http_client.post(f"{url}/v1/score", headers=AUTH, json={"text_1": "a", "text_2": "b"})
    assert "--runner pooling" in _error(score, "model")
    classify = http_client.post(f"{url}/classify", headers=AUTH, json={"input": "a"})
    assert "classification needs a sequence classifier" in _error(classify, "model")
