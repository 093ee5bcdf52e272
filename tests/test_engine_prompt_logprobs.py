"""Prompt logprobs (vLLM's `prompt_logprobs`, the OpenAI `echo` scores) against Hugging Face.

The reference is HF's log_softmax over a full forward of each fixture prompt
(tests/fixtures/checkpoints/*/expected_prompt_logprobs.json, made by
scripts/make_prompt_logprob_fixtures.py). The engine runs with a small token budget so long prompts
are chunked, and a small KV pool so requests are preempted and recomputed mid-prompt; each prompt
token must still be scored exactly once, with HF's value.
"""

import json
import os

import numpy as np
import pytest

from helpers import checkpoint, small_engine_args
from jaxserve import LLM, SamplingParams

TOLERANCE = 1e-4
NUM_TOP = 5


def _reference(name: str) -> list[dict]:
    with open(os.path.join(checkpoint(name), "expected_prompt_logprobs.json")) as f:
        return json.load(f)["cases"]


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def engine_and_reference(request):
    # 32-token steps chunk every prompt over 32 tokens; 9 usable pages of 16 tokens cannot hold all
    # twelve prompts at once, so some are preempted and recomputed.
    llm = LLM(checkpoint(request.param), **small_engine_args(max_num_batched_tokens=32, num_pages=10,
                                                             skip_precompile=False))
    return llm, _reference(request.param)


def _check_against_hf(prompt_logprobs, case, num_top):
    assert len(prompt_logprobs) == len(case["prompt_token_ids"])
    assert prompt_logprobs[0] is None and case["token_logprobs"][0] is None
    for position in range(1, len(case["prompt_token_ids"])):
        token = case["prompt_token_ids"][position]
        entries = prompt_logprobs[position]
        assert abs(entries[token].logprob - case["token_logprobs"][position]) < TOLERANCE, position
        if case["rank_margins"][position] > TOLERANCE:  # a rank is only defined up to float noise
            assert entries[token].rank == case["ranks"][position], position
        top = sorted((e.rank, tid, e.logprob) for tid, e in entries.items() if e.rank <= num_top)
        if case["top5_gaps"][position] > TOLERANCE:
            assert [tid for _, tid, _ in top][:num_top] == case["top5_ids"][position][:num_top], position
        np.testing.assert_allclose([lp for _, _, lp in top][:num_top], case["top5_logprobs"][position][:num_top],
                                   atol=TOLERANCE)


def test_prompt_logprobs_match_hugging_face_through_chunking_and_preemption(engine_and_reference):
    llm, cases = engine_and_reference
    before = llm.stats()["preemptions"]
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=NUM_TOP, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": c["prompt_token_ids"]} for c in cases], params, use_tqdm=False)
    assert llm.stats()["preemptions"] > before, "the workload must force preemption"
    for output, case in zip(outputs, cases):
        _check_against_hf(output.prompt_logprobs, case, NUM_TOP)
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["compilations_after_warmup"] == 0


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(engine_and_reference):
    llm, cases = engine_and_reference
    case = max(cases, key=lambda c: len(c["prompt_token_ids"]))
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    (output,) = llm.generate({"prompt_token_ids": case["prompt_token_ids"]}, params, use_tqdm=False)
    assert output.finished and output.outputs[0].token_ids == [] and output.outputs[0].text == ""
    assert output.outputs[0].finish_reason == "length"
    _check_against_hf(output.prompt_logprobs, case, 0)
    assert all(len(entries) == 1 for entries in output.prompt_logprobs[1:]), "k=0: the prompt token alone"


def test_only_one_of_n_samples_scores_the_prompt_and_unasked_requests_get_none(engine_and_reference):
    llm, cases = engine_and_reference
    case = cases[5]
    asked, plain = llm.generate(
        [{"prompt_token_ids": case["prompt_token_ids"]}] * 2,
        [SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=4, prompt_logprobs=1),
         SamplingParams(max_tokens=4)],
        use_tqdm=False,
    )
    _check_against_hf(asked.prompt_logprobs, case, 1)
    assert plain.prompt_logprobs is None
    assert len(asked.outputs) == 3 and all(len(c.token_ids) == 4 for c in asked.outputs)
