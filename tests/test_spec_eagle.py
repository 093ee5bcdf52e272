"""EAGLE speculative decoding (spec_decode/eagle.py, model/eagle.py) with tiny random heads: an EAGLE-1 head on the
llama test checkpoint (tests/fixtures/checkpoints/llama-eagle, scripts/make_eagle_fixture.py) and an EAGLE-3 head on
the gemma2 one (gemma2-eagle3, scripts/make_eagle3_fixture.py: it reads the inputs of the target's layers 0, 2 and 3
side by side and proposes over a draft vocabulary of 96 of the target's 512 tokens), and that head's twin in
vllm-project/speculators' format with `norm_before_residual` (gemma2-eagle3-speculators,
scripts/make_speculators_eagle3_fixture.py).

Each head's proposals equal a torch reference (EAGLE-1: the target's features, the head's layer without its input
norm, the target's LM head; EAGLE-3: transformers' Gemma 2 and its `output_hidden_states`, the head built from
transformers' Llama pieces; each cross-checked against plain torch), right after the prefill and again after steps
that verified proposals (so the catch-up feeds the accepted tokens with the features kept in the target's pages).
Speculation never changes the output: greedy and seeded tokens equal the target's alone, under preemption by
recompute and by swap, and every page of both pools comes back. A random head is rarely accepted; the proposals'
equality with the reference is what shows it is the head as trained."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

from helpers import (
    check_same_tokens_under_preemption, check_seeded_runs_give_plain_tokens, checkpoint, expected, small_engine_args,
)
from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.model.eagle import read_head_config
from jaxserve.model.loader import SafetensorsFolder, TensorMapping
from jaxserve.model.registry import load_model_spec
from jaxserve.spec_decode.eagle import read_draft_tokens

HEADS = {"eagle": ("llama", "llama-eagle"), "eagle3": ("gemma2", "gemma2-eagle3")}  # method: (target, head)
# 23 usable pages of 16 tokens; every bucket compiled first (the output checks assert that nothing compiles later)
ENGINE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=32, num_pages=24, skip_precompile=False)
HIDDEN = 64  # both targets'


def speculative_config(method: str) -> dict:
    """The speculative_config of `method`'s head, proposing 4 tokens."""
    return {"method": method, "model": checkpoint(HEADS[method][1]), "num_speculative_tokens": 4}


def reference(method: str) -> dict:
    """The torch reference of `method`'s head (its folder's expected.json)."""
    return reference_of(checkpoint(HEADS[method][1]))


def reference_of(head: str) -> dict:
    """The torch reference of the head in the folder `head`."""
    with open(os.path.join(head, "expected.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module", params=list(HEADS))
def method(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def whole_prompts(method):
    """An engine with `method`'s head whose step budget takes every prompt at once (compiled as it goes)."""
    return LLM(checkpoint(HEADS[method][0]), speculative_config=speculative_config(method),
               **small_engine_args(max_num_batched_tokens=512, max_num_seqs=16, skip_precompile=True))


def _running(llm) -> dict[int, object]:
    """The engine's running requests by prompt index (requests are named r<index>)."""
    return {int(request.request_id[1:]): request for request in llm.engine.core.scheduler.running}


def _finish(llm) -> None:
    """Run the engine until nothing is left; every page of both pools is back."""
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["draft_kv_pages_free"] == stats["draft_kv_pages_total"]


def _prefilled(llm, want: dict) -> list:
    """The reference's prompts added and computed in one step, their first tokens the reference's: the requests."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for index, prompt in enumerate(want["prompts"]):
        llm.engine.add_request(f"r{index}", prompt, params)
    llm.engine.step()  # every prompt computed, its first token sampled
    running = _running(llm)
    assert all(running[i].num_known_tokens == len(p) + 1 for i, p in enumerate(want["prompts"]))
    requests = [running[i] for i in range(len(want["prompts"]))]
    assert [r.token_ids(r.num_known_tokens - 1, r.num_known_tokens) for r in requests] == [
        [token] for token in want["first_tokens"]]
    return requests


def test_proposals_after_the_prefill_equal_the_reference(method, whole_prompts):
    engine, want = whole_prompts.engine, reference(method)
    prompts = want["prompts"]
    requests = _prefilled(whole_prompts, want)
    assert engine.core.draft.propose(requests) == want["proposals"]
    if method == "eagle3":  # the first of the three inputs kept is layer 0's: Gemma's embedding times sqrt(H)
        core, prompt = engine.core, prompts[-1]
        positions = np.arange(len(prompt))
        pages = np.asarray(core.kv.page_ids(requests[-1].request_id))[positions // 16]
        features = np.asarray(core.runner.kv_caches[-1])[0, pages, positions % 16, 0]  # (prompt, 3H)
        assert features.shape == (len(prompt), 3 * HIDDEN)
        embed = SafetensorsFolder(checkpoint("gemma2")).get("model.embed_tokens.weight")  # (V, H)
        np.testing.assert_allclose(features[:, :HIDDEN], embed[prompt] * np.float32(HIDDEN**0.5), rtol=1e-6)
    _finish(whole_prompts)


def test_eagle3_proposals_under_tensor_parallelism_equal_the_reference():
    # the target, its three layers' inputs and the head (2 KV heads each) split over two devices
    method = "eagle3"
    llm = LLM(checkpoint(HEADS[method][0]), speculative_config=speculative_config(method), tensor_parallel_size=2,
              **small_engine_args(max_num_batched_tokens=512, max_num_seqs=16, skip_precompile=True))
    want = reference(method)
    assert llm.engine.core.draft.propose(_prefilled(llm, want)) == want["proposals"]
    _finish(llm)


def test_proposals_after_verified_steps_equal_the_reference(method, whole_prompts):
    # The engine's own steps propose and verify; once a request knows its prompt and 3 tokens, the head (caught
    # up on the accepted tokens' features) must propose what the reference does from there.
    engine, want = whole_prompts.engine, reference(method)
    prompts = want["prompts"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    checked = {}
    drafts_before = whole_prompts.stats()["spec_decode"]["num_drafts"]
    while len(checked) < len(prompts):
        engine.step()
        for index, request in _running(whole_prompts).items():
            length = len(prompts[index])
            if index not in checked and request.num_known_tokens >= length + 3:
                assert request.num_known_tokens == length + 3, "a proposal was accepted: pick another check"
                assert request.token_ids(length, length + 3) == want["later_known"][index]
                checked[index] = engine.core.draft.propose([request])[0]
    assert [checked[i] for i in range(len(prompts))] == want["later_proposals"]
    assert whole_prompts.stats()["spec_decode"]["num_drafts"] - drafts_before >= 2 * len(prompts)
    _finish(whole_prompts)


@pytest.fixture(scope="module")
def plain(method):
    return LLM(checkpoint(HEADS[method][0]), **small_engine_args(**ENGINE_ARGS))


@pytest.fixture(scope="module")
def eagle(method):
    return LLM(checkpoint(HEADS[method][0]), speculative_config=speculative_config(method),
               **small_engine_args(**ENGINE_ARGS))


def test_greedy_tokens_are_the_targets_under_preemption(method, plain, eagle):
    prompts, want = reference(method)["prompts"], expected(HEADS[method][0])["outputs"]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    moved = check_same_tokens_under_preemption(plain, eagle, prompts, greedy.clone(max_tokens=50))
    assert 0 < moved["num_drafts"] <= moved["num_draft_tokens"] <= 4 * moved["num_drafts"]
    assert [list(o.outputs[0].token_ids) for o in eagle.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)] == want


def test_seeded_sampling_gives_the_targets_tokens(method, plain, eagle):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, n=2)
    check_seeded_runs_give_plain_tokens(plain, eagle, reference(method)["prompts"][:6], params)


def test_swap_preemption_keeps_the_features_with_the_pages():
    # EAGLE-3's three layers' inputs (3H) go to the host with the KV (EAGLE-1's final states, H, by the same copy)
    method = "eagle3"
    target = HEADS[method][0]
    llm = LLM(checkpoint(target), speculative_config=speculative_config(method), preemption_mode="swap",
              swap_space=0.01, **small_engine_args(**{**ENGINE_ARGS, "skip_precompile": True}))
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in reference(method)["prompts"] * 2], greedy,
                           use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected(target)["outputs"] * 2
    stats = llm.stats()
    assert stats["swapped_out_pages"] > 0, "the pool was sized to swap"
    assert llm.engine.core.runner.host_swap.pages[-1].shape[-1] == 3 * HIDDEN
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["draft_kv_pages_free"] == stats["draft_kv_pages_total"]


def test_bad_eagle_configs_are_value_errors():
    with pytest.raises(ValueError, match="method eagle needs `model`"):
        EngineConfig(speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="method eagle3 needs `model`"):
        EngineConfig(speculative_config={"method": "eagle3"})
    with pytest.raises(ValueError, match="method eagle3 keeps the target's features .* kv_cache_dtype auto"):
        EngineConfig(speculative_config=speculative_config("eagle3"), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="one-layer Llama head"):
        LLM(checkpoint("llama"), speculative_config={**speculative_config("eagle"), "model": checkpoint("qwen3")},
            **small_engine_args(skip_precompile=True))


# ---- an EAGLE-3 head's folder ---------------------------------------------------------------------------------------

HEAD3 = checkpoint("gemma2-eagle3")
TARGET3 = load_model_spec(checkpoint("gemma2"))


def test_the_head_reads_its_layers_and_vocabulary():
    head = read_head_config(HEAD3, "eagle3", TARGET3)
    assert (head.version, head.features.layers, head.features.width) == (3, (0, 2, 3), 3 * 64)
    assert head.draft_vocab_size == 96 and head.spec.num_layers == 1
    tokens = read_draft_tokens(SafetensorsFolder(HEAD3), 96, 512)
    assert tokens.tolist() == reference("eagle3")["draft_vocab"]


def _head_copy(tmp_path, **changes) -> str:
    """The fixture head in a folder of its own, its config.json changed (a None value removes the key)."""
    folder = tmp_path / "head"
    shutil.copytree(HEAD3, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    config = {key: value for key, value in config.items() if value is not None}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_without_layer_ids_the_head_reads_vllms_layers(tmp_path):
    head = _head_copy(tmp_path, eagle_aux_hidden_state_layer_ids=None)
    deep = dataclasses.replace(TARGET3, num_layers=32)
    assert read_head_config(head, "eagle3", deep).features.layers == (2, 16, 29)
    # the ids are taken in layer order, as vLLM collects them
    unsorted = _head_copy(tmp_path / "b", eagle_aux_hidden_state_layer_ids=[3, 0, 2])
    assert read_head_config(unsorted, "eagle3", TARGET3).features.layers == (0, 2, 3)


@pytest.mark.parametrize("changes, message", [
    ({"eagle_aux_hidden_state_layer_ids": [0, 2, 2]}, "three distinct layers"),
    ({"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}, "three distinct layers of the target's 4"),
    ({"eagle_aux_hidden_state_layer_ids": None}, r"inputs of the target's layers \[2, 2, 1\]"),  # vLLM's, for 4
    ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state false"),
    ({"num_hidden_layers": 2}, "one-layer Llama head"),
    ({"target_hidden_size": 128}, "a head is trained for one target"),
    ({"draft_vocab_size": 1024}, "at most the target's 512"),
])
def test_heads_that_do_not_fit_are_value_errors(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        read_head_config(_head_copy(tmp_path, **changes), "eagle3", TARGET3)


# ---- the speculators format -------------------------------------------------------------------------------------

SPECULATORS = checkpoint("gemma2-eagle3-speculators")  # scripts/make_speculators_eagle3_fixture.py


def test_a_speculators_heads_proposals_equal_its_reference():
    """A head in vllm-project/speculators' format (its layer's config under transformer_layer_config, defaults left
    out; tensors layers.0.*; norm_before_residual: its residual is the normed hidden state) proposes as its torch
    reference does; read as an EAGLE-3 head that keeps the raw residual, it would not."""
    head = read_head_config(SPECULATORS, "eagle3", TARGET3)
    assert head.spec.norm_before_residual and head.spec.rms_norm_eps == 1e-6 and head.spec.num_layers == 1
    want = reference_of(SPECULATORS)
    config = {"method": "eagle3", "model": SPECULATORS, "num_speculative_tokens": 4}
    llm = LLM(checkpoint("gemma2"), speculative_config=config,
              **small_engine_args(max_num_batched_tokens=512, max_num_seqs=16, skip_precompile=True))
    assert llm.engine.core.draft.propose(_prefilled(llm, want)) == want["proposals"]
    _finish(llm)


def _speculators_copy(tmp_path, **changes) -> str:
    """The speculators fixture head in a folder of its own, its config.json's keys (and `layer`: its layer
    config's) changed."""
    folder = tmp_path / "head"
    shutil.copytree(SPECULATORS, folder)
    config = json.loads((folder / "config.json").read_text())
    config["transformer_layer_config"].update(changes.pop("layer", {}))
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return str(folder)


def test_a_speculators_head_without_norm_before_residual_takes_vllms_default(tmp_path):
    config = json.loads(open(os.path.join(SPECULATORS, "config.json")).read())
    del config["norm_before_residual"]
    folder = tmp_path / "head"
    shutil.copytree(SPECULATORS, folder)
    (folder / "config.json").write_text(json.dumps(config))
    assert read_head_config(str(folder), "eagle3", TARGET3).spec.norm_before_residual
    off = _speculators_copy(tmp_path / "off", norm_before_residual=False)
    assert not read_head_config(off, "eagle3", TARGET3).spec.norm_before_residual


@pytest.mark.parametrize("changes, message", [
    ({"speculators_model_type": "mlp"}, "a speculators 'mlp' head: only eagle3"),
    ({"norm_before_fc": True}, "sets norm_before_fc: such heads are not supported"),
    ({"fc_norm": True, "norm_output": True}, "sets fc_norm, norm_output"),
    ({"layer": {"model_type": "qwen3"}}, "a qwen3 layer: only Llama layers"),
    ({"layer": {"num_hidden_layers": 2}}, "one-layer Llama head"),
])
def test_speculators_heads_that_do_not_fit_are_value_errors(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        read_head_config(_speculators_copy(tmp_path, **changes), "eagle3", TARGET3)


def test_the_method_must_be_the_heads():
    with pytest.raises(ValueError, match="EAGLE-3 head: use speculative_config method eagle3"):
        read_head_config(HEAD3, "eagle", TARGET3)
    with pytest.raises(ValueError, match="EAGLE-1 head: use speculative_config method eagle$"):
        read_head_config(checkpoint("llama-eagle"), "eagle3", load_model_spec(checkpoint("llama")))


@pytest.mark.parametrize("tensors, message", [
    ({}, "no `d2t` tensor"),
    ({"d2t": np.full((96,), 500, np.int64)}, "distinct ids of the target's vocabulary of 512"),
    ({"d2t": np.zeros((96,), np.int64) - np.arange(96) % 2}, "distinct ids"),  # draft ids 2k and 2k + 1 both 2k
    ({"d2t": np.zeros((95,), np.int64)}, r"d2t \(shape \(95,\)\) must map its 96 ids"),
])
def test_bad_draft_vocabularies_are_value_errors(tensors, message):
    with pytest.raises(ValueError, match=message):
        read_draft_tokens(TensorMapping(tensors), 96, 512)


def test_a_target_that_cannot_give_its_layers_inputs_refuses_eagle3(monkeypatch):
    from jaxserve.model import registry

    llama = registry.model_for("LlamaForCausalLM")
    untapped = type("UntappedForCausalLM", (), {"__call__": llama.module.__call__})  # a module without `tapped`
    monkeypatch.setitem(registry._MODELS, "UntappedForCausalLM", dataclasses.replace(llama, module=untapped))
    target = dataclasses.replace(TARGET3, architecture="UntappedForCausalLM")
    with pytest.raises(ValueError, match="UntappedForCausalLM does not give its layers' hidden states"):
        read_head_config(HEAD3, "eagle3", target)
