"""best_of: `best_of` seeded samples share the prompt, and the `n` with the highest cumulative logprob
are returned, indexed 0..n-1 from the highest down (vLLM's rule); nothing is shown before every sample
has finished, so a sample that loses is never seen. Offline on the llama fixture, and over HTTP on
/v1/completions."""

import json

import httpx
import pytest
from conftest import API_KEY
from helpers import checkpoint, expected, http_client, small_engine_args

from jaxserve import LLM, SamplingParams

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def llm():
    return LLM(checkpoint("llama"), **small_engine_args(skip_precompile=True))


@pytest.fixture(scope="module")
def prompt():
    return {"prompt_token_ids": expected("llama")["prompts"][3]}


def _assert_pool_whole(llm):
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0


def _independent(llm, prompt, params: SamplingParams) -> list[tuple[float, list[int], str, int]]:
    """(cumulative logprob, tokens, text, i) of each of the best_of samples run as its own request (seed + i),
    in one batch; sorted from the highest cumulative logprob down."""
    singles = [params.clone(n=1, best_of=None, seed=params.seed + i, logprobs=0) for i in range(params.best_of)]
    outputs = llm.generate([prompt] * len(singles), singles, use_tqdm=False)
    samples = [(o.outputs[0].cumulative_logprob, o.outputs[0].token_ids, o.outputs[0].text, i)
               for i, o in enumerate(outputs)]
    assert len({tuple(s[1]) for s in samples}) == len(samples), "the seeds should give distinct samples"
    return sorted(samples, key=lambda s: s[0], reverse=True)


@pytest.mark.parametrize("n,best_of,logprobs", [(1, 4, None), (2, 5, None), (2, 5, 2), (3, 3, None)])
def test_the_n_best_of_the_independent_seeded_samples_come_back_best_first(llm, prompt, n, best_of, logprobs):
    params = SamplingParams(n=n, best_of=best_of, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True,
                            logprobs=logprobs)
    (result,) = llm.generate(prompt, params, use_tqdm=False)
    ranked = _independent(llm, prompt, params)
    if best_of > n:  # the ranking must be clear, and differ from the seed order, for the test to mean something
        assert ranked[n - 1][0] - ranked[n][0] > 1e-3
        assert [s[3] for s in ranked[:n]] not in (list(range(n)), list(range(n))[::-1])
    assert [c.index for c in result.outputs] == list(range(n))
    if best_of == n:  # no ranking: the samples in seed order, exactly as n alone gives them
        (plain,) = llm.generate(prompt, params.clone(best_of=None), use_tqdm=False)
        assert [c.token_ids for c in result.outputs] == [c.token_ids for c in plain.outputs]
    else:
        assert [c.token_ids for c in result.outputs] == [s[1] for s in ranked[:n]]
        assert [c.text for c in result.outputs] == [s[2] for s in ranked[:n]]
    for completion in result.outputs:
        assert completion.finish_reason == "length" and len(completion.token_ids) == 8
        if logprobs is None:  # computed to rank the samples, but not asked for: not shown (vLLM's rule)
            assert completion.logprobs is None and completion.cumulative_logprob is None
        else:
            assert len(completion.logprobs) == 8
            assert completion.cumulative_logprob == pytest.approx(
                sum(entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)))
    if logprobs is not None:
        cumulative = [c.cumulative_logprob for c in result.outputs]
        assert cumulative == sorted(cumulative, reverse=True)
        assert cumulative == pytest.approx([s[0] for s in ranked[:n]], rel=1e-5, abs=1e-4)
    _assert_pool_whole(llm)


def test_nothing_is_shown_until_every_sample_finished(llm, prompt):
    """Offline streaming (LLMEngine.step): a best_of > n request gives exactly one output, its final one,
    while a plain n request of the same size shows its progress."""
    engine = llm.engine
    ranked = SamplingParams(n=2, best_of=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    engine.add_request("ranked", prompt["prompt_token_ids"], ranked)
    engine.add_request("plain", prompt["prompt_token_ids"], ranked.clone(n=4, best_of=None))
    seen = {"ranked": [], "plain": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output)
    assert len(seen["plain"]) > 1 and not seen["plain"][0].finished
    (final,) = seen["ranked"]
    assert final.finished and len(final.outputs) == 2
    plain = seen["plain"][-1].outputs  # the same four samples (same seeds), unranked
    assert {tuple(c.token_ids) for c in final.outputs} <= {tuple(c.token_ids) for c in plain}
    _assert_pool_whole(llm)


def test_abort_returns_the_n_best_so_far_and_frees_every_page(llm, prompt):
    engine = llm.engine
    engine.add_request("cut", prompt["prompt_token_ids"],
                       SamplingParams(n=2, best_of=4, temperature=1.0, seed=9, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        assert engine.step() == []
    final = engine.abort_request("cut")
    assert final.finished and [c.index for c in final.outputs] == [0, 1]
    assert all(c.finish_reason == "abort" for c in final.outputs)
    assert not engine.has_unfinished_requests()
    _assert_pool_whole(llm)


def test_prompt_logprobs_are_scored_once_and_returned_with_the_best(llm, prompt):
    params = SamplingParams(n=1, best_of=3, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=1)
    (ranked,) = llm.generate(prompt, params, use_tqdm=False)
    (plain,) = llm.generate(prompt, params.clone(best_of=None), use_tqdm=False)
    ids = prompt["prompt_token_ids"]
    assert len(ranked.prompt_logprobs) == len(ids) and ranked.prompt_logprobs[0] is None
    scored = [[e[t].logprob for t, e in zip(ids[1:], o.prompt_logprobs[1:])] for o in (ranked, plain)]
    assert scored[0] == pytest.approx(scored[1], rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("changes, words", [
    ({"best_of": 0}, "best_of must be an int in [1,"),
    ({"best_of": 2**31}, "best_of must be an int in [1,"),
    ({"best_of": 2.0}, "best_of must be an int"),
    ({"best_of": True}, "best_of must be an int"),
    ({"best_of": "3"}, "best_of must be an int"),
    ({"n": 3, "best_of": 2}, "best_of must be greater than or equal to n, got n=3 and best_of=2."),
])
def test_bad_best_of_is_a_value_error_naming_it(llm, prompt, changes, words):
    with pytest.raises(ValueError) as error:
        SamplingParams(**changes)
    assert str(error.value).startswith(words)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=2, best_of=4).clone(**changes)
    _assert_pool_whole(llm)


def test_engine_params_compute_logprobs_only_to_rank():
    plain = SamplingParams(n=2)
    assert plain.engine_params() is plain and plain.num_samples == 2
    ranked = SamplingParams(n=2, best_of=3)
    assert ranked.num_samples == 3 and ranked.logprobs is None and ranked.output_logprobs is None
    run = ranked.engine_params()
    assert run.logprobs == 0 and run.output_logprobs is None and run.num_samples == 3
    assert ranked.logprobs is None, "the user's params are left alone"
    asked = SamplingParams(n=2, best_of=3, logprobs=0)
    assert asked.engine_params() is asked and asked.output_logprobs == 0


# ---- over HTTP (/v1/completions) ---------------------------------------------------------------------


def _post(url: str, body: dict) -> httpx.Response:
    return http_client.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120)


def test_http_best_of_returns_the_n_best_choices(openai_server):
    url, _ = openai_server
    body = {"prompt": "def fibonacci(n):", "temperature": 1.0, "seed": 21, "max_tokens": 6, "ignore_eos": True,
            "return_token_ids": True}
    singles = []
    for i in range(4):
        choice = _post(url, {**body, "seed": 21 + i, "logprobs": 0}).json()["choices"][0]
        singles.append((sum(choice["logprobs"]["token_logprobs"]), choice["token_ids"], i))
    singles.sort(key=lambda s: s[0], reverse=True)
    assert singles[1][0] - singles[2][0] > 1e-3 and {s[2] for s in singles[:2]} != {0, 1}

    response = _post(url, {**body, "n": 2, "best_of": 4})
    assert response.status_code == 200, response.text
    result = response.json()
    assert [c["index"] for c in result["choices"]] == [0, 1]
    assert [c["token_ids"] for c in result["choices"]] == [s[1] for s in singles[:2]]
    assert all(c["logprobs"] is None for c in result["choices"])
    # vLLM counts the returned choices' tokens
    assert result["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in result["choices"]) == 12

    with_logprobs = _post(url, {**body, "n": 2, "best_of": 4, "logprobs": 1}).json()["choices"]
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in with_logprobs]
    assert sums == pytest.approx([s[0] for s in singles[:2]], rel=1e-5, abs=1e-4)

    # two prompts: choices numbered prompt_index * n + index
    two = _post(url, {**body, "prompt": ["def fibonacci(n):", "class Stack:"], "n": 1, "best_of": 3}).json()
    assert [c["index"] for c in two["choices"]] == [0, 1]


def _events(url: str, body: dict) -> list:
    events = []
    with http_client.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=AUTH,
                            timeout=120) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_http_streamed_best_of_comes_whole_in_one_event(openai_server):
    """vLLM does not stream best_of > n (as OpenAI): the whole response is one event, then [DONE]."""
    url, _ = openai_server
    body = {"prompt": "def fibonacci(n):", "temperature": 1.0, "seed": 4, "max_tokens": 5, "ignore_eos": True,
            "n": 1, "best_of": 3, "return_token_ids": True}
    events = _events(url, body)
    assert len(events) == 2 and events[1] == "[DONE]"
    whole = _post(url, body).json()
    assert events[0]["object"] == "text_completion"
    assert events[0]["choices"] == whole["choices"] and events[0]["usage"] == whole["usage"]
    # best_of == n streams as n does
    streamed = _events(url, {**body, "best_of": 1})
    assert len(streamed) > 2 and streamed[-1] == "[DONE]"


@pytest.mark.parametrize("fields, words", [
    ({"n": 3, "best_of": 2}, "best_of must be greater than or equal to n, got n=3 and best_of=2."),
    ({"best_of": 0}, "best_of"),
    ({"best_of": 5}, "best_of must be in [n, 4]"),  # the server's max_n
    ({"best_of": 2**63}, "best_of must be in [n, 4]"),
    ({"best_of": -(2**31) - 1}, "best_of"),
])
def test_http_bad_best_of_is_a_400_naming_it(openai_server, fields, words):
    url, _ = openai_server
    response = _post(url, {"prompt": "hi", "max_tokens": 1, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "best_of" and words in error["message"], error
    streamed = _post(url, {"prompt": "hi", "max_tokens": 1, "stream": True, **fields})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "best_of"


def test_http_chat_still_refuses_best_of_other_than_n(openai_server):
    url, _ = openai_server
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    response = http_client.post(url + "/v1/chat/completions", json={**chat, "best_of": 2}, headers=AUTH, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "best_of"
    same = http_client.post(url + "/v1/chat/completions", json={**chat, "n": 2, "best_of": 2}, headers=AUTH, timeout=60)
    assert same.status_code == 200, same.text
