"""Per-request controls through the offline API (logit_bias, allowed_token_ids, bad_words, 64-bit seeds,
truncate_prompt_tokens, generation_config defaults) and failure isolation: one request that breaks in
the middle of a step ends alone with finish reason "error", and every page comes back."""

import json
import shutil

import pytest

from helpers import checkpoint, small_engine_args
from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine.generation_config import load_generation_defaults
from jaxserve.tokenizer import IncrementalDetokenizer

PROMPT = {"prompt_token_ids": [5, 99, 143, 7, 301, 42, 18, 256]}


@pytest.fixture(scope="module")
def llm():
    return LLM(checkpoint("llama"), **small_engine_args(num_pages=48, skip_precompile=True))


def _assert_pool_whole(llm):
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0


def _tokens(llm, **params):
    (output,) = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, **params), use_tqdm=False)
    return output.outputs[0].token_ids


def test_logit_bias_moves_the_greedy_choice(llm):
    plain = _tokens(llm, temperature=0)
    favoured = next(t for t in range(10, 500) if t not in plain)
    assert _tokens(llm, temperature=0, logit_bias={favoured: 100}) == [favoured] * 12
    # A large negative bias on the first greedy token makes greedy decoding avoid it there.
    assert _tokens(llm, temperature=0, logit_bias={plain[0]: -100})[0] != plain[0]


def test_allowed_token_ids_restrict_sampling(llm):
    assert set(_tokens(llm, temperature=1.5, seed=1, allowed_token_ids=[11, 12, 13])) <= {11, 12, 13}


def test_bad_words_ban_multi_token_sequences(llm):
    plain = _tokens(llm, temperature=0)
    word = llm.get_tokenizer().decode(plain[2:4])  # a two-token piece of the greedy continuation
    banned = llm.get_tokenizer().encode(word, add_special_tokens=False)
    output = _tokens(llm, temperature=0, bad_words=[word])
    pairs = [output[i : i + len(banned)] for i in range(len(output) - len(banned) + 1)]
    assert banned not in pairs
    assert output[:2] == plain[:2], "the ban acts only where the prefix has been generated"


def test_seeds_use_all_64_bits(llm):
    sampled = {seed: _tokens(llm, temperature=1.0, seed=seed) for seed in (5, 5 + 2**32, -5, 2**63 - 1)}
    assert len({tuple(t) for t in sampled.values()}) == 4
    assert _tokens(llm, temperature=1.0, seed=-5) == sampled[-5]


def test_every_sampled_token_has_its_exact_rank(llm):
    (output,) = llm.generate(PROMPT, SamplingParams(temperature=20.0, seed=0, max_tokens=24, logprobs=0,
                                                    ignore_eos=True), use_tqdm=False)
    completion = output.outputs[0]
    ranks = [entries[token].rank for token, entries in zip(completion.token_ids, completion.logprobs)]
    assert all(isinstance(rank, int) and rank >= 1 for rank in ranks)
    assert max(ranks) > 20, "at temperature 20 some samples come from outside the top 20"


def test_truncate_prompt_tokens_keeps_the_tail(llm):
    (output,) = llm.generate(PROMPT, SamplingParams(max_tokens=2, truncate_prompt_tokens=3), use_tqdm=False)
    assert output.prompt_token_ids == PROMPT["prompt_token_ids"][-3:]


@pytest.mark.parametrize("params, field", [
    (SamplingParams(logit_bias={600: 1.0}), "logit_bias"),
    (SamplingParams(allowed_token_ids=[3, 512]), "allowed_token_ids"),
    (SamplingParams(stop_token_ids=[512]), "stop_token_ids"),
])
def test_token_ids_outside_the_vocabulary_are_value_errors(llm, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(PROMPT, params, use_tqdm=False)
    _assert_pool_whole(llm)


def test_a_request_whose_inputs_cannot_be_built_fails_alone(llm):
    """Validation stops bad values at the door; a value changed after validation (the params object is
    mutable) must still fail only its own request, mid-step, with its pages back."""
    broken = SamplingParams(temperature=1.0, max_tokens=8)
    broken.top_k = 2**40  # overflows the int32 array it is packed into
    good = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([PROMPT, PROMPT, PROMPT], [good, broken, good], use_tqdm=False)
    assert outputs[1].outputs[0].finish_reason == "error"
    assert "top_k" in outputs[1].error or "int" in outputs[1].error
    assert outputs[0].outputs[0].token_ids == outputs[2].outputs[0].token_ids == _tokens(llm, temperature=0)[:8]
    assert outputs[0].error is None
    _assert_pool_whole(llm)


def test_a_failing_detokenizer_fails_its_request_alone(llm, monkeypatch):
    original_init = IncrementalDetokenizer.__init__

    def cannot_decode(token_ids):
        raise UnicodeError("cannot decode")

    def init(self, tokenizer, prompt_ids, *args, **kwargs):
        original_init(self, tokenizer, prompt_ids, *args, **kwargs)
        if prompt_ids[-1] == 77:  # the marked request's detokenizer breaks
            self.add_tokens = cannot_decode

    monkeypatch.setattr(IncrementalDetokenizer, "__init__", init)
    good = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([PROMPT, {"prompt_token_ids": [5, 77]}], good, use_tqdm=False)
    assert outputs[1].outputs[0].finish_reason == "error" and "cannot decode" in outputs[1].error
    assert len(outputs[0].outputs[0].token_ids) == 6 and outputs[0].outputs[0].finish_reason == "length"
    _assert_pool_whole(llm)


def test_an_interrupted_generate_leaves_nothing_queued(llm, monkeypatch):
    calls = []
    step = llm.engine.step

    def step_then_interrupt():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", step_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT] * 4, SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)
    monkeypatch.undo()
    _assert_pool_whole(llm)
    assert not llm.engine.has_unfinished_requests()
    assert len(_tokens(llm, temperature=0)) == 12


def test_generation_config_defaults(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(checkpoint("llama"), model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, max_new_tokens=99, do_sample=True)
    (model / "generation_config.json").write_text(json.dumps(config))
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 99}
    assert load_generation_defaults("auto", str(model)) == defaults
    assert load_generation_defaults(str(model), checkpoint("llama")) == defaults
    assert load_generation_defaults("vllm", str(model)) == {}
    assert load_generation_defaults("auto", checkpoint("llama")) == {}
    config["top_p"] = 1.5
    (model / "generation_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="top_p"):
        load_generation_defaults("auto", str(model))
    with pytest.raises(ValueError, match="generation_config"):
        EngineConfig(generation_config=str(tmp_path / "missing"))


def test_offline_defaults_come_from_the_engine(llm, monkeypatch):
    monkeypatch.setattr(llm.engine.requests, "generation_defaults", {"temperature": 0.0, "max_tokens": 3})
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=3)
    (output,) = llm.generate(PROMPT, use_tqdm=False)
    assert len(output.outputs[0].token_ids) <= 3


def test_a_request_that_cannot_be_queued_leaves_nothing_behind(llm, monkeypatch):
    engine = llm.engine
    engine.add_request("dup", PROMPT["prompt_token_ids"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", PROMPT["prompt_token_ids"], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    calls = []

    def add_then_fail(request):
        calls.append(request.request_id)
        if len(calls) == 2:
            raise RuntimeError("queue full")
        original(request)

    original = engine.core.add_request
    monkeypatch.setattr(engine.core, "add_request", add_then_fail)
    with pytest.raises(RuntimeError):
        engine.add_request("two", PROMPT["prompt_token_ids"], SamplingParams(n=2, max_tokens=2))
    assert not engine.has_unfinished_requests() and not engine.output_processor.has_request("two")
    _assert_pool_whole(llm)
