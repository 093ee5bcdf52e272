"""Embeddings (runner pooling, `LLM.embed`) against Hugging Face: each prompt's final hidden states (`AutoModel`'s
`last_hidden_state`) pooled LAST, MEAN or CLS (tests/fixtures/checkpoints/*/expected_embeddings.json, made by
scripts/make_embedding_fixtures.py).

The engines run with 32-token steps, so the longer prompts are pooled over several chunks; a small KV pool with
growing generation requests beside them preempts pooling requests mid-prompt, which are recomputed and must pool
each position once.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from helpers import checkpoint, small_engine_args
from jaxserve import LLM, PoolingParams, PoolingRequestOutput, RequestOutput, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.pooling.params import PoolerConfig, resolve_pooler_config

TOLERANCE = 2e-5
CHUNKED = dict(max_num_batched_tokens=32)


def _cases(name: str) -> list[dict]:
    with open(os.path.join(checkpoint(name), "expected_embeddings.json")) as f:
        return json.load(f)["cases"]


def _prompts(cases: list[dict]) -> list[dict]:
    return [{"prompt_token_ids": case["prompt_token_ids"]} for case in cases]


def _normalized(vector) -> np.ndarray:
    vector = np.asarray(vector, np.float64)
    return vector / np.linalg.norm(vector)


def _pooling_engine(name: str, pooling_type: str, normalize: bool = False, **overrides) -> LLM:
    return LLM(checkpoint(name), runner="pooling", pooler_config={"pooling_type": pooling_type, "normalize": normalize},
               **small_engine_args(**{**CHUNKED, **overrides}))


@pytest.fixture(scope="module")
def llama_last() -> LLM:
    """Every bucket compiled at start-up (the pooling buckets among them)."""
    return _pooling_engine("llama", "LAST", skip_precompile=False)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_embeddings_match_hugging_face_pooled_hidden_states(name, pooling_type, llama_last):
    llm = llama_last if (name, pooling_type) == ("llama", "LAST") else _pooling_engine(
        name, pooling_type, skip_precompile=True)
    cases = _cases(name)
    outputs = llm.embed(_prompts(cases), use_tqdm=False)
    for output, case in zip(outputs, cases):
        assert isinstance(output, PoolingRequestOutput) and output.finished and output.error is None
        assert output.prompt_token_ids == case["prompt_token_ids"]
        np.testing.assert_allclose(output.outputs.embedding, case[pooling_type], atol=TOLERANCE, rtol=TOLERANCE)
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["generation_tokens"] == 0
    if llm is llama_last:
        assert stats["compilations_after_warmup"] == 0


def test_normalize_by_default_and_per_request(llama_last):
    case = _cases("llama")[9]
    prompt = {"prompt_token_ids": case["prompt_token_ids"]}
    raw, unit = llama_last.embed([prompt, prompt], [PoolingParams(), PoolingParams(normalize=True)], use_tqdm=False)
    np.testing.assert_allclose(raw.outputs.embedding, case["LAST"], atol=TOLERANCE, rtol=TOLERANCE)
    np.testing.assert_allclose(unit.outputs.embedding, _normalized(case["LAST"]), atol=TOLERANCE)
    default = LLM(checkpoint("llama"), runner="pooling", **small_engine_args(**CHUNKED, skip_precompile=True))
    (output,) = default.embed(prompt, use_tqdm=False)  # vLLM's default pooler for a decoder: LAST, normalized
    np.testing.assert_allclose(output.outputs.embedding, _normalized(case["LAST"]), atol=TOLERANCE)


def test_a_prompt_of_max_model_len_embeds_and_a_longer_one_is_refused_or_truncated(llama_last):
    max_len = llama_last.engine.max_model_len
    tokens = [5 + i % 50 for i in range(max_len)]
    (whole,) = llama_last.embed({"prompt_token_ids": tokens}, use_tqdm=False)
    assert len(whole.outputs.embedding) == 64 and whole.finished
    with pytest.raises(ValueError, match="max_model_len"):
        llama_last.embed({"prompt_token_ids": tokens + [7]}, use_tqdm=False)
    (cut,) = llama_last.embed({"prompt_token_ids": [7] + tokens}, PoolingParams(truncate_prompt_tokens=max_len),
                              use_tqdm=False)
    assert cut.prompt_token_ids == tokens
    np.testing.assert_allclose(cut.outputs.embedding, whole.outputs.embedding, atol=TOLERANCE)


def test_last_token_pooling_reuses_cached_prefixes_and_mean_pooling_does_not(llama_last):
    case = _cases("llama")[11]  # 70 tokens: four full pages of 16 can be cached
    prompt = {"prompt_token_ids": case["prompt_token_ids"]}
    llama_last.embed(prompt, use_tqdm=False)
    hits = llama_last.stats()["prefix_cache_hits"]
    (again,) = llama_last.embed(prompt, use_tqdm=False)
    assert llama_last.stats()["prefix_cache_hits"] - hits == 64 and again.num_cached_tokens == 64
    np.testing.assert_allclose(again.outputs.embedding, case["LAST"], atol=TOLERANCE, rtol=TOLERANCE)
    mean = _pooling_engine("llama", "MEAN", skip_precompile=True)
    mean.embed(prompt, use_tqdm=False)
    (again,) = mean.embed(prompt, use_tqdm=False)  # MEAN needs every position's state: none is skipped
    assert mean.stats()["prefix_cache_hits"] == 0 and again.num_cached_tokens == 0
    np.testing.assert_allclose(again.outputs.embedding, case["MEAN"], atol=TOLERANCE, rtol=TOLERANCE)


def _run_together(llm: LLM, generate: list[list[int]], params: SamplingParams, embed: list[list[int]]) -> dict:
    """Queue generation and embedding requests in one engine (they share its steps) and run them to the end;
    request id -> final output."""
    engine = llm.engine
    for index, tokens in enumerate(generate):
        engine.submit(f"gen-{index}", engine.make_requests(f"gen-{index}", tokens, params))
    for index, tokens in enumerate(embed):
        engine.submit(f"emb-{index}", engine.make_pooling_requests(f"emb-{index}", tokens))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({output.request_id: output for output in engine.step() if output.finished})
    return finished


def test_pooling_through_preemption_by_recompute_beside_generation():
    # 9 usable pages of 16 tokens; three generation requests grow to 5 pages each, so the most recently admitted
    # requests (pooling ones among them, mid-prompt) are preempted and computed again.
    llm = _pooling_engine("llama", "MEAN", num_pages=10, skip_precompile=True)
    cases = _cases("llama")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    generate = [case["prompt_token_ids"] for case in cases[8:11]]
    finished = _run_together(llm, generate, params, [case["prompt_token_ids"] for case in cases])
    assert llm.stats()["preemptions"] > 0
    pooled = [finished[f"emb-{index}"] for index in range(len(cases))]
    assert any(output.metrics.num_preemptions for output in pooled), "a pooling request must have been preempted"
    for output, case in zip(pooled, cases):
        np.testing.assert_allclose(output.outputs.embedding, case["MEAN"], atol=TOLERANCE, rtol=TOLERANCE)
    alone = llm.generate([{"prompt_token_ids": tokens} for tokens in generate], params, use_tqdm=False)
    for index, output in enumerate(alone):
        assert isinstance(finished[f"gen-{index}"], RequestOutput)
        assert finished[f"gen-{index}"].outputs[0].token_ids == output.outputs[0].token_ids
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_an_aborted_embedding_returns_its_pages_and_no_vector(llama_last):
    engine = llama_last.engine
    engine.submit("abort-me", engine.make_pooling_requests("abort-me", _cases("llama")[11]["prompt_token_ids"]))
    engine.step()  # the first 32-token chunk runs
    output = engine.abort_request("abort-me")
    assert output.finished and output.outputs is None
    while engine.has_unfinished_requests():
        engine.step()
    stats = llama_last.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_matryoshka_dimensions_only_where_the_model_declares_them(llama_last, tmp_path):
    prompt = {"prompt_token_ids": _cases("llama")[5]["prompt_token_ids"]}
    with pytest.raises(ValueError, match="Matryoshka"):
        llama_last.embed(prompt, PoolingParams(dimensions=16), use_tqdm=False)
    folder = tmp_path / "matryoshka"
    shutil.copytree(checkpoint("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    llm = LLM(str(folder), runner="pooling", **small_engine_args(**CHUNKED, skip_precompile=True))
    (full,) = llm.embed(prompt, PoolingParams(normalize=False), use_tqdm=False)
    (short,) = llm.embed(prompt, PoolingParams(dimensions=16), use_tqdm=False)
    np.testing.assert_allclose(short.outputs.embedding, _normalized(full.outputs.embedding[:16]), atol=TOLERANCE)
    with pytest.raises(ValueError, match="dimensions must be one of 16, 32"):
        llm.embed(prompt, PoolingParams(dimensions=20), use_tqdm=False)


def test_a_generate_engine_refuses_embeddings_and_bad_options_are_clear_errors():
    llm = LLM(**small_engine_args(skip_precompile=True))
    with pytest.raises(ValueError, match="runner pooling"):
        llm.embed("import os", use_tqdm=False)
    with pytest.raises(ValueError, match="runner must be one of auto, generate, pooling"):
        EngineConfig(runner="embed")
    with pytest.raises(ValueError, match="pooler_config is for runner pooling"):
        EngineConfig(runner="generate", pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(ValueError, match="pooler_config is for runner pooling"):  # runner auto over a language model
        LLM(pooler_config={"pooling_type": "MEAN"}, **small_engine_args(skip_precompile=True))
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(runner="pooling", pooler_config={"pooling": "MEAN"})
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN, CLS"):
        EngineConfig(runner="pooling", pooler_config='{"pooling_type": "max"}')
    for bad in (dict(dimensions=0), dict(normalize="yes"), dict(truncate_prompt_tokens=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PoolingParams(**bad)


def test_the_pooler_follows_a_sentence_transformers_folder(tmp_path):
    folder = tmp_path / "st"
    (folder / "1_Pooling").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False, "pooling_mode_lasttoken": False}))
    assert resolve_pooler_config(str(folder), None) == PoolerConfig("MEAN", normalize=False)
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    assert resolve_pooler_config(str(folder), None) == PoolerConfig("MEAN", normalize=True)
    assert resolve_pooler_config(str(folder), {"pooling_type": "CLS"}) == PoolerConfig("CLS", normalize=True)
    assert resolve_pooler_config(str(tmp_path), None) == PoolerConfig("LAST", normalize=True)


def _cosine(a, b) -> float:
    return float(np.dot(_normalized(a), _normalized(b)))


def test_score_is_the_cosine_similarity_of_the_embeddings(llama_last):
    cases = _cases("llama")
    prompts = [{"prompt_token_ids": case["prompt_token_ids"]} for case in cases[5:9]]
    one_to_many = llama_last.score(prompts[0], prompts[1:], use_tqdm=False)
    expected = [_cosine(cases[5]["LAST"], case["LAST"]) for case in cases[6:9]]
    np.testing.assert_allclose([o.outputs.score for o in one_to_many], expected, atol=1e-5)
    assert one_to_many[0].prompt_token_ids == cases[5]["prompt_token_ids"] + cases[6]["prompt_token_ids"]
    pairwise = llama_last.score(prompts[:2], prompts[2:], use_tqdm=False)
    expected = [_cosine(cases[5]["LAST"], cases[7]["LAST"]), _cosine(cases[6]["LAST"], cases[8]["LAST"])]
    np.testing.assert_allclose([o.outputs.score for o in pairwise], expected, atol=1e-5)
    with pytest.raises(ValueError, match="as many first texts"):
        llama_last.score(prompts[:2], prompts[1:], use_tqdm=False)
