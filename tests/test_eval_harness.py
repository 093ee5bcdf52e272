"""The requests an evaluation harness sends for log-likelihood scoring, checked against Hugging Face.

lm-evaluation-harness's `local-completions` model scores a (context, continuation) pair with one
/v1/completions request per batch of pairs: `echo: true, logprobs: 1, temperature: 0, seed: 1234`
and `max_tokens: 1`, the prompts as token ids (or text with `tokenized_requests=False`), and reads
`token_logprobs[ctxlen:-1]` (the continuation; the `-1` drops the generated token) and
`is_greedy` = every continuation logprob equals the largest of its `top_logprobs`. Other harnesses
send `max_tokens: 0` and read `token_logprobs[ctxlen:]`. The reference is Hugging Face's float32
log-softmax of every prompt position (tests/fixtures/default_model_prompt_logprobs.json).
"""

import json
import os

import pytest
from conftest import API_KEY
from helpers import http_client

MODEL = "tiny-stdlib-llama"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "default_model_prompt_logprobs.json")
TOLERANCE = 1e-4  # float32 logprobs, JAX against torch


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    with open(FIXTURE) as f:
        return json.load(f)["cases"]


def _score(url: str, prompts: list, max_tokens: int) -> list[dict]:
    """The choices of one harness-shaped scoring request, in prompt order."""
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": 1234, "echo": True}
    response = http_client.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    return sorted(response.json()["choices"], key=lambda choice: choice["index"])


def _continuation(choice: dict, ctxlen: int, end: int | None) -> tuple[float, bool, list, list]:
    """What lm-evaluation-harness's parse_logprobs makes of a choice: (log-likelihood, is_greedy), and the
    continuation's token logprobs and top logprobs it read them from."""
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:end]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:end]
    is_greedy = all(logprob == max(top.values()) for logprob, top in zip(token_logprobs, top_logprobs))
    return sum(token_logprobs), is_greedy, token_logprobs, top_logprobs


def _check_against_hugging_face(case: dict, choice: dict, ctxlen: int, end: int | None) -> None:
    """The continuation's logprobs, top-1 logprobs and greediness equal Hugging Face's."""
    ids = case["prompt_token_ids"]
    likelihood, is_greedy, token_logprobs, top_logprobs = _continuation(choice, ctxlen, end)
    positions = range(ctxlen, len(ids))
    assert len(token_logprobs) == len(positions)
    assert token_logprobs == pytest.approx([case["token_logprobs"][i] for i in positions], abs=TOLERANCE)
    assert likelihood == pytest.approx(sum(case["token_logprobs"][i] for i in positions), abs=TOLERANCE * len(ids))
    assert [max(top.values()) for top in top_logprobs] == pytest.approx(
        [case["top1_logprobs"][i] for i in positions], abs=TOLERANCE)
    clear = [i for i in positions if case["rank_margins"][i] > TOLERANCE]  # no near-tie to flip the argmax
    hf_greedy = {i: ids[i] == case["top1_ids"][i] for i in positions}
    ours = {i: logprob == max(top.values()) for i, logprob, top in zip(positions, token_logprobs, top_logprobs)}
    assert {i: ours[i] for i in clear} == {i: hf_greedy[i] for i in clear}
    if len(clear) == len(positions):
        assert is_greedy == all(hf_greedy.values())


@pytest.mark.parametrize("as_text", [False, True], ids=["token-ids", "text"])
@pytest.mark.parametrize("max_tokens,end", [(1, -1), (0, None)], ids=["lm-eval-max_tokens-1", "max_tokens-0"])
def test_log_likelihood_requests_match_hugging_face(openai_server, cases, as_text, max_tokens, end):
    url, engine = openai_server
    prompts = [case["prompt"] if as_text else case["prompt_token_ids"] for case in cases]
    choices = _score(url, prompts, max_tokens)
    assert len(choices) == len(cases)
    for case, choice in zip(cases, choices):
        ids = case["prompt_token_ids"]
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids) + max_tokens
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:len(ids)] == pytest.approx(case["token_logprobs"][1:], abs=TOLERANCE)
        assert choice["text"].startswith(case["prompt"] if as_text else engine.tokenizer.decode(ids))
        for ctxlen in sorted({1, len(ids) // 2, len(ids) - 1}):
            _check_against_hugging_face(case, choice, ctxlen, end)


def test_a_greedy_continuation_is_greedy_and_a_forced_one_is_not(openai_server, cases):
    url, _ = openai_server
    case = cases[2]
    ids = case["prompt_token_ids"]
    greedy = http_client.post(f"{url}/v1/completions", headers=AUTH, timeout=60, json={
        "prompt": ids, "max_tokens": 4, "temperature": 0, "return_token_ids": True}).json()["choices"][0]["token_ids"]
    choice = _score(url, [ids + greedy], 0)[0]
    assert _continuation(choice, len(ids), None)[1]  # the model's own greedy tokens are greedy
    forced = ids + [greedy[0] + 1] + greedy[1:]  # the first continuation token is not the model's choice
    choice = _score(url, [forced], 0)[0]
    assert not _continuation(choice, len(ids), None)[1]
