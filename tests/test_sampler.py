"""Tests for jaxserve.sampling.sampler: penalties, greedy/random sampling and logprobs."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from jaxserve.sampling.sampler import (  # noqa: E402
    KIND_ALLOWED,
    KIND_BANNED,
    KIND_BIAS,
    KIND_OUTPUT,
    KIND_PAD,
    KIND_PROMPT,
    MAX_LOGPROBS,
    SORT_PREFIX,
    SamplingBatch,
    apply_top_k_top_p,
    process_logits,
    sample,
)

sample_jit = jax.jit(sample)


def make_batch(num_rows, num_aux=0, need_logprobs=False, **per_row):
    """A neutral (R rows, P aux slots) batch; `per_row` overrides columns."""
    columns = {
        "temperature": np.ones(num_rows, np.float32),
        "top_k": np.zeros(num_rows, np.int32),
        "top_p": np.ones(num_rows, np.float32),
        "min_p": np.zeros(num_rows, np.float32),
        "presence_penalty": np.zeros(num_rows, np.float32),
        "frequency_penalty": np.zeros(num_rows, np.float32),
        "repetition_penalty": np.ones(num_rows, np.float32),
        "seeds": np.stack([np.arange(num_rows, dtype=np.uint32), np.zeros(num_rows, np.uint32)], axis=1),
        "sample_index": np.zeros(num_rows, np.int32),
        "aux_token_ids": np.full((num_rows, num_aux), -1, np.int32),
        "aux_token_kind": np.full((num_rows, num_aux), KIND_PAD, np.int8),
        "aux_values": np.zeros((num_rows, num_aux), np.float32),
        "token_bitmask": np.full((num_rows, 0), -1, np.int32),
    }
    for name, value in per_row.items():
        dtype = columns[name].dtype
        if name == "seeds" and np.ndim(value) < 2:  # low words only
            value = np.stack(np.broadcast_arrays(np.asarray(value, dtype), np.uint32(0)), axis=-1)
        columns[name] = np.broadcast_to(np.asarray(value, dtype), columns[name].shape)
    return SamplingBatch(
        **{k: jnp.asarray(v) for k, v in columns.items()},
        need_logprobs=jnp.asarray(need_logprobs),
    )


def run(logits, batch):
    """jit-sample and return numpy outputs."""
    out = sample_jit(np.asarray(logits, np.float32), batch)
    return jax.tree_util.tree_map(np.asarray, out)


def softmax(x):
    """numpy softmax over the last axis."""
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def reference_penalties(logits, ids, kinds, rep, freq, pres):
    """Straightforward numpy version of vLLM's ban + penalty step."""
    out = logits.astype(np.float64).copy()
    for r in range(out.shape[0]):
        row_ids, row_kinds = ids[r], kinds[r]
        out[r, row_ids[row_kinds == KIND_BANNED]] = -np.inf
        seen = np.unique(row_ids[(row_kinds == KIND_PROMPT) | (row_kinds == KIND_OUTPUT)])
        out[r, seen] = np.where(out[r, seen] > 0, out[r, seen] / rep[r], out[r, seen] * rep[r])
        counts = np.bincount(row_ids[row_kinds == KIND_OUTPUT], minlength=out.shape[1])
        out[r] -= freq[r] * counts + pres[r] * (counts > 0)
    return out


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).normal(size=(6, 50))
    out = run(logits, make_batch(6, temperature=0.0))
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == np.int32


def test_penalties_hand_computed():
    logits = np.array([[2.0, -1.0, 0.5, -3.0, 1.0]], np.float32)
    # Prompt: tokens 0, 1. Output so far: 2, 2, 4. Token 3 unseen.
    ids = np.array([[0, 1, 2, 2, 4, -1]], np.int32)
    kinds = np.array([[1, 1, 2, 2, 2, 0]], np.int8)
    batch = make_batch(
        1, 6, aux_token_ids=ids, aux_token_kind=kinds,
        repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
    )
    got = np.asarray(jax.jit(process_logits)(logits, batch))
    # 0: 2/2; 1: -1*2; 2: 0.5/2 - 0.5*2 - 0.25; 3: untouched; 4: 1/2 - 0.5 - 0.25.
    np.testing.assert_allclose(got, [[1.0, -2.0, -1.0, -3.0, -0.25]])


def test_penalties_change_greedy_choice():
    logits = np.array([[3.0, 2.9, 0.0]], np.float32)
    batch = make_batch(
        1, 2, temperature=0.0, presence_penalty=0.5,
        aux_token_ids=[[0, -1]], aux_token_kind=[[KIND_OUTPUT, KIND_PAD]],
    )
    assert run(logits, batch).token_ids[0] == 1


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_penalties_match_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    num_rows, vocab, num_aux = 4, 12, 10
    logits = rng.normal(size=(num_rows, vocab)).astype(np.float32) * 3
    ids = rng.integers(-1, vocab, size=(num_rows, num_aux)).astype(np.int32)
    kinds = rng.integers(0, 4, size=(num_rows, num_aux)).astype(np.int8)
    kinds[ids < 0] = KIND_PAD
    rep = rng.uniform(0.5, 2.0, num_rows).astype(np.float32)
    freq = rng.uniform(-2, 2, num_rows).astype(np.float32)
    pres = rng.uniform(-2, 2, num_rows).astype(np.float32)
    batch = make_batch(
        num_rows, num_aux, aux_token_ids=ids, aux_token_kind=kinds,
        repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
    )
    got = np.asarray(jax.jit(process_logits)(logits, batch))
    np.testing.assert_allclose(
        got, reference_penalties(logits, ids, kinds, rep, freq, pres), rtol=1e-5, atol=1e-5
    )


def test_banned_tokens_never_sampled():
    num_rows = 512
    logits = np.tile([[5.0, 4.0, 0.0, 4.5]], (num_rows, 1))
    ids = np.tile([[0, 3, -1]], (num_rows, 1))
    kinds = np.tile([[KIND_BANNED, KIND_BANNED, KIND_PAD]], (num_rows, 1))
    random_out = run(logits, make_batch(num_rows, 3, aux_token_ids=ids, aux_token_kind=kinds))
    assert set(random_out.token_ids) == {1, 2}
    greedy = make_batch(num_rows, 3, temperature=0.0, aux_token_ids=ids, aux_token_kind=kinds)
    assert set(run(logits, greedy).token_ids) == {1}


@pytest.mark.parametrize(
    "filters", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}], ids=["top_k", "top_p", "min_p"]
)
def test_tight_filters_equal_greedy(filters):
    num_rows = 64
    logits = np.random.default_rng(1).normal(size=(num_rows, 40)) * 2
    out = run(logits, make_batch(num_rows, temperature=1.5, **filters))
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))


def sample_frequencies(row_logits, num_draws=2000, **filters):
    """Draw `num_draws` samples (one per row, distinct seeds) and count tokens."""
    logits = np.tile(np.asarray(row_logits, np.float32), (num_draws, 1))
    out = run(logits, make_batch(num_draws, **filters))
    return np.bincount(out.token_ids, minlength=logits.shape[1])


def assert_matches_distribution(counts, probs):
    """Chi-square goodness of fit over the nonzero-probability tokens."""
    probs = np.asarray(probs, np.float64)
    assert counts[probs == 0].sum() == 0
    expected = counts.sum() * probs[probs > 0]
    chi2 = (((counts[probs > 0] - expected) ** 2) / expected).sum()
    assert chi2 < 25.0, (counts, expected)  # df <= 4: p < 1e-4 under the null.


LOGITS_5 = np.log([0.5, 0.3, 0.1, 0.06, 0.04])


def test_temperature_sampling_matches_softmax():
    counts = sample_frequencies(LOGITS_5, temperature=0.7)
    assert_matches_distribution(counts, softmax(LOGITS_5 / 0.7))


@pytest.mark.parametrize(
    "filters, kept",
    [
        ({"top_k": 2}, [0, 1]),
        ({"top_p": 0.75}, [0, 1]),  # mass before token 2 is 0.8 >= 0.75.
        ({"top_p": 0.85}, [0, 1, 2]),
        ({"min_p": 0.15}, [0, 1, 2]),  # threshold 0.075.
        ({"top_k": 3, "top_p": 0.85}, [0, 1]),  # top-p on the renormalised top-3.
    ],
)
def test_filters_renormalise_kept_tokens(filters, kept):
    probs = np.zeros(5)
    probs[kept] = np.exp(LOGITS_5[kept])
    assert_matches_distribution(sample_frequencies(LOGITS_5, **filters), probs / probs.sum())


ROW_CONFIGS = {
    "temperature_only": {"top_p": 1.0, "top_k": 0, "scale": 1.0},
    "top_p_in_prefix": {"top_p": 0.5, "top_k": 0, "scale": 3.0},
    "top_p_beyond_prefix": {"top_p": 0.95, "top_k": 0, "scale": 0.3},
    "top_k_beyond_prefix": {"top_p": 1.0, "top_k": SORT_PREFIX + 100, "scale": 1.0},
}


@pytest.mark.parametrize("config", ROW_CONFIGS.values(), ids=ROW_CONFIGS.keys())
def test_row_sample_is_independent_of_batch(config):
    rng = np.random.default_rng(2)
    vocab = 2 * SORT_PREFIX
    row_logits = (rng.normal(size=vocab) * config["scale"]).astype(np.float32)
    row = {"temperature": 0.9, "top_p": config["top_p"], "top_k": config["top_k"]}
    row |= {"seeds": 1234, "sample_index": 7}
    alone = run(row_logits[None], make_batch(1, **row)).token_ids[0]
    for position in range(8):
        logits = rng.normal(size=(8, vocab)).astype(np.float32)
        logits[position] = row_logits
        columns = {
            "temperature": rng.choice([0.0, 0.5, 1.0], 8),
            "top_p": rng.choice([0.5, 0.99, 1.0], 8),
            "top_k": rng.choice([0, 3, SORT_PREFIX + 1], 8),
            "seeds": rng.integers(0, 2**32, 8),
            "sample_index": rng.integers(0, 100, 8),
        }
        for name, value in row.items():
            columns[name][position] = value
        assert run(logits, make_batch(8, **columns)).token_ids[position] == alone


def reference_top_k_top_p(logits, top_k, top_p, tolerance=1e-4):
    """numpy top-k/top-p keep-mask, plus tokens too close to the top-p cut to judge."""
    keep = np.zeros(logits.shape, bool)
    unsure = np.zeros(logits.shape, bool)
    for r, row in enumerate(logits.astype(np.float64)):
        order = np.argsort(-row)
        k = top_k[r] if 0 < top_k[r] < row.size else row.size
        probs = softmax(row[order[:k]])
        mass_before = np.cumsum(probs) - probs
        kept = order[:k][mass_before < top_p[r]] if top_p[r] < 1 else order[:k]
        keep[r, kept] = True
        unsure[r, order[:k][np.abs(mass_before - top_p[r]) < tolerance]] = True
    return keep, unsure


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([50, 2 * SORT_PREFIX]))
def test_top_k_top_p_match_numpy_reference(seed, vocab):
    rng = np.random.default_rng(seed)
    num_rows = 6
    logits = (rng.normal(size=(num_rows, vocab)) * rng.uniform(0.1, 4)).astype(np.float32)
    top_k = rng.choice([0, 1, 7, vocab - 3, vocab], num_rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.3, 0.9, 0.999], num_rows).astype(np.float32)
    got = np.isfinite(np.asarray(jax.jit(apply_top_k_top_p)(logits, top_k, top_p)))
    keep, unsure = reference_top_k_top_p(logits, top_k, top_p)
    np.testing.assert_array_equal(got[~unsure], keep[~unsure])


def test_seed_and_index_select_the_noise():
    logits = np.zeros((64, 50), np.float32)
    same = run(logits, make_batch(64, seeds=9, sample_index=3)).token_ids
    assert len(set(same)) == 1
    by_index = run(logits, make_batch(64, seeds=9, sample_index=np.arange(64))).token_ids
    assert len(set(by_index)) > 10


def test_logprobs_are_raw_log_softmax_and_true_top_k():
    rng = np.random.default_rng(3)
    num_rows, vocab = 5, 100
    logits = rng.normal(size=(num_rows, vocab)).astype(np.float32) * 3
    batch = make_batch(
        num_rows, 2, need_logprobs=True, temperature=[0.0, 1.0, 0.0, 0.8, 0.0],
        repetition_penalty=3.0, aux_token_ids=np.tile([[5, 7]], (num_rows, 1)),
        aux_token_kind=np.tile([[KIND_PROMPT, KIND_BANNED]], (num_rows, 1)),
    )
    out = run(logits, batch)
    raw = np.log(softmax(logits.astype(np.float64)))
    chosen = raw[np.arange(num_rows), out.token_ids]
    np.testing.assert_allclose(out.logprobs, chosen, rtol=1e-5, atol=1e-5)
    assert out.top_token_ids.shape == (num_rows, MAX_LOGPROBS)
    expected_ids = np.argsort(-raw, axis=-1)[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(out.top_token_ids, expected_ids)
    expected_lps = np.take_along_axis(raw, expected_ids, axis=-1)
    np.testing.assert_allclose(out.top_logprobs, expected_lps, rtol=1e-5, atol=1e-5)


def test_ranks_are_exact_for_tokens_outside_the_top_k():
    rng = np.random.default_rng(6)
    num_rows, vocab = 256, 300
    logits = rng.normal(size=(num_rows, vocab)).astype(np.float32)
    out = run(logits, make_batch(num_rows, need_logprobs=True, temperature=50.0))
    chosen = logits[np.arange(num_rows), out.token_ids]
    np.testing.assert_array_equal(out.ranks, 1 + (logits > chosen[:, None]).sum(-1))
    assert out.ranks.max() > MAX_LOGPROBS, "high temperature samples some tokens outside the top 20"


def test_logit_bias_and_allowed_tokens():
    logits = np.array([[2.0, 1.0, 0.5, -1.0, 0.0]] * 2, np.float32)
    # Row 0: bias +3 on token 3, -5 on token 0. Row 1: only tokens 2 and 4 allowed, token 4 biased +1.
    ids = np.array([[3, 0, -1], [2, 4, 4]], np.int32)
    kinds = np.array([[KIND_BIAS, KIND_BIAS, KIND_PAD], [KIND_ALLOWED, KIND_ALLOWED, KIND_BIAS]], np.int8)
    values = np.array([[3.0, -5.0, 0.0], [0.0, 0.0, 1.0]], np.float32)
    batch = make_batch(2, 3, aux_token_ids=ids, aux_token_kind=kinds, aux_values=values)
    got = np.asarray(jax.jit(process_logits)(logits, batch))
    np.testing.assert_allclose(got[0], [-3.0, 1.0, 0.5, 2.0, 0.0])
    np.testing.assert_allclose(got[1], [-np.inf, -np.inf, 0.5, -np.inf, 1.0])
    greedy = run(logits, make_batch(2, 3, temperature=0.0, aux_token_ids=ids, aux_token_kind=kinds, aux_values=values))
    np.testing.assert_array_equal(greedy.token_ids, [3, 4])
    sampled = run(np.tile(logits[1:], (512, 1)), make_batch(512, 3, aux_token_ids=np.tile(ids[1:], (512, 1)),
                                                             aux_token_kind=np.tile(kinds[1:], (512, 1)),
                                                             aux_values=np.tile(values[1:], (512, 1))))
    assert set(sampled.token_ids) == {2, 4}


def test_high_seed_word_changes_the_noise():
    logits = np.zeros((64, 50), np.float32)
    low_only = make_batch(64, seeds=np.tile([[9, 0]], (64, 1)), sample_index=np.arange(64))
    with_high = make_batch(64, seeds=np.tile([[9, 1]], (64, 1)), sample_index=np.arange(64))
    assert (run(logits, low_only).token_ids != run(logits, with_high).token_ids).sum() > 32


def test_logprob_fields_are_zero_when_not_needed():
    logits = np.random.default_rng(4).normal(size=(3, 100))
    out = run(logits, make_batch(3))
    assert not out.logprobs.any() and not out.top_logprobs.any()
    assert not out.top_token_ids.any()
    assert out.top_token_ids.shape == (3, MAX_LOGPROBS)


def test_small_vocab_top_logprobs_cover_whole_vocab():
    out = run(np.array([LOGITS_5]), make_batch(1, need_logprobs=True))
    np.testing.assert_array_equal(out.top_token_ids, [[0, 1, 2, 3, 4]])
    np.testing.assert_allclose(out.top_logprobs, [LOGITS_5], rtol=1e-5)


def test_no_aux_tokens_path():
    logits = np.random.default_rng(5).normal(size=(4, 16))
    batch = make_batch(4, 0, temperature=[0.0, 1.0, 0.0, 1.0], top_k=[0, 2, 0, 0])
    assert batch.aux_token_ids.shape == (4, 0)
    out = run(logits, batch)
    np.testing.assert_array_equal(out.token_ids[[0, 2]], logits[[0, 2]].argmax(-1))
    top2 = np.argsort(-logits[1])[:2]
    assert out.token_ids[1] in top2


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes_report_the_raw_or_the_processed_distribution(mode):
    """vLLM's logprobs_mode: raw logits as they are; processed: a greedy row after its penalties (here a presence
    penalty on token 1), a sampled row divided by its temperature with the tokens outside its top-k at -inf, as
    logits or their log_softmax; the chosen token's value and exact rank among them."""
    logits = np.array([[2.0, 1.5, 0.5, -1.0, 0.0], [1.0, 3.0, 2.0, 0.0, -2.0]], np.float32)
    batch = make_batch(2, 1, need_logprobs=True, temperature=[0.0, 0.5], top_k=[0, 3], presence_penalty=[1.0, 0.0],
                       aux_token_ids=[[1], [-1]], aux_token_kind=[[KIND_OUTPUT], [KIND_PAD]])
    out = jax.tree_util.tree_map(np.asarray, jax.jit(sample, static_argnums=2)(logits, batch, mode))
    expected = logits.astype(np.float64)
    if mode.startswith("processed"):
        expected = np.stack([logits[0] - [0.0, 1.0, 0.0, 0.0, 0.0],
                             np.where(logits[1] >= 1.0, logits[1] / 0.5, -np.inf)])  # top-3 of row 1 kept
    if mode.endswith("logprobs"):
        expected = expected - np.logaddexp.reduce(expected, axis=1, keepdims=True)
    for row in range(2):
        token = out.token_ids[row]
        np.testing.assert_allclose(out.logprobs[row], expected[row, token], rtol=1e-5)
        assert out.ranks[row] == 1 + np.sum(expected[row] > expected[row, token])
        order = np.argsort(-expected[row], kind="stable")[:3]
        np.testing.assert_allclose(out.top_logprobs[row, :3], expected[row, order], rtol=1e-5)
    assert out.token_ids[0] == 0  # greedy after the penalty: 2.0 beats 1.5 - 1
