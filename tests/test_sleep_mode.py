"""Sleep mode (vLLM's `LLM.sleep` / `wake_up`, `enable_sleep_mode`): the KV pool and the weights leave the devices
between uses and come back on the same executables. Level 1 keeps the weights in host memory; level 2 discards
them, and the wake-up reads them again from their folder, or from what `update_weights` gave while asleep (a
trainer's new weights). The server's /sleep, /wake_up and /is_sleeping exist with --enable-sleep-mode.
"""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import API_KEY
from helpers import http_client, perturbed, running_server, small_engine_args
from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine, default_model_path
from jaxserve.server.app import build_app
from jaxserve.server.config import ServerConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, item):"]
ENGINE = small_engine_args(enable_sleep_mode=True, skip_precompile=True)
ALPHA = LoRARequest("alpha", 1, os.path.join(os.path.dirname(__file__), "fixtures", "lora", "alpha"))


def _tokens(llm: LLM, lora_request=None) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora_request)
    return [output.outputs[0].token_ids for output in outputs]


def _device_bytes() -> int:
    return sum(array.nbytes for array in jax.live_arrays())


def _held_bytes(llm: LLM) -> int:
    """Bytes of the engine's params and KV pool on the devices."""
    runner = llm.engine.core.runner
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves((runner.params, runner.kv_caches)))


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory) -> tuple[str, dict]:
    """(a folder of the bundled model with perturbed weights, those weights by name)."""
    folder = tmp_path_factory.mktemp("sleep") / "model"
    shutil.copytree(default_model_path(), folder)
    (path,) = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors")]
    tensors = perturbed(load_file(path), 3)
    save_file(tensors, path)
    return str(folder), tensors


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, **ENGINE)


@pytest.fixture(scope="module")
def expected(llm, new_weights) -> dict[str, list[list[int]]]:
    """Greedy tokens of the bundled weights (from the engine under test, before it sleeps) and of the new ones."""
    return {"bundled": _tokens(llm), "new": _tokens(LLM(new_weights[0], **ENGINE))}


def test_level_1_frees_the_devices_and_wakes_up_with_the_same_weights(llm, expected):
    (cached,) = llm.generate(PROMPTS[2] * 3, GREEDY, use_tqdm=False)  # fills prefix-cache pages
    compiled = llm.stats()["compilations_after_warmup"]
    held, before = _held_bytes(llm), _device_bytes()
    llm.sleep(level=1)
    assert llm.is_sleeping() and before - _device_bytes() >= held > 0
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping() and _device_bytes() - before < held // 100
    assert _tokens(llm) == expected["bundled"]
    (again,) = llm.generate(PROMPTS[2] * 3, GREEDY, use_tqdm=False)
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == cached.outputs[0].token_ids
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["compilations_after_warmup"] == compiled


def test_level_2_reads_the_weights_again_from_their_folder(llm, expected):
    llm.sleep(level=2)
    llm.wake_up()
    assert _tokens(llm) == expected["bundled"]


def test_new_weights_given_while_asleep_are_read_at_wake_up(llm, expected, new_weights):
    folder, tensors = new_weights
    llm.sleep(level=2)
    assert llm.update_weights(tensors) >= 1
    llm.wake_up()
    assert _tokens(llm) == expected["new"]
    llm.sleep(level=2)  # the served weights came from arrays: nothing to read them again from
    with pytest.raises(ValueError, match="update_weights"):
        llm.wake_up()
    assert llm.is_sleeping()
    llm.update_weights(default_model_path())
    llm.wake_up()
    assert _tokens(llm) == expected["bundled"]


def test_what_sleep_refuses(llm):
    with pytest.raises(ValueError, match="level must be 1"):
        llm.sleep(level=3)
    engine = llm.engine
    engine.add_request("running", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="1 request"):
        llm.sleep()
    engine.abort_request("running")
    llm.sleep()
    with pytest.raises(ValueError, match="already asleep"):
        llm.sleep()
    llm.wake_up()
    llm.wake_up()  # awake: nothing to do
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        LLM(None, **small_engine_args(skip_precompile=True)).sleep()


def test_quantized_weights_and_lora_slots_come_back(new_weights):
    """int8 weights are read again in full precision and quantized; the adapter's slot waits in host memory."""
    llm = LLM(None, **{**ENGINE, "quantization": "int8", "enable_lora": True, "max_lora_rank": 8,
                       "lora_modules": {"alpha": ALPHA.lora_path}})
    base, adapted = _tokens(llm), _tokens(llm, ALPHA)
    assert base != adapted
    for level in (1, 2):
        llm.sleep(level)
        llm.wake_up()
        assert _tokens(llm) == base and _tokens(llm, ALPHA) == adapted, level
    assert np.asarray(llm.engine.core.runner.params["layers"]["wq"]["weight"]).dtype == np.int8


def test_the_server_routes(new_weights):
    options = {k: v for k, v in ENGINE.items() if k != "show_progress"}
    engine = LLMEngine(EngineConfig.for_model(None, **options), show_progress=False)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    with running_server(build_app(engine, ServerConfig(api_key=API_KEY))) as url:
        awake = http_client.post(f"{url}/v1/completions", headers=auth, json=body).json()["choices"][0]["text"]
        assert http_client.post(f"{url}/sleep?level=1").status_code == 401
        assert http_client.post(f"{url}/sleep?level=1", headers=auth).status_code == 200
        assert http_client.get(f"{url}/is_sleeping", headers=auth).json() == {"is_sleeping": True}
        asleep = http_client.post(f"{url}/v1/completions", headers=auth, json=body)
        assert asleep.status_code == 503 and "wake" in asleep.json()["error"]["message"]
        again = http_client.post(f"{url}/sleep", headers=auth)
        assert again.status_code == 400 and "already asleep" in again.json()["error"]["message"]
        assert http_client.post(f"{url}/wake_up", headers=auth).status_code == 200
        assert http_client.get(f"{url}/is_sleeping", headers=auth).json() == {"is_sleeping": False}
        answer = http_client.post(f"{url}/v1/completions", headers=auth, json=body).json()
        assert answer["choices"][0]["text"] == awake
    plain = LLMEngine(EngineConfig.for_model(None, **{**options, "enable_sleep_mode": False}), show_progress=False)
    with running_server(build_app(plain, ServerConfig(api_key=API_KEY))) as url:
        assert http_client.post(f"{url}/sleep", headers=auth).status_code == 404
