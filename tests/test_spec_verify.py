"""Speculative verification (jaxserve/sampling/verify.py) and the n-gram proposer (jaxserve/spec_decode/ngram.py).

The verifier must be exact in distribution: over many seeds, the first emitted token is distributed as the
target's sampling distribution (temperature, top-k, top-p, min-p applied) whatever the proposal, and the
token after an accepted proposal as the target's distribution at the next position. Chi-square tests on an
8-token vocabulary; greedy rows keep exactly the argmax prefix. Stronger still, every emitted token is the
plain sampler's at its output index, whatever was proposed.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from scipy import stats

from jaxserve.batch.builder import padded_sampling_arrays
from jaxserve.sampling.sampler import SamplingBatch
from jaxserve.sampling.verify import Proposals, verify as verify_eagerly
from jaxserve.spec_decode.ngram import propose_ngram

verify = jax.jit(lambda *args: verify_eagerly(*args)[0])  # the tokens; one compilation for every test of a shape

VOCAB = 8
LOGITS = np.log(np.array([[0.30, 0.22, 0.15, 0.12, 0.09, 0.06, 0.04, 0.02],
                          [0.05, 0.10, 0.40, 0.03, 0.20, 0.12, 0.06, 0.04]], np.float32))  # (2, V), no ties


def _target(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The sampling distribution the sampler's filters define (numpy reference)."""
    scaled = logits / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    keep = probs >= min_p * probs.max()
    order = np.argsort(-probs, kind="stable")
    if top_k > 0:
        keep[order[top_k:]] = False
    kept = np.where(keep, probs, 0.0)
    kept /= kept.sum()
    mass_before = np.concatenate([[0.0], np.cumsum(kept[order])[:-1]])
    keep[order[mass_before >= top_p]] = False
    final = np.where(keep, probs, 0.0)
    return final / final.sum()


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """The p-value of observing `counts` under the distribution `probs` (renormalised)."""
    probs = np.asarray(probs, np.float64)
    return stats.chisquare(counts, probs / probs.sum() * counts.sum()).pvalue


def _sampling(num_rows: int, temperature: float, top_k: int, top_p: float, min_p: float) -> SamplingBatch:
    arrays = padded_sampling_arrays(num_rows, 0)
    arrays["temperature"][:] = temperature
    arrays["top_k"][:] = top_k
    arrays["top_p"][:] = top_p
    arrays["min_p"][:] = min_p
    arrays["seeds"][:, 0] = np.arange(num_rows)
    arrays["seeds"][:, 1] = 77
    arrays["sample_index"][:] = 5
    return SamplingBatch(**arrays)


def _proposals(num_rows: int, proposal: int, width: int = 2) -> Proposals:
    return Proposals(token_ids=np.full((num_rows, width - 1), proposal, np.int32),
                     num_tokens=np.full((num_rows,), width - 1, np.int32),
                     logits_index=np.zeros((num_rows, width), np.int32))


SETTINGS = [(1.0, 0, 1.0, 0.0), (0.8, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (0.9, 6, 0.9, 0.05)]


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", SETTINGS)
@pytest.mark.parametrize("proposal", [0, 2, 7])
def test_emitted_tokens_follow_the_target_distribution(temperature, top_k, top_p, min_p, proposal):
    num_rows = 6000
    logits = np.broadcast_to(LOGITS, (num_rows, 2, VOCAB))  # (R, S, V): every row the same model
    tokens = np.asarray(verify(logits, _sampling(num_rows, temperature, top_k, top_p, min_p),
                               _proposals(num_rows, proposal)))  # (S, R)
    first = _target(LOGITS[0], temperature, top_k, top_p, min_p)
    counts = np.bincount(tokens[0], minlength=VOCAB)
    support = first > 0
    assert counts[~support].sum() == 0, "a token the filters drop was emitted"
    assert _chi_square_p(counts[support], first[support]) > 1e-3
    # After an accepted proposal comes a sample of the next position's distribution; else nothing.
    accepted = tokens[0] == proposal
    assert np.all(tokens[1][~accepted] == -1)
    if accepted.sum() > 200:
        second = _target(LOGITS[1], temperature, top_k, top_p, min_p)
        counts = np.bincount(tokens[1][accepted], minlength=VOCAB)
        assert counts[second == 0].sum() == 0
        assert _chi_square_p(counts[second > 0], second[second > 0]) > 1e-3


def test_greedy_rows_keep_the_argmax_prefix_then_the_argmax():
    logits = np.broadcast_to(np.log(np.eye(VOCAB, dtype=np.float32)[[3, 5, 1]] + 0.01), (4, 3, VOCAB))  # argmax 3, 5, 1
    proposals = Proposals(token_ids=np.array([[3, 5], [3, 4], [2, 5], [3, 5]], np.int32),
                          num_tokens=np.array([2, 2, 2, 1], np.int32), logits_index=np.zeros((4, 3), np.int32))
    tokens = np.asarray(verify(logits, _sampling(4, 0.0, 0, 1.0, 0.0), proposals)).T  # (R, S)
    assert tokens.tolist() == [[3, 5, 1], [3, 5, -1], [3, -1, -1], [3, 5, -1]]


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", SETTINGS)
def test_every_emitted_token_is_the_plain_samplers_at_its_index(temperature, top_k, top_p, min_p):
    """Whatever is proposed (right, wrong or nothing), the token a row emits at output index s is the one the
    plain sampler draws at s: speculation changes how many tokens a step emits, never which."""
    from jaxserve.sampling.sampler import sample

    num_rows, width = 512, 4
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(num_rows, width, VOCAB)).astype(np.float32) * 2  # (R, S, V)
    sampling = _sampling(num_rows, temperature, top_k, top_p, min_p)
    plain = np.stack([np.asarray(sample(np.ascontiguousarray(logits[:, j]), dataclasses.replace(
        sampling, sample_index=sampling.sample_index + j)).token_ids) for j in range(width)], axis=1)  # (R, S)
    # Proposals that match the plain samples for a random number of leading positions, then a wrong one.
    num_right = rng.integers(0, width, num_rows)  # (R,)
    proposed = np.where(np.arange(width - 1)[None, :] < num_right[:, None], plain[:, :-1], (plain[:, :-1] + 1) % VOCAB)
    num_tokens = rng.integers(0, width, num_rows).astype(np.int32)  # (R,) some rows propose fewer, or none
    proposals = Proposals(token_ids=proposed.astype(np.int32), num_tokens=num_tokens,
                          logits_index=np.zeros((num_rows, width), np.int32))
    tokens = np.asarray(verify(logits, sampling, proposals)).T  # (R, S)
    emitted = np.minimum(num_right, num_tokens) + 1  # (R,) accepted proposals, then one sample
    for row in range(num_rows):
        assert tokens[row, : emitted[row]].tolist() == plain[row, : emitted[row]].tolist()
        assert np.all(tokens[row, emitted[row] :] == -1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_penalised_rows_count_the_proposals_before_each_position_as_output(temperature):
    """With penalties, biases and allowed ids, position j is sampled as plain decoding samples it after the
    proposals before it: the tokens emitted equal a plain sampler run token by token, its history growing."""
    from jaxserve.sampling.sampler import KIND_ALLOWED, KIND_BIAS, KIND_OUTPUT, KIND_PROMPT, sample

    num_rows, width = 64, 4
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(num_rows, width, VOCAB)).astype(np.float32)  # (R, S, V)
    history = [[int(t) for t in rng.integers(0, VOCAB, 3)] for _ in range(num_rows)]  # each row's prompt

    def sampling_for(tokens_so_far: list[list[int]], index_offset: int, aux_width: int) -> SamplingBatch:
        """Each row's sampling with its prompt and `tokens_so_far` as history, a bias and allowed ids."""
        batch = _sampling(num_rows, temperature, 0, 1.0, 0.0)
        arrays = {f.name: np.array(getattr(batch, f.name)) for f in dataclasses.fields(batch)}
        arrays.update(presence_penalty=np.full(num_rows, 0.7, np.float32),
                      frequency_penalty=np.full(num_rows, 0.4, np.float32),
                      repetition_penalty=np.full(num_rows, 1.5, np.float32))
        arrays["sample_index"] = arrays["sample_index"] + index_offset
        ids = np.full((num_rows, aux_width), -1, np.int32)
        kinds = np.zeros((num_rows, aux_width), np.int8)
        values = np.zeros((num_rows, aux_width), np.float32)
        for row in range(num_rows):
            entries = ([(t, KIND_PROMPT, 0.0) for t in history[row]]
                       + [(t, KIND_OUTPUT, 0.0) for t in tokens_so_far[row]]
                       + [(row % VOCAB, KIND_BIAS, 1.5)] + [(t, KIND_ALLOWED, 0.0) for t in range(VOCAB - 1)])
            for column, (token, kind, value) in enumerate(entries):
                ids[row, column], kinds[row, column], values[row, column] = token, kind, value
        return SamplingBatch(**{**arrays, "aux_token_ids": ids, "aux_token_kind": kinds, "aux_values": values})

    plain: list[list[int]] = [[] for _ in range(num_rows)]
    for j in range(width):
        step = sampling_for(plain, j, 32)
        for row, token in enumerate(np.asarray(sample(np.ascontiguousarray(logits[:, j]), step).token_ids)):
            plain[row].append(int(token))
    plain_array = np.asarray(plain)  # (R, S)
    assert not np.any(plain_array == VOCAB - 1), "allowed ids were not applied"
    num_right = rng.integers(0, width, num_rows)  # (R,) proposals right for this many leading positions
    proposed = np.where(np.arange(width - 1)[None, :] < num_right[:, None], plain_array[:, :-1],
                        (plain_array[:, :-1] + 1) % VOCAB).astype(np.int32)
    proposals = Proposals(token_ids=proposed, num_tokens=np.full(num_rows, width - 1, np.int32),
                          logits_index=np.zeros((num_rows, width), np.int32))
    tokens = np.asarray(verify(logits, sampling_for([[] for _ in range(num_rows)], 0, 32), proposals)).T  # (R, S)
    for row in range(num_rows):
        emitted = num_right[row] + 1
        assert tokens[row, :emitted].tolist() == plain[row][:emitted]
        assert np.all(tokens[row, emitted:] == -1)


@pytest.mark.parametrize("sequence, expected", [
    ([1, 2, 3, 9, 9, 1, 2, 3], [9, 9, 1]),  # the trigram 1 2 3 occurred before, followed by 9 9 1
    ([5, 1, 2, 7, 1, 2], [7, 1, 2]),  # a bigram
    ([4, 6, 1, 2, 8, 1, 2, 9, 1, 2], [9, 1, 2]),  # the latest earlier occurrence wins
    ([1, 2, 3, 4], []),  # nothing repeats
    ([7], []),
])
def test_ngram_proposes_what_followed_the_latest_match(sequence, expected):
    assert propose_ngram(np.asarray(sequence), 3, 2, 4) == expected


def test_ngram_prefers_the_longest_match_and_caps_the_guess():
    sequence = [1, 2, 3, 4, 5, 6, 0, 3, 4, 7, 1, 2, 3, 4]  # 3 4 -> 7 (latest bigram), 1 2 3 4 -> 5 6 (longest)
    assert propose_ngram(np.asarray(sequence), 2, 2, 4) == [5, 6]
    assert propose_ngram(np.asarray(sequence), 2, 2, 2) == [7, 1]
