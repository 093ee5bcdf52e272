"""Tests for jaxserve.sampling_params.SamplingParams."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxserve.sampling_params import RequestOutputKind, SamplingParams

VLLM_DEFAULTS = {
    "n": 1,
    "best_of": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "stop": [],
    "stop_token_ids": [],
    "ignore_eos": False,
    "max_tokens": 16,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "detokenize": True,
    "bad_words": None,
    "logit_bias": None,
    "allowed_token_ids": None,
    "truncate_prompt_tokens": None,
    "truncation_side": "left",  # vLLM keeps it with its tokenization settings; "left" is its generation default
    "structured_outputs": None,
    "thinking_token_budget": None,
    "output_kind": RequestOutputKind.CUMULATIVE,
}


def test_defaults_match_vllm():
    assert dataclasses.asdict(SamplingParams()) == VLLM_DEFAULTS
    assert SamplingParams.MAX_LOGPROBS == 20


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", 1.5),
        ("n", True),
        ("presence_penalty", -2.01),
        ("presence_penalty", 2.01),
        ("frequency_penalty", -3.0),
        ("frequency_penalty", 2.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("nan")),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("max_tokens", -1),
        ("max_tokens", 3.0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("logprobs", SamplingParams.MAX_LOGPROBS + 1),
        ("logprobs", 1.0),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("seed", 1.5),
        ("seed", "7"),
        # Each value below passed validation before, then overflowed the array it is packed into.
        ("top_k", 2**31),
        ("n", 2**31),
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("stop_token_ids", [2**31]),
        ("temperature", float("inf")),
        ("temperature", 1e39),
        ("repetition_penalty", float("inf")),
        ("top_p", float("nan")),
        ("min_p", float("nan")),
        ("presence_penalty", float("nan")),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", 21),
        ("truncate_prompt_tokens", 0),
        ("logit_bias", {1: 100.5}),
        ("logit_bias", {1: float("nan")}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"x": 1.0}),
        ("logit_bias", {2**31: 1.0}),
        ("logit_bias", {i: 1.0 for i in range(301)}),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [-1]),
        ("allowed_token_ids", list(range(1025))),
        ("stop_token_ids", list(range(65))),
        ("bad_words", [""]),
        ("bad_words", ["ok", 3]),
        ("bad_words", ["w"] * 65),
        ("output_kind", 3),
        ("output_kind", "DELTA"),
        ("output_kind", True),
        ("output_kind", 1.0),
    ],
)
def test_invalid_value_raises_naming_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_raises():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    assert SamplingParams(min_tokens=100, max_tokens=None).max_tokens is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", -2.0),
        ("frequency_penalty", 2.0),
        ("repetition_penalty", 1e-3),
        ("temperature", 0.0),
        ("top_p", 1e-9),
        ("top_k", -1),
        ("top_k", 0),
        ("top_k", 1),
        ("min_p", 1.0),
        ("logprobs", 0),
        ("logprobs", SamplingParams.MAX_LOGPROBS),
        ("seed", 0),
        ("seed", np.int64(3)),
        ("seed", 2**63 - 1),
        ("seed", -(2**63)),
        ("top_k", 2**31 - 1),
        ("n", 4),
        ("max_tokens", 0),
        ("prompt_logprobs", 0),
        ("truncate_prompt_tokens", 1),
        ("allowed_token_ids", [0]),
        ("bad_words", ["word"]),
        ("output_kind", RequestOutputKind.FINAL_ONLY),
        ("output_kind", 1),
        ("output_kind", np.int64(2)),
    ],
)
def test_boundary_values_accepted(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_output_kind_is_a_request_output_kind_whatever_int_gave_it():
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    assert SamplingParams(output_kind=np.int64(2)).output_kind is RequestOutputKind.FINAL_ONLY


def test_logit_bias_keys_from_json_become_ints():
    assert SamplingParams(logit_bias={"5": 1.5, 7: -100}).logit_bias == {5: 1.5, 7: -100.0}


def test_stop_is_normalised_to_lists():
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(2, 7)).stop_token_ids == [2, 7]


def test_is_greedy_uses_vllm_epsilon():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert not SamplingParams().is_greedy


@pytest.mark.parametrize(
    "changes",
    [{"presence_penalty": 0.5}, {"frequency_penalty": -0.1}, {"repetition_penalty": 1.2}],
)
def test_needs_penalties(changes):
    assert not SamplingParams().needs_penalties
    assert SamplingParams(**changes).needs_penalties


def test_clone_copies_and_revalidates():
    parent = SamplingParams(n=3, stop=["x"], seed=1)
    child = parent.clone(n=1, seed=2)
    assert (child.n, child.seed, child.stop) == (1, 2, ["x"])
    assert child.stop is not parent.stop
    assert parent.n == 3
    with pytest.raises(ValueError, match="temperature"):
        parent.clone(temperature=-1.0)


@given(
    temperature=st.floats(0.0, 100.0),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    min_p=st.floats(0.0, 1.0),
    penalty=st.floats(-2.0, 2.0),
    top_k=st.integers(-1, 10**6),
)
def test_valid_ranges_accepted(temperature, top_p, min_p, penalty, top_k):
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        min_p=min_p,
        presence_penalty=penalty,
        frequency_penalty=penalty,
        top_k=top_k,
    )
    assert params.top_p == top_p


@given(top_p=st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True)))
def test_top_p_outside_range_rejected(top_p):
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=top_p)
