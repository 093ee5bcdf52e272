"""POST /update_weights_from_disk (SGLang's route, with --enable-weight-updates): new weights of the served model
on every data-parallel replica; off by default. (Its own file: the data-parallel engine's executables come after
test_weight_update.py's many engines have released theirs, tests/conftest.py.)
"""

from __future__ import annotations

import os
import shutil

import pytest
from safetensors.numpy import load_file, save_file

from conftest import API_KEY
from helpers import http_client, perturbed, running_server, small_engine_args
from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine, default_model_path
from jaxserve.server.app import build_app
from jaxserve.server.config import ServerConfig

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def bundled_copy(tmp_path_factory) -> str:
    """The bundled model with perturbed weights."""
    folder = tmp_path_factory.mktemp("bundled") / "model"
    shutil.copytree(default_model_path(), folder)
    (path,) = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors")]
    save_file(perturbed(load_file(path), 2), path)
    return str(folder)


def test_the_server_route_updates_every_data_parallel_replica(bundled_copy):
    options = {k: v for k, v in small_engine_args().items() if k != "show_progress"}
    expected_tokens = LLM(bundled_copy, **small_engine_args()).generate(
        ["def fibonacci(n):"], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    engine = LLMEngine(EngineConfig.for_model(None, data_parallel_size=2, **options), show_progress=False)
    app = build_app(engine, ServerConfig(enable_weight_updates=True, api_key=API_KEY))
    with running_server(app) as url:
        auth = {"Authorization": f"Bearer {API_KEY}"}
        assert http_client.post(f"{url}/update_weights_from_disk", json={"model_path": bundled_copy}).status_code == 401
        bad = http_client.post(f"{url}/update_weights_from_disk", json={"model_path": "/nonexistent"}, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "model_path"
        answer = http_client.post(f"{url}/update_weights_from_disk", json={"model_path": bundled_copy}, headers=auth)
        assert answer.status_code == 200 and answer.json()["weights_version"] == 1
        assert [replica.engine.core.weights.version for replica in app.state.async_engine.replicas] == [1, 1]
        for _ in range(4):  # (a prompt shorter than a page: the router alternates the replicas)
            reply = http_client.post(f"{url}/v1/completions", headers=auth, json={
                "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}).json()
            assert reply["choices"][0]["token_ids"] == expected_tokens


def test_the_route_is_off_by_default(openai_server):
    url, _ = openai_server
    response = http_client.post(f"{url}/update_weights_from_disk", json={"model_path": "/x"},
                                headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 404
