"""Tensor parallelism on simulated CPU devices: same greedy tokens as HF for TP 2 and 4, including
models with fewer KV heads than the TP size (their KV heads are replicated, as vLLM does), Gemma, and mixtures of
experts with each expert split (TP) or the experts split whole (expert parallelism); gpt-oss's attention sinks
split with their heads (its experts split within, at TP 2: tests/test_mxfp4_checkpoint.py); DeepSeek-V3's query
heads split over the devices, each holding the one latent KV head."""

import jax
import pytest

from jaxserve import LLM, SamplingParams
from helpers import checkpoint, expected, small_engine_args

# (architecture, KV heads in the checkpoint, tensor-parallel size, experts split whole over the devices)
CASES = [("qwen2", 1, 2, False), ("llama", 2, 4, False), ("qwen3", 2, 2, False),
         ("gemma3", 1, 2, False), ("mixtral", 2, 2, False), ("qwen3-moe", 2, 2, True),
         ("qwen2-moe", 2, 2, True), ("olmo2", 2, 4, False), ("gpt-oss", 2, 2, True), ("deepseek-v3", 1, 2, False),
         ("deepseek-v3", 1, 4, True)]


@pytest.mark.parametrize("name,kv_heads,tp,expert_parallel", CASES,
                         ids=[f"{n}-tp{t}" + ("-ep" if e else "") for n, _, t, e in CASES])
def test_greedy_matches_hf_under_tensor_parallelism(name, kv_heads, tp, expert_parallel):
    assert len(jax.devices()) >= 4, "conftest sets four simulated CPU devices"
    llm = LLM(checkpoint(name), tensor_parallel_size=tp, enable_expert_parallel=expert_parallel,
              **small_engine_args(max_model_len=96, max_num_batched_tokens=32, max_num_seqs=16, num_pages=24,
                                  skip_precompile=True))
    runner = llm.engine.core.runner
    # Heads really are split: every device holds 1/tp of the query projection and of the KV pages.
    wq = runner.params["layers"].get("wq", runner.params["layers"].get("wq_b"))  # DeepSeek's low-rank q: wq_b
    assert wq.addressable_shards[0].data.shape[-1] == wq.shape[-1] // tp
    assert runner.kv_caches[0].shape[3] == max(kv_heads, tp)
    assert runner.kv_caches[0].addressable_shards[0].data.shape[3] == max(kv_heads, tp) // tp
    if "router" in runner.params["layers"]:  # experts (L, E, H, I): split whole, or each by its inner size
        w_gate = runner.params["layers"].get("w_gate", runner.params["layers"].get("w_gate_up"))  # gpt-oss fuses
        axis = 1 if expert_parallel else 3
        assert w_gate.addressable_shards[0].data.shape[axis] == w_gate.shape[axis] // tp
    if "shared_w_gate" in runner.params["layers"]:  # a shared expert (L, H, Is): split like a dense MLP
        shared = runner.params["layers"]["shared_w_gate"]
        assert shared.addressable_shards[0].data.shape[-1] == shared.shape[-1] // tp

    want = expected(name)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in want["prompts"]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want["outputs"]
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]
