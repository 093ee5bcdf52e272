"""EAGLE-1 speculative decoding (spec/eagle.py, model/eagle.py) on the llama test checkpoint with a tiny random
head (tests/fixtures/checkpoints/llama-eagle, scripts/make_eagle_fixture.py).

The head's proposals equal a torch reference built from transformers' pieces (the target's features, the head's
layer without its input norm, the target's LM head), right after the prefill and again after steps that verified
proposals (so the catch-up feeds the accepted tokens with the target's features kept in its pages). Speculation
never changes the output: greedy and seeded tokens equal the target's alone, under preemption by recompute and by
swap, and every page of both pools comes back. A random head is rarely accepted; the proposals' equality with the
reference is what shows it is the head as trained."""

from __future__ import annotations

import json
import os

import pytest

from helpers import (
    check_same_tokens_under_preemption, check_seeded_runs_give_plain_tokens, checkpoint, expected, small_engine_args,
)
from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig

EAGLE = {"method": "eagle", "model": checkpoint("llama-eagle"), "num_speculative_tokens": 4}
with open(os.path.join(checkpoint("llama-eagle"), "expected.json")) as f:
    REFERENCE = json.load(f)
PROMPTS = REFERENCE["prompts"]
ENGINE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=32, num_pages=24)  # 23 usable pages of 16 tokens


@pytest.fixture(scope="module")
def whole_prompts():
    """An EAGLE engine whose step budget takes every prompt at once (compiled as it goes)."""
    return LLM(checkpoint("llama"), speculative_config=EAGLE,
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


def test_proposals_after_the_prefill_equal_the_reference(whole_prompts):
    engine = whole_prompts.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{index}", prompt, params)
    engine.step()  # every prompt computed, its first token sampled
    running = _running(whole_prompts)
    assert all(running[i].num_known_tokens == len(p) + 1 for i, p in enumerate(PROMPTS))
    requests = [running[i] for i in range(len(PROMPTS))]
    assert [r.token_ids(r.num_known_tokens - 1, r.num_known_tokens) for r in requests] == [
        [token] for token in REFERENCE["first_tokens"]]
    assert engine.core.draft.propose(requests) == REFERENCE["proposals"]
    _finish(whole_prompts)


def test_proposals_after_verified_steps_equal_the_reference(whole_prompts):
    # The engine's own steps propose and verify; once a request knows its prompt and 3 tokens, the head (caught
    # up on the accepted tokens' features) must propose what the reference does from there.
    engine = whole_prompts.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{index}", prompt, params)
    checked = {}
    drafts_before = whole_prompts.stats()["spec_decode"]["num_drafts"]
    while len(checked) < len(PROMPTS):
        engine.step()
        for index, request in _running(whole_prompts).items():
            length = len(PROMPTS[index])
            if index not in checked and request.num_known_tokens >= length + 3:
                assert request.num_known_tokens == length + 3, "a proposal was accepted: pick another check"
                assert request.token_ids(length, length + 3) == REFERENCE["later_known"][index]
                checked[index] = engine.core.draft.propose([request])[0]
    assert [checked[i] for i in range(len(PROMPTS))] == REFERENCE["later_proposals"]
    assert whole_prompts.stats()["spec_decode"]["num_drafts"] - drafts_before >= 2 * len(PROMPTS)
    _finish(whole_prompts)


@pytest.fixture(scope="module")
def plain():
    return LLM(checkpoint("llama"), **small_engine_args(**ENGINE_ARGS))


@pytest.fixture(scope="module")
def eagle():
    return LLM(checkpoint("llama"), speculative_config=EAGLE, **small_engine_args(**ENGINE_ARGS))


def test_greedy_tokens_are_the_targets_under_preemption(plain, eagle):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    moved = check_same_tokens_under_preemption(plain, eagle, PROMPTS, greedy.clone(max_tokens=50))
    assert 0 < moved["num_drafts"] <= moved["num_draft_tokens"] <= 4 * moved["num_drafts"]
    want = expected("llama")["outputs"]
    assert [list(o.outputs[0].token_ids) for o in eagle.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)] == want


def test_seeded_sampling_gives_the_targets_tokens(plain, eagle):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, n=2)
    check_seeded_runs_give_plain_tokens(plain, eagle, PROMPTS[:6], params)


def test_swap_preemption_keeps_the_features_with_the_pages():
    llm = LLM(checkpoint("llama"), speculative_config=EAGLE, preemption_mode="swap", swap_space=0.01,
              **small_engine_args(**ENGINE_ARGS, skip_precompile=True))
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS * 2], greedy, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected("llama")["outputs"] * 2
    stats = llm.stats()
    assert stats["swapped_out_pages"] > 0, "the pool was sized to swap"
    assert llm.engine.core.runner.host_swap.pages[-1].shape[-1] == 64  # the features go to the host with the KV
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["draft_kv_pages_free"] == stats["draft_kv_pages_total"]


def test_bad_eagle_configs_are_value_errors():
    with pytest.raises(ValueError, match="method eagle needs `model`"):
        EngineConfig(speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="kv_cache_dtype auto"):
        EngineConfig(speculative_config=EAGLE, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="one-layer LlamaForCausalLM"):
        LLM(checkpoint("llama"), speculative_config={**EAGLE, "model": checkpoint("qwen3")},
            **small_engine_args(skip_precompile=True))
