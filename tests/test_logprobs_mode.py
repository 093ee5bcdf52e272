"""vLLM's `logprobs_mode` on the engine: processed_logprobs reports the distribution each token was sampled from
(temperature and top-k applied: the kept tokens' probabilities sum to 1, the others are -inf), the same through
speculative verification as through plain sampling; the sampler's own test (tests/test_sampler.py) checks every
mode's values against numpy."""

from __future__ import annotations

import math

import pytest

from helpers import checkpoint, small_engine_args
from jaxserve import LLM, SamplingParams

ENGINE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=32, num_pages=32, skip_precompile=True,
                   logprobs_mode="processed_logprobs")
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_processed_logprobs_are_the_sampled_distributions_in_plain_and_speculative_steps():
    plain = LLM(checkpoint("llama"), **small_engine_args(**ENGINE_ARGS))
    spec = LLM(checkpoint("llama"), **small_engine_args(**ENGINE_ARGS, speculative_config=SPEC))
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]}, {"prompt_token_ids": [9, 10, 9, 10, 9]}]
    params = SamplingParams(temperature=0.7, top_k=3, seed=11, max_tokens=16, ignore_eos=True, logprobs=4)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert spec.stats()["spec_decode"]["num_draft_tokens"] > 0
    for plain_output, spec_output in zip(want, got):
        completion = plain_output.outputs[0]
        assert spec_output.outputs[0].token_ids == completion.token_ids
        for token, entries, spec_entries in zip(completion.token_ids, completion.logprobs,
                                                spec_output.outputs[0].logprobs, strict=True):
            kept = [entry.logprob for entry in entries.values() if entry.logprob > -math.inf]
            assert len(kept) == 3 and sum(math.exp(value) for value in kept) == pytest.approx(1.0, abs=1e-4)
            assert entries[token].logprob > -math.inf
            for token_id, entry in entries.items():
                assert spec_entries[token_id].rank == entry.rank
                assert spec_entries[token_id].logprob == pytest.approx(entry.logprob, abs=1e-4)
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        LLM(checkpoint("llama"), **small_engine_args(**{**ENGINE_ARGS, "logprobs_mode": "processed"}))
