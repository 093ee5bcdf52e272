"""Engine options made for benchmarks: static batching (the pre-paging baseline) and dummy weights."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from helpers import small_engine_args
from jaxserve.kv.cache_manager import pages_for_tokens
from jaxserve.engine.llm import LLM
from jaxserve.sampling_params import SamplingParams

PROMPTS = [[5 + i] * (3 + 7 * i) for i in range(6)]  # 3 to 38 tokens
PARAMS = [SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True) for i in range(6)]


@pytest.fixture(scope="module")
def continuous():
    return LLM(**small_engine_args())


@pytest.fixture(scope="module")
def static():
    # 64 pages of 16 hold 63 usable pages: 7 reservations of max_model_len 128 (8 pages each).
    return LLM(**small_engine_args(batching="static"))


def test_static_batching_gives_the_same_greedy_tokens(continuous, static):
    expected = [out.outputs[0].token_ids for out in continuous.generate(PROMPTS, PARAMS, use_tqdm=False)]
    got = [out.outputs[0].token_ids for out in static.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert got == expected
    pool = static.engine.core.kv.pool
    assert pool.num_free == pool.num_usable  # every reservation came back


def test_static_batching_reserves_max_model_len_and_waits_for_the_whole_batch(static):
    engine = static.engine
    reservation = pages_for_tokens(engine.max_model_len, engine.config.cache_config.page_size)
    batch_size = engine.core.kv.pool.num_usable // reservation  # 7 with the small test pool
    for i in range(batch_size + 2):
        engine.add_request(f"r{i}", [7] * 5, SamplingParams(max_tokens=2 if i else 12, ignore_eos=True))
    engine.step()
    pages, tokens = engine.core.kv_occupancy()
    assert pages == batch_size * reservation  # everyone in the batch holds max_model_len of pages
    assert tokens == 5 * batch_size
    assert len(engine.core.scheduler.running) == batch_size
    finished = set()
    while engine.has_unfinished_requests():
        running = {r.request_id for r in engine.core.scheduler.running}
        if "r0" not in finished:  # r0 outlives the rest of the first batch, which holds the door
            assert running <= {f"r{i}" for i in range(batch_size)}
        finished |= {out.request_id for out in engine.step() if out.finished}
    assert engine.core.kv_occupancy() == (0, 0)


def test_dummy_weights_have_the_loaded_shapes_and_generate(continuous):
    real = continuous
    dummy = LLM(**small_engine_args(load_format="dummy"))
    real_params, dummy_params = real.engine.core.runner.params, dummy.engine.core.runner.params
    assert jax.tree_util.tree_structure(real_params) == jax.tree_util.tree_structure(dummy_params)
    for a, b in zip(jax.tree_util.tree_leaves(real_params), jax.tree_util.tree_leaves(dummy_params)):
        assert (a.shape, a.dtype, a.sharding) == (b.shape, b.dtype, b.sharding)
        assert np.all(np.isfinite(np.asarray(b)))
    out = dummy.generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5


def test_kv_occupancy_counts_a_shared_page_once(continuous):
    engine = continuous.engine
    engine.add_request("forked", [9] * 40, SamplingParams(n=3, max_tokens=6, ignore_eos=True, temperature=1.0))
    shared_seen = False
    while engine.has_unfinished_requests():
        engine.step()
        pages, tokens = engine.core.kv_occupancy()
        assert tokens <= pages * engine.config.cache_config.page_size
        held = sum(r.num_computed_tokens for r in engine.core.scheduler.requests.values())
        shared_seen |= held > tokens  # the samples hold the prompt's pages together
    assert shared_seen


def test_dummy_weights_for_the_llama_3_1_8b_shape_are_abstractly_right(tmp_path):
    """The benchmark's 8B shape (config + tokenizer, no weights): dummy params of 8.03B parameters in
    bfloat16, built abstractly (no memory) through the same code the engine runs."""
    from jaxserve.bench import models
    from jaxserve.model.loader import dummy_params
    from jaxserve.sharding import make_mesh
    from jaxserve.model.registry import load_model_spec

    folder = models.ensure_model("llama-3.1-8b", str(tmp_path))
    spec = load_model_spec(folder)
    shapes = jax.eval_shape(lambda: dummy_params(spec, make_mesh(1), jax.numpy.bfloat16, spec.num_kv_heads, 0))
    leaves = jax.tree_util.tree_leaves(shapes)
    assert {leaf.dtype for leaf in leaves} == {jax.numpy.dtype("bfloat16")}
    assert sum(int(np.prod(leaf.shape)) for leaf in leaves) == models.SHAPES["llama-3.1-8b"].num_params
