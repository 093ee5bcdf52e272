"""Engine behaviour through the offline API: sampling semantics, stop conditions, bad input,
page accounting and the no-recompilation promise. One compiled engine serves the whole module."""

import random

import pytest

from jaxserve import LLM, SamplingParams
from helpers import checkpoint, expected, small_engine_args

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(checkpoint("llama"), **small_engine_args(num_pages=48, skip_precompile=False))


@pytest.fixture(scope="module")
def want():
    return expected("llama")


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _assert_pool_whole(llm):
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0


def test_random_workload_compiles_nothing_after_warmup(llm, want):
    rng = random.Random(0)
    prompts, params = [], []
    for i in range(40):
        prompts.append([rng.randrange(4, 512) for _ in range(rng.randint(1, 100))])
        params.append(SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.3]),
            top_k=rng.choice([0, 5, 50]),
            top_p=rng.choice([1.0, 0.9]),
            min_p=rng.choice([0.0, 0.05]),
            presence_penalty=rng.choice([0.0, 0.5]),
            repetition_penalty=rng.choice([1.0, 1.2]),
            logprobs=rng.choice([None, 0, 3]),
            min_tokens=rng.choice([0, 4]),
            max_tokens=rng.randint(4, 24),
            seed=rng.choice([None, i]),
            stop_token_ids=rng.choice([[], [7, 8]]),
        ))
    outputs = llm.generate(_ids(prompts), params, use_tqdm=False)
    assert len(outputs) == 40 and all(o.finished for o in outputs)
    stats = llm.stats()
    assert stats["compilations_after_warmup"] == 0
    assert stats["lazy_bucket_compilations"] == 0
    _assert_pool_whole(llm)


def test_skip_precompile_compiles_each_bucket_at_its_first_use(want):
    lazy = LLM(checkpoint("llama"), **small_engine_args(num_pages=40, skip_precompile=True))
    assert lazy.stats()["executables"] == 0
    every_bucket = sum(len(shapes) for shapes in lazy.engine.core.runner.shapes())
    outputs = lazy.generate(_ids(want["prompts"]), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want["outputs"]
    used = lazy.stats()["executables"]
    assert 0 < used < every_bucket  # only the shapes these requests took (compiled, or shared in this process)
    assert lazy.stats()["lazy_bucket_compilations"] <= used
    lazy.generate(_ids(want["prompts"]), GREEDY, use_tqdm=False)
    assert lazy.stats()["executables"] == used  # the same shapes again: nothing more to compile
    _assert_pool_whole(lazy)


def test_seeded_sample_does_not_depend_on_the_batch(llm, want):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    prompt = want["prompts"][5]
    (alone,) = llm.generate(_ids([prompt]), params, use_tqdm=False)
    others = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    batch = llm.generate(_ids(want["prompts"][:5] + [prompt] + want["prompts"][6:]),
                         [others] * 5 + [params] + [others] * 6, use_tqdm=False)
    assert batch[5].outputs[0].token_ids == alone.outputs[0].token_ids
    unseeded = llm.generate(_ids([prompt] * 2), SamplingParams(temperature=1.0, max_tokens=16), use_tqdm=False)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_n_samples_are_independent_seeded_children(llm, want):
    prompt = want["prompts"][3]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    (result,) = llm.generate(_ids([prompt]), params, use_tqdm=False)
    assert [c.index for c in result.outputs] == [0, 1, 2]
    for child in result.outputs:
        single = params.clone(n=1, seed=7 + child.index)
        (alone,) = llm.generate(_ids([prompt]), single, use_tqdm=False)
        assert child.token_ids == alone.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in result.outputs}) > 1


def test_stop_string_truncates_text_and_frees_pages(llm):
    (free_run,) = llm.generate(["def f(x):"], GREEDY, use_tqdm=False)
    text = free_run.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop and text.find(stop) > 0
    (stopped,) = llm.generate(["def f(x):"], GREEDY.clone(stop=[stop]), use_tqdm=False)
    assert stopped.outputs[0].text == text[: text.find(stop)]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop
    (kept,) = llm.generate(["def f(x):"], GREEDY.clone(stop=[stop], include_stop_str_in_output=True), use_tqdm=False)
    assert kept.outputs[0].text == text[: text.find(stop) + len(stop)]
    _assert_pool_whole(llm)


def test_stop_token_ids_eos_min_tokens_and_max_tokens(llm, want):
    prompt, tokens = want["prompts"][0], want["outputs"][0]
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    (stopped,) = llm.generate(_ids([prompt]), GREEDY.clone(stop_token_ids=[stop_id]), use_tqdm=False)
    assert stopped.outputs[0].token_ids == tokens[: first + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop_id

    # min_tokens bans the stop id until enough tokens exist, so the sequence must differ at `first`.
    (late,) = llm.generate(_ids([prompt]), GREEDY.clone(stop_token_ids=[stop_id], min_tokens=first + 2),
                           use_tqdm=False)
    assert len(late.outputs[0].token_ids) >= first + 2
    assert stop_id not in late.outputs[0].token_ids[: first + 1]

    (capped,) = llm.generate(_ids([prompt]), GREEDY.clone(max_tokens=3), use_tqdm=False)
    assert capped.outputs[0].token_ids == tokens[:3] and capped.outputs[0].finish_reason == "length"


def test_eos_ends_the_request_unless_ignored(llm, want):
    engine = llm.engine
    assert engine.core.spec.eos_token_ids == (1,), "read from generation_config.json"
    prompt, tokens = want["prompts"][0], want["outputs"][0]
    eos = tokens[6]  # pretend this token is EOS, so greedy decoding meets it
    finals = {}
    for request_id, ignore in (("eos", False), ("ignored", True)):
        text, children = engine.make_requests(request_id, prompt, GREEDY.clone(ignore_eos=ignore))
        for child in children:
            child.eos_token_ids = (eos,)
        engine.submit(request_id, (text, children))
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["eos"].outputs[0].token_ids == tokens[: tokens.index(eos) + 1]
    assert finals["eos"].outputs[0].finish_reason == "stop"
    assert finals["ignored"].outputs[0].token_ids == tokens


def test_context_length_caps_generation(llm):
    prompt = list(range(4, 4 + 120))
    (result,) = llm.generate(_ids([prompt]), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                             use_tqdm=False)
    assert len(result.outputs[0].token_ids) == 128 - 120
    assert result.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        (list(range(4, 4 + 128)), None, "max_model_len"),
        ("", None, "empty"),
        ([], None, "empty"),
        ([5, 512], None, "vocabulary"),
        ([5, -1], None, "vocabulary"),
        ([5, 6], SamplingParams(stop_token_ids=[9999]), "stop_token_ids"),
    ],
)
def test_bad_prompts_are_value_errors_and_queue_nothing(llm, prompt, params, message):
    good = [{"prompt_token_ids": [5, 6, 7]}]
    with pytest.raises(ValueError, match=message):
        llm.generate(good + ([prompt] if isinstance(prompt, str) else _ids([prompt])), params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_sampling_params_are_value_errors(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_abort_returns_pages_at_once(llm, want):
    engine = llm.engine
    engine.add_request("to-abort", want["prompts"][10], GREEDY)
    engine.add_request("to-finish", want["prompts"][11], GREEDY)
    for _ in range(3):
        engine.step()
    assert llm.stats()["kv_pages_free"] < llm.stats()["kv_pages_total"]
    final = engine.abort_request("to-abort")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    _assert_pool_whole(llm)


def test_chat_applies_the_chat_template(llm):
    messages = [{"role": "user", "content": "hello"}]
    tokenizer = llm.get_tokenizer()
    template_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    template_ids = list(template_ids["input_ids"] if hasattr(template_ids, "keys") else template_ids)
    (chat,) = llm.chat(messages, GREEDY.clone(max_tokens=5), use_tqdm=False)
    (plain,) = llm.generate(_ids([template_ids]), GREEDY.clone(max_tokens=5), use_tqdm=False)
    assert chat.prompt_token_ids == template_ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids


def test_outputs_come_back_in_input_order_with_text(llm, want):
    prompts = ["import os", [5, 6, 7], {"prompt": "class A:"}, {"prompt_token_ids": want["prompts"][2]}]
    outputs = llm.generate(prompts, GREEDY.clone(max_tokens=4), use_tqdm=False)
    assert [o.prompt for o in outputs] == ["import os", None, "class A:", None]
    assert outputs[1].prompt_token_ids == [5, 6, 7]
    tokenizer = llm.get_tokenizer()
    for o in outputs:
        assert o.outputs[0].text == tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)
    assert outputs[3].outputs[0].token_ids == want["outputs"][2][:4]


def test_stats_report_engine_counters(llm):
    stats = llm.stats()
    for key in ("steps", "scheduled_tokens", "preemptions", "kv_pages_total", "kv_pages_free",
                "compilations_after_warmup"):
        assert key in stats
    assert stats["steps"] > 0 and stats["scheduled_tokens"] >= stats["steps"]


def test_kv_pages_are_updated_in_place(llm, want):
    runner = llm.engine.core.runner
    before = [cache.unsafe_buffer_pointer() for cache in runner.kv_caches]
    outputs = llm.generate(_ids(want["prompts"][:4]), GREEDY.clone(max_tokens=6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [w[:6] for w in want["outputs"][:4]]
    # Donation aliases the step's output pages to its input pages: no copy of the pool per step.
    assert [cache.unsafe_buffer_pointer() for cache in runner.kv_caches] == before
