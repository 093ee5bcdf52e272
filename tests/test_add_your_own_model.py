"""Add your own model (docs/models.md): tests/toy_model.py registers an architecture from outside the engine, and
`LLM` and the OpenAI server serve it unchanged: greedy tokens equal a plain numpy decode of the same weights, with
many requests in flight, chunked prefill and a pool small enough to preempt."""

from __future__ import annotations

import numpy as np
import pytest

import toy_model
from helpers import checkpoint, http_client, running_server, small_engine_args
from jaxserve import LLM, SamplingParams
from jaxserve.model.registry import registered_architectures

NUM_TOKENS = 10


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("toy"))
    tensors = toy_model.write_checkpoint(folder, checkpoint("llama"))
    rng = np.random.default_rng(7)
    prompts = [rng.integers(4, 512, n).tolist() for n in (1, 9, 23, 40, 5, 17, 31, 12)]
    want = [toy_model.reference_greedy(tensors, prompt, NUM_TOKENS) for prompt in prompts]
    # 32 pages of 8 tokens in all, 15 in the pool: chunked prefill and preemption
    llm = LLM(folder, **small_engine_args(page_size=8, num_pages=16, max_model_len=64, max_num_batched_tokens=16,
                                          max_num_seqs=8))
    return llm, prompts, want


def test_the_toy_architecture_is_registered_from_outside_the_engine():
    assert toy_model.ARCHITECTURE in registered_architectures()


def test_llm_serves_the_toy_model_with_the_numpy_reference_tokens(toy):
    llm, prompts, want = toy
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want
    stats = llm.stats()
    assert stats["preemptions"] > 0, "the pool was sized to force preemption"
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_the_server_serves_the_toy_model(toy):
    from jaxserve.server.app import build_app
    from jaxserve.server.config import ServerConfig

    llm, prompts, want = toy
    config = ServerConfig()
    with running_server(build_app(llm.engine, config)) as url:
        for prompt, tokens in zip(prompts, want):
            response = http_client.post(f"{url}/v1/completions", json={
                "model": config.served_model_name, "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}, timeout=60)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            assert choice["token_ids"] == tokens


def test_an_installed_package_registers_its_model_through_the_entry_point_group(monkeypatch, tmp_path):
    """A package naming a module under `jaxserve.models` gets it imported (and so registered) on lookup."""
    import importlib.metadata

    from jaxserve.model import registry

    (tmp_path / "toy_plugin.py").write_text(
        "from jaxserve.model import registry\n"
        "import toy_model\n"
        "registry.register(('PluginForCausalLM',), registry.model_for(toy_model.ARCHITECTURE))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = importlib.metadata.EntryPoint(name="toy", value="toy_plugin", group=registry.PLUGIN_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [entry] if group == registry.PLUGIN_GROUP else [])
    assert "PluginForCausalLM" not in registry._MODELS
    assert "PluginForCausalLM" in registered_architectures()
    monkeypatch.delitem(registry._MODELS, "PluginForCausalLM")
