"""Greedy outputs equal Hugging Face transformers token for token, for every supported architecture,
with many requests in flight, a pool small enough to force preemption, and each request alone."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from helpers import checkpoint, expected, small_engine_args

# (architecture, page size, pages in the pool): pools far too small for 36 requests of up to 90 tokens.
CASES = [
    ("llama", 8, 40),
    ("llama-linear", 16, 20),
    ("mistral", 8, 40),
    ("qwen2", 16, 20),
    ("qwen3", 8, 40),
    ("gemma2", 8, 40),  # sliding and full layers, soft caps
    ("gemma3", 16, 20),  # local and global rope, q/k norms
    ("mixtral", 8, 40),  # 4 experts, top 2
    ("qwen3-moe", 16, 20),  # 8 experts, top 3
    ("qwen2-moe", 8, 40),  # 4 experts, top 2 not renormalised, a shared expert
    ("granite", 16, 20),  # embedding, attention, residual and logits multipliers
    ("olmo2", 8, 40),  # norms after the sub-layers, q/k norms over the whole width
    ("gemma", 16, 20),  # (1 + w) norms, GeGLU, scaled tied embeddings, one KV head
    ("gpt-oss", 8, 40),  # attention sinks, sliding and full layers, YaRN, biased experts with a clamped GLU
    # multi-head latent attention (absorbed: one latent KV head), interleaved YaRN rope with its mscale, a dense
    # layer, then sigmoid group-limited routing with a score-correction bias and a shared expert
    ("deepseek-v3", 8, 40),
    ("deepseek-v3-q-proj", 16, 20),  # one q_proj, every layer sparse, two shared experts, rotate-half rope
]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module", params=CASES, ids=[f"{name}-page{size}" for name, size, _ in CASES])
def case(request):
    name, page_size, num_pages = request.param
    llm = LLM(checkpoint(name), **small_engine_args(page_size=page_size, num_pages=num_pages, max_num_seqs=48,
                                                              skip_precompile=True))
    return llm, expected(name)


def _token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_greedy_matches_hf_with_36_in_flight_and_preemption(case):
    llm, want = case
    copies = 3
    outputs = llm.generate(_token_prompts(want["prompts"] * copies), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want["outputs"] * copies
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    stats = llm.stats()
    assert stats["preemptions"] > 0, "the pool was sized to force preemption"
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_each_request_alone_matches_hf(case):
    """A batch of one (its own row bucket, no preemption): the prompts of 1, 16, 17 and 70 tokens, one token, a page
    boundary either side (pages of 8 and 16) and the longest; every prompt is checked batched above."""
    llm, want = case
    alone = [index for index, prompt in enumerate(want["prompts"]) if len(prompt) in (1, 16, 17, 70)]
    assert len(alone) == 4
    for index in alone:
        (result,) = llm.generate(_token_prompts([want["prompts"][index]]), GREEDY, use_tqdm=False)
        assert result.outputs[0].token_ids == want["outputs"][index]


def test_first_token_logprobs_match_hf_logits(case):
    llm, want = case
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    outputs = llm.generate(_token_prompts(want["prompts"]), params, use_tqdm=False)
    for result, logits in zip(outputs, want["logits"]):
        hf_logprobs = logits - np.logaddexp.reduce(logits.astype(np.float64))  # (V,)
        entry = result.outputs[0].logprobs[0]
        top5 = np.argsort(-hf_logprobs)[:5]
        assert [tid for tid, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)] == top5.tolist()
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(hf_logprobs[token_id], abs=1e-4)
        assert result.outputs[0].cumulative_logprob == pytest.approx(hf_logprobs[top5[0]], abs=1e-4)
