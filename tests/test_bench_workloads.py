"""Benchmark workloads: seeded and deterministic, lengths within bounds, special tokens avoided, ShareGPT by
vLLM's rule, and the command-line options that build them."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from jaxserve.bench.workloads import (
    BenchRequest,
    Workload,
    add_workload_arguments,
    long_prompt_mix_workload,
    random_workload,
    sample_lengths,
    shared_prefix_workload,
    sharegpt_workload,
    vocab_ids,
    workload_from_args,
)
from jaxserve.engine.llm_engine import default_model_path
from jaxserve.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def parse(*argv: str, **defaults) -> argparse.Namespace:
    """The workload options parsed from `argv`, after parser.set_defaults(**defaults)."""
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    parser.set_defaults(**defaults)
    return parser.parse_args(list(argv))


def test_vocab_ids_excludes_special_tokens(tokenizer):
    ids = vocab_ids(tokenizer)
    assert set(tokenizer.all_special_ids) == {0, 1, 2}
    assert ids == list(range(3, len(tokenizer)))


def test_sample_lengths_fixed_and_uniform():
    rng = np.random.default_rng(0)
    assert sample_lengths(rng, 5, "fixed", 7, 1, 2).tolist() == [7] * 5
    lengths = sample_lengths(rng, 2000, "uniform", 0, 3, 9)
    assert lengths.dtype == np.int64 and lengths.shape == (2000,)
    assert set(lengths.tolist()) == set(range(3, 10))  # both ends included
    assert sample_lengths(rng, 0, "uniform", 0, 3, 9).shape == (0,)


def test_sample_lengths_lognormal_is_long_tailed_around_its_median():
    lengths = sample_lengths(np.random.default_rng(0), 20000, "lognormal", 64, 1, 100000)
    assert abs(np.median(lengths) - 64) <= 2
    assert np.percentile(lengths, 99) > 4 * 64  # sigma 0.8: p99 is about 6.4x the median
    clipped = sample_lengths(np.random.default_rng(0), 20000, "lognormal", 64, 8, 384)
    assert clipped.min() == 8 and clipped.max() == 384


@pytest.mark.parametrize("distribution, mean, low, high, message", [
    ("normal", 10, 1, 20, "distribution must be one of"),
    ("fixed", 0, 1, 20, "fixed length"),
    ("uniform", 10, 0, 20, "low <= high"),
    ("uniform", 10, 30, 20, "low <= high"),
    ("lognormal", 50, 1, 20, "median"),
])
def test_sample_lengths_rejects_bad_arguments(distribution, mean, low, high, message):
    with pytest.raises(ValueError, match=message) as error:
        sample_lengths(np.random.default_rng(0), 4, distribution, mean, low, high, name="input length")
    assert str(error.value).startswith("input length:")


def test_random_workload_is_deterministic_and_bounded(tokenizer):
    ids = vocab_ids(tokenizer)
    args = (50, ids, "uniform", 0, 16, 64, "lognormal", 32, 8, 128)
    workload = random_workload(*args, seed=3)
    assert workload == random_workload(*args, seed=3)
    assert workload.requests != random_workload(*args, seed=4).requests
    assert workload.name == "random" and len(workload.requests) == 50
    assert all(16 <= len(request.prompt_token_ids) <= 64 for request in workload.requests)
    assert all(8 <= request.output_len <= 128 for request in workload.requests)
    assert all(request.prompt_text is None for request in workload.requests)
    all_ids = {token_id for request in workload.requests for token_id in request.prompt_token_ids}
    assert all_ids <= set(ids)
    assert all(type(token_id) is int for token_id in workload.requests[0].prompt_token_ids)
    assert "uniform 16-64" in workload.description and "lognormal median 32" in workload.description


def test_workload_token_counts():
    workload = Workload("random", (BenchRequest((1, 2, 3), 4), BenchRequest((5,), 6)), "two")
    assert workload.num_prompt_tokens == 4 and workload.num_output_tokens == 10


def test_shared_prefix_workload():
    workload = shared_prefix_workload(20, range(3, 100), prefix_len=40, question_len=5, output_len=7, seed=1)
    prefix = workload.requests[0].prompt_token_ids[:40]
    assert all(request.prompt_token_ids[:40] == prefix for request in workload.requests)
    assert all(len(request.prompt_token_ids) == 45 and request.output_len == 7 for request in workload.requests)
    assert len({request.prompt_token_ids[40:] for request in workload.requests}) == 20
    assert workload == shared_prefix_workload(20, range(3, 100), 40, 5, 7, seed=1)
    # Only 2 ** 3 questions exist: all of them are drawn, none twice.
    tiny = shared_prefix_workload(8, [5, 6], prefix_len=2, question_len=3, output_len=1, seed=0)
    assert len({request.prompt_token_ids[2:] for request in tiny.requests}) == 8
    with pytest.raises(ValueError, match="distinct questions"):
        shared_prefix_workload(9, [5, 6], prefix_len=2, question_len=3, output_len=1, seed=0)
    with pytest.raises(ValueError, match="prefix_len"):
        shared_prefix_workload(9, [5, 6], prefix_len=0, question_len=3, output_len=1, seed=0)


def test_long_prompt_mix_spreads_long_prompts_evenly():
    workload = long_prompt_mix_workload(50, range(3, 100), short_len=8, long_len=100, long_fraction=0.1,
                                        output_len=4, seed=2)
    lengths = [len(request.prompt_token_ids) for request in workload.requests]
    positions = [i for i, length in enumerate(lengths) if length == 100]
    assert len(positions) == 5 and lengths.count(8) == 45
    assert np.diff(positions).tolist() == [10, 10, 10, 10]
    assert workload == long_prompt_mix_workload(50, range(3, 100), 8, 100, 0.1, 4, seed=2)
    few = long_prompt_mix_workload(4, range(3, 100), 8, 100, 0.1, 4, seed=0)
    assert sum(len(request.prompt_token_ids) == 100 for request in few.requests) == 1  # at least one
    none = long_prompt_mix_workload(4, range(3, 100), 8, 100, 0.0, 4, seed=0)
    assert all(len(request.prompt_token_ids) == 8 for request in none.requests)
    with pytest.raises(ValueError, match="long_fraction"):
        long_prompt_mix_workload(4, range(3, 100), 8, 100, 1.5, 4, seed=0)


def test_bundled_sharegpt_sample(tokenizer):
    workload = sharegpt_workload(None, tokenizer, 40, seed=0, max_model_len=256)
    assert workload.name == "sharegpt" and len(workload.requests) == 40
    for request in workload.requests:
        assert request.prompt_token_ids == tuple(tokenizer.encode(request.prompt_text))  # as the engine encodes
        assert len(request.prompt_token_ids) >= 4 and request.output_len >= 4
        assert len(request.prompt_token_ids) + request.output_len <= 256
    assert workload == sharegpt_workload(None, tokenizer, 40, seed=0, max_model_len=256)
    assert workload.requests != sharegpt_workload(None, tokenizer, 40, seed=1, max_model_len=256).requests
    with pytest.raises(ValueError, match="sharegpt_sample.json has only"):
        sharegpt_workload(None, tokenizer, 1000, seed=0, max_model_len=1024)


def test_sharegpt_follows_vllms_rule(tokenizer, tmp_path):
    long_question = "How do I read a file in Python, line by line, without loading it all?"
    reply = "Open it with open() and iterate over the file object."
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": long_question}, {"from": "gpt", "value": reply},
                                      {"from": "human", "value": "And then?"}, {"from": "gpt", "value": "Done."}]},
        {"id": "b", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": reply}]},
        {"id": "c", "conversations": [{"from": "human", "value": long_question}, {"from": "gpt", "value": "Ok."}]},
        {"id": "d", "conversations": [{"from": "human", "value": long_question}]},
        {"id": "e", "conversations": [{"from": "gpt", "value": reply}, {"from": "human", "value": long_question},
                                      {"from": "gpt", "value": reply + " " + reply}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    workload = sharegpt_workload(str(path), tokenizer, 2, seed=0, max_model_len=1024)
    output_lens = sorted(request.output_len for request in workload.requests)
    reply_len = len(tokenizer.encode(reply, add_special_tokens=False))
    assert output_lens == [reply_len, len(tokenizer.encode(reply + " " + reply, add_special_tokens=False))]
    assert {request.prompt_text for request in workload.requests} == {long_question}
    prompt_len = len(tokenizer.encode(long_question))
    with pytest.raises(ValueError, match="has only 1 usable"):  # "e" no longer fits
        sharegpt_workload(str(path), tokenizer, 2, seed=0, max_model_len=prompt_len + reply_len)
    path.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="ShareGPT format"):
        sharegpt_workload(str(path), tokenizer, 1, seed=0, max_model_len=1024)


def test_default_arguments_give_a_random_workload(tokenizer):
    args = parse()
    assert (args.workload, args.num_requests, args.input_len_range, args.output_len_dist) == (
        "random", 128, [16, 256], "lognormal")
    workload = workload_from_args(args, tokenizer, max_model_len=1024)
    assert len(workload.requests) == 128
    assert workload == workload_from_args(parse(), tokenizer, max_model_len=1024)


def test_callers_may_change_the_defaults(tokenizer):
    args = parse(workload="long-prompt-mix", num_requests=10, long_prompt_len=60, output_len=5)
    workload = workload_from_args(args, tokenizer, max_model_len=128)
    assert workload.name == "long-prompt-mix" and len(workload.requests) == 10
    assert parse("--num-requests", "3", num_requests=10).num_requests == 3


@pytest.mark.parametrize("argv, name", [
    (["--workload", "shared-prefix", "--prefix-len", "64", "--output-len", "16", "--num-requests", "4"],
     "shared-prefix"),
    (["--workload", "sharegpt", "--num-requests", "4"], "sharegpt"),
    (["--input-len-dist", "fixed", "--input-len", "20", "--output-len-dist", "fixed", "--output-len", "10",
      "--num-requests", "4"], "random"),
])
def test_workload_from_args(tokenizer, argv, name):
    workload = workload_from_args(parse(*argv), tokenizer, max_model_len=128)
    assert workload.name == name and len(workload.requests) == 4


@pytest.mark.parametrize("argv, flag", [
    (["--workload", "shared-prefix"], "--prefix-len"),  # 1024 + 32 + 64 tokens
    (["--workload", "long-prompt-mix"], "--long-prompt-len"),  # 1024 + 64
    (["--output-len-range", "8", "900"], "--output-len-range"),  # up to 256 + 900
])
def test_workload_from_args_rejects_requests_that_cannot_fit(tokenizer, argv, flag):
    with pytest.raises(ValueError, match="max_model_len 1024") as error:
        workload_from_args(parse(*argv), tokenizer, max_model_len=1024)
    assert flag in str(error.value)
