"""LoRA adapters served with their base model (`enable_lora`, model/lora.py), against Hugging Face + PEFT.

tests/fixtures/lora holds two PEFT adapters of the bundled model and PEFT's greedy tokens with each
(scripts/make_lora_fixtures.py): `alpha` (rank 8, every projection) and `beta` (rank 4 padded to the engine's 8,
rsLoRA's scale, q and v of two layers only). One engine serves `alpha` from start-up (`lora_modules`) and loads
`beta` when a request asks for it; base, alpha and beta requests run in the same steps and each gives PEFT's
tokens. Prefixes cached under one adapter are never taken by another. Adapters the engine cannot serve, unknown
names and full slots are clear errors.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil

import httpx
import openai
import pytest

from helpers import checkpoint, http_client, running_server, small_engine_args
from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.model.lora import lora_slot_structs
from jaxserve.model.registry import Model
from jaxserve.model.registry import load_model_spec
from jaxserve.server.app import build_app
from jaxserve.server.config import ServerConfig

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "lora")
EXPECTED_ALL = json.load(open(os.path.join(FIXTURES, "expected.json")))
EXPECTED = EXPECTED_ALL["bundled"]
ALPHA = LoRARequest("alpha", 1, os.path.join(FIXTURES, "alpha"))
BETA = LoRARequest("beta", 2, os.path.join(FIXTURES, "beta"))
GREEDY = SamplingParams(max_tokens=len(EXPECTED["base"]["outputs"][0]), temperature=0, ignore_eos=True)
ENGINE = small_engine_args(enable_lora=True, max_loras=2, max_lora_rank=8, lora_modules={"alpha": ALPHA.lora_path})


@pytest.fixture(scope="module")
def llm():
    return LLM(None, **ENGINE)


def _tokens(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def test_base_and_adapters_in_the_same_steps_give_pefts_tokens(llm):
    prompts = EXPECTED["prompts"]
    variants = [(None, "base"), (ALPHA, "alpha"), (BETA, "beta")]  # beta is loaded by this call
    requests = [(prompt, lora, name) for prompt_index, prompt in enumerate(prompts) for lora, name in variants]
    outputs = llm.generate([prompt for prompt, _, _ in requests], GREEDY, use_tqdm=False,
                           lora_request=[lora for _, lora, _ in requests])
    for (prompt, _, name), tokens in zip(requests, _tokens(outputs)):
        assert tokens == EXPECTED[name]["outputs"][prompts.index(prompt)], name
    assert llm.engine.list_loras() == {"alpha": ALPHA.lora_path, "beta": BETA.lora_path}
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_a_cached_prefix_is_shared_only_under_the_same_adapter(llm):
    """The base model computes a prompt first; an adapter's request of the same prompt must not take those pages
    (its KV differs), and its own second run does."""
    prompt = EXPECTED["prompts"][0] * 4  # several full pages
    llm.reset_prefix_cache()
    llm.generate([prompt], GREEDY, use_tqdm=False)
    hits = llm.stats()["prefix_cache_hits"]
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=ALPHA)
    assert llm.stats()["prefix_cache_hits"] == hits  # nothing of the base model's pages
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=ALPHA)
    assert llm.stats()["prefix_cache_hits"] > hits  # its own pages
    assert _tokens(again) == _tokens(first)


def test_an_adapter_in_use_stays_and_a_removed_one_leaves_nothing_behind(llm):
    """remove_lora waits for the adapter's requests; a later load of the same name does not take the cached
    pages of the removed one."""
    prompt = EXPECTED["prompts"][1] * 8
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=BETA)
    llm.engine.add_request("waiting", [5, 6, 7], GREEDY, lora_request=BETA)
    assert llm.stats()["lora"] == {"max_loras": 2, "running": [], "waiting": ["beta"]}  # the metrics' source
    with pytest.raises(ValueError, match="in use by 1 unfinished request"):
        llm.engine.remove_lora("beta")
    llm.engine.abort_request("waiting")
    llm.engine.remove_lora("beta")
    assert "beta" not in llm.engine.list_loras()
    hits = llm.stats()["prefix_cache_hits"]
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=BETA)  # loaded again
    assert llm.stats()["prefix_cache_hits"] == hits and _tokens(again) == _tokens(first)


def test_adapters_the_engine_cannot_serve_are_refused(llm, tmp_path):
    with pytest.raises(ValueError, match="no LoRA adapter 'gamma' is loaded"):
        llm.engine.make_requests("x", [5, 6, 7], GREEDY, lora_name="gamma")
    with pytest.raises(ValueError, match="every one of the max_loras=2 adapter slots"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=LoRARequest("gamma", 3, BETA.lora_path))
    with pytest.raises(ValueError, match="name 'alpha' is taken"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=LoRARequest("alpha", 1, BETA.lora_path))
    for field, value, message in [("r", 16, "rank r=16 must be an integer in \\[1, max_lora_rank=8\\]"),
                                  ("use_dora", True, "DoRA adapters are not served"),
                                  ("modules_to_save", ["lm_head"], "modules saved whole are not served")]:
        folder = tmp_path / field
        shutil.copytree(BETA.lora_path, folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, field: value}))
        if "beta" in llm.engine.list_loras():
            llm.engine.remove_lora("beta")  # a free slot, so the adapter itself is what is refused
        with pytest.raises(ValueError, match=message):
            llm.engine.add_lora(LoRARequest(field, 9, str(folder)))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.engine.add_lora(LoRARequest("missing", 9, str(tmp_path / "missing")))
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_adapters_under_tensor_parallelism_give_pefts_tokens():
    """TP 4 on the bundled model (2 KV heads, so each is repeated, and the adapters' k and v columns with it): the
    slots split like their projections' rows and columns."""
    tp_llm = LLM(None, **{**ENGINE, "tensor_parallel_size": 4, "skip_precompile": True,
                          "lora_modules": {"alpha": ALPHA.lora_path, "beta": BETA.lora_path}})
    slots = tp_llm.engine.core.runner.params["layers"]["lora"]
    assert slots["wq"]["b"].addressable_shards[0].data.shape[-1] == slots["wq"]["b"].shape[-1] // 4
    assert slots["wo"]["a"].addressable_shards[0].data.shape[2] == slots["wo"]["a"].shape[2] // 4
    prompts = EXPECTED["prompts"]
    loras = [None, ALPHA, BETA] * len(prompts)
    outputs = tp_llm.generate([p for p in prompts for _ in range(3)], GREEDY, use_tqdm=False, lora_request=loras)
    names = ["base", "alpha", "beta"] * len(prompts)
    assert _tokens(outputs) == [EXPECTED[name]["outputs"][i // 3] for i, name in enumerate(names)]


# (base, adapter, max_model_len: Phi-3's fixture keeps HF's short LongRoPE factors within 32 tokens)
OTHER_BASES = [("gemma2", "gemma-lora", 96), ("qwen3-moe", "moe-lora", 96), ("phi3", "phi3-lora", 32)]


@pytest.mark.parametrize("name, adapter, max_model_len", OTHER_BASES)
def test_other_families_give_pefts_tokens(name, adapter, max_model_len):
    """Gemma 2 (every projection adapted), Qwen3-MoE (its attention: the experts take no adapters, and an
    adapter of them is refused) and Phi-3 (adapters of its fused qkv_proj and gate_up_proj, read as their
    parts')."""
    expected = EXPECTED_ALL[name]
    model = LLM(checkpoint(name), **small_engine_args(max_model_len=max_model_len, max_num_batched_tokens=32,
                                                      num_pages=24, skip_precompile=True, enable_lora=True,
                                                      max_lora_rank=8,
                                                      lora_modules={adapter: os.path.join(FIXTURES, adapter)}))
    params = SamplingParams(max_tokens=len(expected["base"]["outputs"][0]), temperature=0, ignore_eos=True)
    prompts = expected["prompts"]
    tuned = LoRARequest(adapter, 1, os.path.join(FIXTURES, adapter))
    outputs = model.generate(prompts * 2, params, use_tqdm=False,
                             lora_request=[None] * len(prompts) + [tuned] * len(prompts))
    assert _tokens(outputs) == expected["base"]["outputs"] + expected[adapter]["outputs"]
    if name == "qwen3-moe":
        assert set(model.engine.core.runner.params["layers"]["lora"]) == {"wq", "wk", "wv", "wo"}
        model.engine.remove_lora(adapter)  # a free slot: the adapter itself is what is refused
        with pytest.raises(ValueError, match="adapts nothing this engine serves LoRA on"):
            model.engine.add_lora(LoRARequest("mlp", 2, os.path.join(FIXTURES, "gemma-lora")))


def test_lora_options_are_checked():
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        EngineConfig(lora_modules={"alpha": ALPHA.lora_path})
    with pytest.raises(ValueError, match="names 2 adapters but max_loras is 1"):
        EngineConfig(enable_lora=True, lora_modules={"a": ALPHA.lora_path, "b": BETA.lora_path})
    with pytest.raises(ValueError, match="max_lora_rank must be an integer >= 1"):
        EngineConfig(enable_lora=True, max_lora_rank=0)
    spec = load_model_spec(checkpoint("llama"))
    with pytest.raises(ValueError, match="takes no LoRA adapters"):
        lora_slot_structs(Model(spec_from_config=None, weights=None, module=None), spec, 2, None, 1, 8, "float32")


# ---- the server (last in this file: its engine thread drives the engine from here on) ------------------------

@pytest.fixture(scope="module")
def server(llm):
    """The OpenAI server on `llm`'s engine, with both adapters loaded: a request's `model` names one."""
    llm.engine.add_lora(BETA)
    with running_server(build_app(llm.engine, ServerConfig(allow_runtime_lora_updating=True))) as url:
        yield url


def test_the_server_lists_the_adapters_and_runs_the_one_a_request_names(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {"tiny-stdlib-llama", "alpha", "beta"}
    assert cards["alpha"].parent == "tiny-stdlib-llama" and cards["alpha"].root == ALPHA.lora_path

    def complete(case):
        prompt_index, model = case
        return client.completions.create(model=model, prompt=EXPECTED["prompts"][prompt_index], temperature=0,
                                         max_tokens=GREEDY.max_tokens, extra_body={"ignore_eos": True,
                                                                                   "return_token_ids": True})

    cases = [(index, model) for index in range(len(EXPECTED["prompts"]))
             for model in ("tiny-stdlib-llama", "alpha", "beta")]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(complete, cases))
    for (index, model), answer in zip(cases, answers):
        name = "base" if model == "tiny-stdlib-llama" else model
        assert answer.choices[0].token_ids == EXPECTED[name]["outputs"][index], model
    chat = client.chat.completions.create(model="beta", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "beta" and chat.usage.completion_tokens == 4
    metrics = http_client.get(f"{server}/metrics").text  # vLLM's info gauge (nothing runs now)
    assert ('jaxserve:lora_requests_info{max_lora="2",model_name="tiny-stdlib-llama",replica="0",'
            'running_lora_adapters="",waiting_lora_adapters=""}') in metrics


def test_the_server_refuses_unknown_models_and_beam_search_with_an_adapter(server):
    answer = http_client.post(f"{server}/v1/completions", json={"model": "gamma", "prompt": "x", "max_tokens": 1})
    assert answer.status_code == 404 and "'alpha'" in answer.json()["error"]["message"]
    answer = http_client.post(f"{server}/v1/completions", json={"model": "alpha", "prompt": "x", "max_tokens": 2,
                                                                "use_beam_search": True, "n": 2})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "model"


def test_adapters_load_and_unload_at_run_time(server):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (on with --allow-runtime-lora-updating)."""

    def post(route: str, body: dict) -> httpx.Response:
        return http_client.post(f"{server}/v1/{route}", json=body)

    def complete(model: str) -> httpx.Response:
        return http_client.post(f"{server}/v1/completions", json={
            "model": model, "prompt": EXPECTED["prompts"][0], "max_tokens": GREEDY.max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})

    unloaded = post("unload_lora_adapter", {"lora_name": "beta"})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'beta' removed successfully."
    assert complete("beta").status_code == 404
    assert "beta" not in {card["id"] for card in http_client.get(f"{server}/v1/models").json()["data"]}
    assert post("unload_lora_adapter", {"lora_name": "beta"}).status_code == 404
    refused = post("load_lora_adapter", {"lora_name": "broken", "lora_path": FIXTURES})  # not a PEFT folder
    assert refused.status_code == 400 and "no adapter_config.json" in refused.json()["error"]["message"]
    assert post("load_lora_adapter", {"lora_name": "alpha", "lora_path": BETA.lora_path}).status_code == 400
    loaded = post("load_lora_adapter", {"lora_name": "beta", "lora_path": BETA.lora_path})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'beta' added successfully."
    answer = complete("beta")
    assert answer.status_code == 200 and answer.json()["choices"][0]["token_ids"] == EXPECTED["beta"]["outputs"][0]



def test_data_parallel_replicas_serve_the_same_adapters_in_the_same_slots():
    """Two replicas (data_parallel_size 2): an adapter from start-up and one loaded at run time are in the same slot
    on both, so a request runs with its adapter whichever replica the router picks (PEFT's tokens)."""
    config = EngineConfig.for_model(None, **{**{k: v for k, v in ENGINE.items() if k != "show_progress"},
                                             "data_parallel_size": 2, "skip_precompile": True,
                                             "lora_modules": {"alpha": ALPHA.lora_path}})
    app = build_app(LLMEngine(config, show_progress=False), ServerConfig(allow_runtime_lora_updating=True))
    with running_server(app) as url:
        loaded = http_client.post(f"{url}/v1/load_lora_adapter",
                                  json={"lora_name": "beta", "lora_path": BETA.lora_path})
        assert loaded.status_code == 200, loaded.text
        replicas = app.state.async_engine.replicas
        assert [{name: lora.slot for name, lora in r.engine.core.lora_slots.loaded.items()} for r in replicas] == \
            [{"alpha": 0, "beta": 1}] * 2

        def complete(case):
            index, model = case
            return http_client.post(f"{url}/v1/completions", timeout=120, json={
                "model": model, "prompt": EXPECTED["prompts"][index], "max_tokens": GREEDY.max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}).json()

        cases = [(index, model) for index in range(len(EXPECTED["prompts"])) for model in ("alpha", "beta")]
        before = [r.stats()["generation_tokens"] for r in replicas]
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            answers = list(pool.map(complete, cases))
        for (index, model), answer in zip(cases, answers):
            assert answer["choices"][0]["token_ids"] == EXPECTED[model]["outputs"][index], model
        assert all(r.stats()["generation_tokens"] > b for r, b in zip(replicas, before))  # both replicas served
