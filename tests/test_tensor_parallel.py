"""Tensor parallelism on simulated CPU devices: same greedy tokens as HF for TP 2 and 4, including
models with fewer KV heads than the TP size (their KV heads are replicated, as vLLM does)."""

import jax
import pytest

from jaxserve import LLM, SamplingParams
from helpers import checkpoint, expected, small_engine_args

# (architecture, KV heads in the checkpoint, tensor-parallel size)
CASES = [("qwen2", 1, 2), ("qwen2", 1, 4), ("llama", 2, 4), ("qwen3", 2, 2)]


@pytest.mark.parametrize("name,kv_heads,tp", CASES, ids=[f"{n}-tp{t}" for n, _, t in CASES])
def test_greedy_matches_hf_under_tensor_parallelism(name, kv_heads, tp):
    assert len(jax.devices()) >= 4, "conftest sets four simulated CPU devices"
    llm = LLM(checkpoint(name), tensor_parallel_size=tp,
              **small_engine_args(max_model_len=96, max_num_batched_tokens=32, max_num_seqs=16, num_pages=24))
    runner = llm.engine.core.runner
    # Heads really are split: every device holds 1/tp of the query projection and of the KV pages.
    wq = runner.params["layers"]["wq"]
    assert wq.addressable_shards[0].data.shape[-1] == wq.shape[-1] // tp
    assert runner.kv_caches[0].shape[3] == max(kv_heads, tp)
    assert runner.kv_caches[0].addressable_shards[0].data.shape[3] == max(kv_heads, tp) // tp

    want = expected(name)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in want["prompts"]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want["outputs"]
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]
