"""New weights for a running engine (`update_weights`, POST /update_weights_from_disk): a reinforcement-learning
rollout engine's policy changes between generations, without a restart or a recompile.

Checked against a fresh engine started on the new weights (whose loading tests/test_engine_vs_hf.py checks
against Hugging Face): the llama fixture and a copy of it with every tensor perturbed ("the new weights"). After an
update from the folder, or from arrays in memory (numpy and JAX), the engine gives the fresh engine's greedy
tokens, its steps compiling nothing, its stacked leaves written over in place; under tensor parallelism 4 (KV heads
repeated), with int8 weights quantized at load, and for a mixture of experts (Qwen3-MoE) under expert parallelism
too. No request made after an update takes a page cached before it, even one a request running across the update
fills later. Sources that do not fit are refused before anything is written. The server's route is in
tests/test_weight_update_server.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import checkpoint, expected, perturbed, perturbed_checkpoint, small_engine_args
from jaxserve import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": p} for p in expected("llama")["prompts"]]


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> tuple[dict, str]:
    """(the llama fixture's tensors, a folder holding the new weights with the fixture's other files)."""
    folder = str(tmp_path_factory.mktemp("new-weights"))
    return perturbed_checkpoint("llama", folder), folder


def _greedy(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def fresh(weights) -> list[list[int]]:
    """The greedy tokens of an engine started on the new weights."""
    return _greedy(LLM(weights[1], **small_engine_args()))


@pytest.fixture(scope="module")
def llm():
    return LLM(checkpoint("llama"), **small_engine_args(skip_precompile=False))


def test_an_updated_engine_gives_a_fresh_engines_tokens_compiling_nothing(llm, weights, fresh):
    tensors, folder = weights
    before = _greedy(llm)
    assert before != fresh  # (the new weights change the tokens)
    stacked = llm.engine.core.runner.params["layers"]["w_up"]
    assert llm.update_weights(folder) == 1
    assert stacked.is_deleted()  # written over in place: the devices never held two copies of it
    compiles = llm.stats()["compilations_after_warmup"]
    assert _greedy(llm) == fresh
    assert llm.stats()["compilations_after_warmup"] == compiles  # the steps run on as compiled
    # back to the first weights from arrays in memory, numpy and JAX alike
    in_memory = {name: jnp.asarray(t) if "mlp" in name else t for name, t in tensors.items()}
    assert llm.update_weights(in_memory) == 2
    assert _greedy(llm) == before
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]


def test_no_request_after_an_update_takes_a_page_cached_before_it(llm, weights, fresh):
    """A prompt cached under the old weights is computed anew after the update; so is a page a request running
    across the update fills after it (its KV still mixes both weights)."""
    tensors, folder = weights
    llm.update_weights(tensors)
    every_token = [t for prompt in PROMPTS for t in prompt["prompt_token_ids"]]
    long_prompt = {"prompt_token_ids": (every_token * 40)[:40]}  # two full pages and a part
    _greedy(llm, [long_prompt])
    core = llm.engine.core
    hits = core.scheduler.num_prefix_cache_hits
    _greedy(llm, [long_prompt])
    assert core.scheduler.num_prefix_cache_hits > hits  # (the prompt's pages are cached)
    # a request that runs across the update: its prompt computed, then the update, then it fills more pages
    llm.engine.add_request("across", long_prompt["prompt_token_ids"][:30],
                           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    running = core.scheduler.requests["across"]
    while running.num_computed_tokens < 30:
        llm.engine.step()
    llm.update_weights(folder)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    hits = core.scheduler.num_prefix_cache_hits
    after = _greedy(llm, [long_prompt])
    assert core.scheduler.num_prefix_cache_hits == hits
    assert after == _greedy(LLM(folder, **small_engine_args()), [long_prompt])
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "'model.layers.1.mlp.up_proj.weight' is missing"),
    (lambda t: t.update({"model.norm.weight": np.ones(3, np.float32)}), "'model.norm.weight' has shape"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": t["model.layers.0.self_attn.k_proj.weight"].T}),
     "k_proj.weight' has shape"),
])
def test_weights_that_do_not_fit_are_refused_before_anything_is_written(llm, weights, change, message):
    tensors, _ = weights
    llm.update_weights(tensors)
    before = _greedy(llm)
    wrong = perturbed(tensors, 1)
    change(wrong)
    with pytest.raises(ValueError, match=message):
        llm.update_weights(wrong)
    assert _greedy(llm) == before


def test_sources_that_are_not_weights_are_refused(llm, tmp_path):
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        llm.update_weights(str(tmp_path))
    with pytest.raises(ValueError, match="a folder path or a mapping"):
        llm.update_weights([1, 2])
    (tmp_path / "jaxserve_checkpoint.json").write_text("{}")
    with pytest.raises(ValueError, match="converted \\(orbax\\) folder"):
        llm.update_weights(str(tmp_path))


@pytest.mark.parametrize("options", [dict(tensor_parallel_size=4), dict(quantization="int8")],
                         ids=["tp4", "int8"])
def test_updates_under_tensor_parallelism_and_quantization_at_load(weights, options):
    """Tensor parallelism 4 over the fixture's KV heads repeats them in the new weights too; int8 weights are
    quantized again from the new full-precision ones."""
    tensors, folder = weights
    llm = LLM(checkpoint("llama"), **small_engine_args(**options))
    before = _greedy(llm)
    llm.update_weights(folder)
    assert _greedy(llm) == _greedy(LLM(folder, **small_engine_args(**options)))
    llm.update_weights(tensors)
    assert _greedy(llm) == before


def test_a_mixture_of_experts_under_expert_parallelism_takes_new_experts(tmp_path):
    """Each device reads only its experts of the new weights, as at start-up."""
    tensors = perturbed_checkpoint("qwen3-moe", str(tmp_path))
    prompts = [{"prompt_token_ids": p} for p in expected("qwen3-moe")["prompts"]]
    llm = LLM(checkpoint("qwen3-moe"), **small_engine_args(tensor_parallel_size=2, enable_expert_parallel=True))
    before = _greedy(llm, prompts)
    llm.update_weights(str(tmp_path))
    assert _greedy(llm, prompts) == _greedy(LLM(str(tmp_path), **small_engine_args()), prompts) != before
    llm.update_weights(tensors)
    assert _greedy(llm, prompts) == before
