"""vLLM's and OpenAI's generation fields over HTTP, on the real server (conftest's `openai_server`):
echo and prompt logprobs, logit_bias / allowed_token_ids / bad_words, truncate_prompt_tokens,
return_token_ids, cache_salt, the usage options, refused fields, chat echo and per-request engine
errors; and, on a fake engine (no compilation), the model's generation defaults and the
--enable-force-include-usage / --enable-prompt-tokens-details options. Each bug of issue 9 in the
server has a test here that failed before the fix.
"""

import json
import logging

import httpx
import openai
import pytest
from conftest import API_KEY
from helpers import http_client, running_server
from test_async_engine import FakeEngine

from jaxserve.server.app import build_app
from jaxserve.server.config import ServerConfig

MODEL = "tiny-stdlib-llama"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "def fibonacci(n):"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@pytest.fixture(scope="module")
def client(openai_server):
    url, _ = openai_server
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)


def _post(url: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return http_client.post(url + path, json=body, headers=AUTH if headers is None else headers, timeout=60)


def _events(url: str, path: str, body: dict, headers: dict | None = None) -> list:
    """The SSE events of a streamed request: parsed JSON objects, and the string "[DONE]"."""
    events = []
    with http_client.stream("POST", url + path, json={**body, "stream": True},
                            headers=AUTH if headers is None else headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _choices(events: list, index: int = 0) -> list[dict]:
    """The streamed choices with `index`, in order."""
    return [c for e in events if isinstance(e, dict) for c in e.get("choices", []) if c["index"] == index]


def _joined_logprobs(choices: list[dict]) -> dict:
    """The logprobs objects of streamed choices joined into one."""
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for choice in choices:
        for key in joined:
            joined[key] += choice["logprobs"][key]
    return joined


def _assert_logprobs_close(actual: dict, expected: dict) -> None:
    """Two completions logprobs objects agree: same tokens and offsets, logprobs to float32 rounding."""
    assert actual["tokens"] == expected["tokens"] and actual["text_offset"] == expected["text_offset"]
    assert actual["token_logprobs"] == pytest.approx(expected["token_logprobs"], abs=1e-5)
    for top, expected_top in zip(actual["top_logprobs"], expected["top_logprobs"], strict=True):
        assert (top is None) == (expected_top is None)
        assert top is None or top == pytest.approx(expected_top, abs=1e-5)


def _assert_error(response: httpx.Response, param: str, words: str = "") -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert words.lower() in error["message"].lower(), error["message"]


def _tokens(url: str, text: str) -> list[int]:
    return http_client.post(f"{url}/tokenize", json={"prompt": text}).json()["tokens"]


# ---- echo and prompt logprobs ---------------------------------------------------------------------


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(openai_server):
    """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:N" (the sampled one and the top ones)
    on completions, whole and streamed, and on chat; without it, by their text."""
    url, _ = openai_server
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = _post(url, "/v1/completions", body).json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{token}" for token in choice["token_ids"]]
    assert all(name.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for name in top)
    streamed = _joined_logprobs(_choices(_events(url, "/v1/completions", {**body, "stream": True})))
    assert streamed["tokens"] == choice["logprobs"]["tokens"]
    texts = _post(url, "/v1/completions", {**body, "return_tokens_as_token_ids": False}).json()["choices"][0]
    assert not any(token.startswith("token_id:") for token in texts["logprobs"]["tokens"])
    chat = _post(url, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "temperature": 0,
        "logprobs": True, "top_logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]
    assert all(top["token"].startswith("token_id:") for entry in content for top in entry["top_logprobs"])


def test_echo_with_max_tokens_zero_scores_the_prompt(openai_server):
    url, engine = openai_server
    ids = _tokens(url, PROMPT)
    body = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}
    response = _post(url, "/v1/completions", body)
    assert response.status_code == 200, response.text
    choice, usage = response.json()["choices"][0], response.json()["usage"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert usage == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [engine.tokenizer.decode([i]) for i in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    offsets = [0]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets
    prompt_logprobs = choice["prompt_logprobs"]  # vLLM's field: {token id: {logprob, rank, decoded_token}}
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for token_id, logprob, top, entries in zip(ids[1:], logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:],
                                               prompt_logprobs[1:]):
        entry = entries[str(token_id)]
        assert entry["logprob"] == logprob <= 0 and entry["rank"] >= 1
        assert entry["decoded_token"] == engine.tokenizer.decode([token_id])
        best = max(entries.values(), key=lambda e: e["logprob"])
        assert best["rank"] == 1 and max(top.values()) == best["logprob"] and 1 <= len(top) <= 2


def test_echo_prepends_the_prompt_to_the_generated_text_and_logprobs(openai_server):
    url, _ = openai_server
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 2}
    plain = _post(url, "/v1/completions", body).json()["choices"][0]
    echoed = _post(url, "/v1/completions", {**body, "echo": True}).json()["choices"][0]
    num_prompt = len(_tokens(url, PROMPT))
    assert echoed["text"] == PROMPT + plain["text"]
    assert len(echoed["logprobs"]["tokens"]) == num_prompt + 5
    prompt_chars = sum(len(t) for t in echoed["logprobs"]["tokens"][:num_prompt])
    output_part = {key: values[num_prompt:] for key, values in echoed["logprobs"].items()}
    output_part["text_offset"] = [o - prompt_chars for o in output_part["text_offset"]]
    _assert_logprobs_close(output_part, plain["logprobs"])


def test_echo_of_a_token_id_prompt_is_the_decoded_ids(openai_server):
    url, engine = openai_server
    ids = _tokens(url, "import os\n")
    response = _post(url, "/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 0})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] == engine.tokenizer.decode(ids) and choice["logprobs"] is None
    assert choice["prompt_logprobs"] is None  # echo without logprobs asks for none


def test_streamed_echo_equals_not_streamed(openai_server):
    url, _ = openai_server
    body = {"prompt": [PROMPT, "import sys\n"], "max_tokens": 6, "temperature": 0, "logprobs": 1, "echo": True, "n": 2}
    whole = _post(url, "/v1/completions", body).json()["choices"]
    events = _events(url, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    for expected in whole:
        chunks = _choices(events, expected["index"])
        prompt = PROMPT if expected["index"] < 2 else "import sys\n"
        assert chunks[0]["text"].startswith(prompt)  # the prompt comes with the first chunk
        assert "".join(c["text"] for c in chunks) == expected["text"]
        _assert_logprobs_close(_joined_logprobs(chunks), expected["logprobs"])
        assert chunks[-1]["finish_reason"] == expected["finish_reason"]


def test_prompt_logprobs_extra_without_echo(client, openai_server):
    url, _ = openai_server
    ids = _tokens(url, "import os\n")
    response = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=2, temperature=0,
                                         extra_body={"prompt_logprobs": 3})
    choice = response.choices[0]
    assert choice.logprobs is None and choice.text == response.choices[0].text
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for token_id, entries in zip(ids[1:], prompt_logprobs[1:]):
        ranks = sorted(e["rank"] for e in entries.values())
        assert str(token_id) in entries and 3 <= len(entries) <= 4
        assert [r for r in ranks if r <= 3] == [1, 2, 3]
        by_rank = sorted(entries.values(), key=lambda e: e["rank"])
        assert [e["logprob"] for e in by_rank] == sorted((e["logprob"] for e in by_rank), reverse=True)


def test_chat_prompt_logprobs_are_a_top_level_field(openai_server):
    url, _ = openai_server
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 1}
    response = _post(url, "/v1/chat/completions", body).json()
    prompt_logprobs = response["prompt_logprobs"]
    assert len(prompt_logprobs) == response["usage"]["prompt_tokens"] and prompt_logprobs[0] is None
    assert all(1 <= len(entries) <= 2 for entries in prompt_logprobs[1:])
    assert _post(url, "/v1/chat/completions", {**body, "prompt_logprobs": None}).json()["prompt_logprobs"] is None


def test_prompt_logprobs_with_stream_and_max_tokens_zero_without_echo_are_400(openai_server):
    url, _ = openai_server
    response = _post(url, "/v1/completions", {"prompt": "hi", "stream": True, "prompt_logprobs": 1})
    _assert_error(response, "prompt_logprobs", "not available when `stream=True`")
    _assert_error(_post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 0}), "max_tokens", "echo=true")
    _assert_error(_post(url, "/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}), "prompt_logprobs", "[0, 20]")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}
    _assert_error(_post(url, "/v1/chat/completions", chat), "max_completion_tokens", "at least 1")


# ---- text offsets while a stop string is held back (issue 9's bug) ----------------------------------


def test_streamed_text_offset_equals_not_streamed_while_a_stop_string_is_held_back(openai_server):
    url, _ = openai_server
    body = {"prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0, "stop": ["    ", ">>>"], "logprobs": 1}
    whole = _post(url, "/v1/completions", body).json()["choices"][0]
    assert whole["finish_reason"] == "stop"
    held_back = False
    for _ in range(5):  # a client that reads late gets the outputs in fewer, bigger chunks: stream until one shows
        chunks = _choices(_events(url, "/v1/completions", body))
        streamed = _joined_logprobs(chunks)
        assert streamed["text_offset"] == whole["logprobs"]["text_offset"]
        assert streamed["tokens"] == whole["logprobs"]["tokens"]
        assert "".join(c["text"] for c in chunks) == whole["text"]
        # Some chunk sent less text than its tokens' text: the stop string's start was held back.
        held_back = any(len(c["text"]) != sum(len(t) for t in c["logprobs"]["tokens"]) for c in chunks[:-1])
        if held_back:
            break
    assert held_back


# ---- logit_bias, allowed_token_ids, bad_words ------------------------------------------------------


def _greedy_ids(url: str, path: str, body: dict) -> list[int]:
    response = _post(url, path, {"max_tokens": 4, "temperature": 0, "return_token_ids": True, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "import os\n"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "import os"}]}),
], ids=["completions", "chat"])
def test_logit_bias_allowed_token_ids_and_bad_words_steer_the_output(openai_server, path, body):
    url, engine = openai_server
    baseline = _greedy_ids(url, path, body)
    forced = 292  # " self"
    assert forced not in baseline
    assert _greedy_ids(url, path, {**body, "logit_bias": {str(forced): 100}}) == [forced] * 4
    assert _greedy_ids(url, path, {**body, "logit_bias": {str(baseline[0]): -100}})[0] != baseline[0]
    allowed = [276, 335]  # "self", " return"
    assert set(_greedy_ids(url, path, {**body, "allowed_token_ids": allowed})) <= set(allowed)
    logprobs = {"logprobs": 3} if path == "/v1/completions" else {"logprobs": True, "top_logprobs": 3}
    response = _post(url, path, {**body, "max_tokens": 2, "allowed_token_ids": allowed, **logprobs})
    assert response.status_code == 200 and "Infinity" not in response.text  # -inf logprobs go out as -9999.0
    word = engine.tokenizer.decode([baseline[0]]).strip()
    spellings = [engine.tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    assert [baseline[0]] in spellings  # a one-token word: banned wherever it would come
    assert baseline[0] not in _greedy_ids(url, path, {**body, "bad_words": [word]})


@pytest.mark.parametrize("field,value,words", [
    ("logit_bias", {"100000": 5}, "vocabulary"),
    ("logit_bias", {"abc": 5}, "token ids"),
    ("logit_bias", {"5": 101}, "logit_bias"),
    ("allowed_token_ids", [10**6], "vocabulary"),
    ("allowed_token_ids", [], "at least one"),
    ("bad_words", [" "], "bad_words"),
])
def test_bad_logits_fields_are_400(openai_server, field, value, words):
    url, _ = openai_server
    _assert_error(_post(url, "/v1/completions", {"prompt": "hi", field: value}), field, words)
    chat = {"messages": [{"role": "user", "content": "hi"}], field: value}
    _assert_error(_post(url, "/v1/chat/completions", chat), field, words)


# ---- truncate_prompt_tokens, cache_salt, seeds ------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_tokens(openai_server):
    url, engine = openai_server
    long_prompt = "x = 1\n" * 60
    ids = _tokens(url, long_prompt)
    assert len(ids) > engine.max_model_len
    _assert_error(_post(url, "/v1/completions", {"prompt": long_prompt}), "prompt", "max_model_len")
    kept = _post(url, "/v1/completions", {"prompt": long_prompt, "truncate_prompt_tokens": 5, "max_tokens": 2,
                                          "return_token_ids": True, "echo": True}).json()
    assert kept["usage"]["prompt_tokens"] == 5 and kept["choices"][0]["prompt_token_ids"] == ids[-5:]
    assert kept["choices"][0]["text"].startswith(engine.tokenizer.decode(ids[-5:]))
    fit = _post(url, "/v1/completions", {"prompt": long_prompt, "truncate_prompt_tokens": -1, "max_tokens": 4}).json()
    assert fit["usage"] == {"prompt_tokens": engine.max_model_len - 1, "completion_tokens": 1,
                            "total_tokens": engine.max_model_len}
    for bad in (0, -2):
        body = {"prompt": "hi", "truncate_prompt_tokens": bad}
        _assert_error(_post(url, "/v1/completions", body), "truncate_prompt_tokens")
    chat = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 1}
    _assert_error(_post(url, "/v1/chat/completions", chat), "messages", "max_model_len")
    fit = _post(url, "/v1/chat/completions", {**chat, "truncate_prompt_tokens": -1}).json()
    assert fit["usage"]["prompt_tokens"] == engine.max_model_len - 1


def test_truncation_side_right_keeps_the_first_tokens(openai_server):
    """vLLM's truncation_side: "right" keeps the prompt's first truncate_prompt_tokens tokens, "left" (the default)
    its last, on both routes; any other side is a 400 naming the field."""
    url, _ = openai_server
    long_prompt = "x = 1\n" * 60
    ids = _tokens(url, long_prompt)
    body = {"prompt": long_prompt, "truncate_prompt_tokens": 5, "max_tokens": 1, "return_token_ids": True}
    for side, kept in (("right", ids[:5]), ("left", ids[-5:])):
        choice = _post(url, "/v1/completions", {**body, "truncation_side": side}).json()["choices"][0]
        assert choice["prompt_token_ids"] == kept
    chat = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 1, "return_token_ids": True,
            "truncate_prompt_tokens": 4, "truncation_side": "right"}
    chat_ids = http_client.post(f"{url}/tokenize", json={"messages": chat["messages"]}).json()["tokens"]
    assert _post(url, "/v1/chat/completions", chat).json()["prompt_token_ids"] == chat_ids[:4]
    _assert_error(_post(url, "/v1/completions", {**body, "truncation_side": "middle"}), "truncation_side")


def test_cache_salt_must_be_a_non_empty_string(openai_server):
    url, _ = openai_server
    for salt in ("", 5):
        response = _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "cache_salt": salt})
        _assert_error(response, "cache_salt", "Parameter 'cache_salt' must be a non-empty string if provided.")
    assert _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "cache_salt": "s3cret"}).status_code == 200


def test_seeds_span_int64_and_nothing_more(openai_server):
    url, _ = openai_server
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 1.0}
    for seed in (INT64_MIN, -1, INT64_MAX):
        assert _post(url, "/v1/completions", {**body, "seed": seed}).status_code == 200
    for seed in (INT64_MIN - 1, INT64_MAX + 1, 2**70):
        _assert_error(_post(url, "/v1/completions", {**body, "seed": seed}), "seed")
        chat = {"messages": [{"role": "user", "content": "hi"}], "seed": seed}
        _assert_error(_post(url, "/v1/chat/completions", chat), "seed")


# ---- return_token_ids and usage options -------------------------------------------------------------


def test_return_token_ids_in_completions_streamed_and_not(openai_server):
    url, engine = openai_server
    body = {"prompt": "import os\n", "max_tokens": 5, "temperature": 0, "return_token_ids": True}
    choice = _post(url, "/v1/completions", body).json()["choices"][0]
    assert choice["prompt_token_ids"] == _tokens(url, "import os\n")
    assert len(choice["token_ids"]) == 5 and engine.tokenizer.decode(choice["token_ids"]) == choice["text"]
    chunks = _choices(_events(url, "/v1/completions", body))
    assert chunks[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    plain = _post(url, "/v1/completions", {**body, "return_token_ids": False}).json()["choices"][0]
    assert plain["prompt_token_ids"] is None and plain["token_ids"] is None


def test_return_token_ids_in_chat_streamed_and_not(openai_server):
    url, _ = openai_server
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "return_token_ids": True}
    response = _post(url, "/v1/chat/completions", body).json()
    ids = http_client.post(f"{url}/tokenize", json={"messages": body["messages"]}).json()["tokens"]
    assert response["prompt_token_ids"] == ids and len(response["choices"][0]["token_ids"]) == 4
    events = _events(url, "/v1/chat/completions", body)
    assert events[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in e for e in events[1:-1])
    assert [t for c in _choices(events) for t in c.get("token_ids", [])] == response["choices"][0]["token_ids"]


def test_stream_options_without_stream_is_400(openai_server):
    url, _ = openai_server
    options = {"stream_options": {"include_usage": True}}
    _assert_error(_post(url, "/v1/completions", {"prompt": "hi", **options}), "stream_options",
                  "Stream options can only be defined when `stream=True`.")
    chat = {"messages": [{"role": "user", "content": "hi"}], **options}
    _assert_error(_post(url, "/v1/chat/completions", chat), "stream_options", "stream=True")
    empty = _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "stream_options": {}})
    assert empty.status_code == 200, empty.text  # vLLM refuses only options that say something


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "import os\n", "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
], ids=["completions", "chat"])
def test_continuous_usage_stats_put_the_counts_in_every_chunk(openai_server, path, body):
    url, _ = openai_server
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = _events(url, path, {**body, "max_tokens": 5, "temperature": 0, "stream_options": options})
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    final = events[-2]["usage"]
    chunks = [e for e in events[:-2] if e["choices"]]
    assert chunks and all(e["usage"]["prompt_tokens"] == final["prompt_tokens"] for e in chunks)
    for index in range(body.get("n", 1)):
        counts = [e["usage"]["completion_tokens"] for e in chunks if e["choices"][0]["index"] == index]
        assert counts == sorted(counts) and counts[-1] == 5
    assert final["completion_tokens"] == 5 * body.get("n", 1)
    without = _events(url, path, {**body, "max_tokens": 2, "stream_options": {"include_usage": True}})
    assert without[-2]["usage"]["completion_tokens"] == 2 * body.get("n", 1)
    # as in vLLM: a completions chunk says "usage": null, a chat chunk leaves usage out
    null_usage = path == "/v1/completions"
    assert all(("usage" in e and e["usage"] is None) == null_usage for e in without[:-2])
    assert all("usage" not in e or e["usage"] is None for e in without[:-2])
    plain = _events(url, path, {**body, "max_tokens": 2, "stream_options": {"include_usage": False,
                                                                            "continuous_usage_stats": True}})
    assert plain[-1] == "[DONE]" and all(e["choices"] and not e.get("usage") for e in plain[:-1])


# ---- fields this server refuses ----------------------------------------------------------------------

REFUSED = [
    ("guided_decoding_backend", "xgrammar"),
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("logits_processors", ["my.Processor"]),
    ("suffix", "end"), ("prompt_embeds", "AAAA"),
    ("logprob_token_ids", [1, 2]),
]
# best_of and beam search exist on /v1/completions only (tests/test_best_of.py, tests/test_beam_search.py).
CHAT_REFUSED = [("best_of", 3), ("use_beam_search", True), ("length_penalty", 0.5)]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field,value", REFUSED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(REFUSED)])
def test_result_changing_fields_this_server_lacks_are_400(openai_server, path, field, value):
    url, _ = openai_server
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    _assert_error(_post(url, path, {**body, "max_tokens": 1, field: value}), field, "not supported")


@pytest.mark.parametrize("field,value", CHAT_REFUSED, ids=[f for f, _ in CHAT_REFUSED])
def test_completion_only_fields_are_400_on_chat(openai_server, field, value):
    url, _ = openai_server
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, field: value}
    _assert_error(_post(url, "/v1/chat/completions", body), field, "")


def test_neutral_values_of_refused_fields_and_unknown_fields_are_accepted(openai_server):
    url, _ = openai_server
    neutral = {"response_format": {"type": "text"}, "tool_choice": "none", "use_beam_search": False, "best_of": 2,
               "n": 2, "length_penalty": 1.0, "suffix": None, "guided_json": None, "tools": [],
               "some_future_field": {"x": 1}, "service_tier": "auto", "store": False}
    completions = _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "add_special_tokens": True,
                                                 **neutral})
    assert completions.status_code == 200, completions.text
    chat = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                               "add_special_tokens": False, **neutral})
    assert chat.status_code == 200, chat.text
    _assert_error(_post(url, "/v1/completions", {"prompt": "hi", "add_special_tokens": False}), "add_special_tokens")


# ---- chat echo ---------------------------------------------------------------------------------------


def test_chat_echo_prepends_the_last_message_of_the_reply_role(openai_server):
    url, _ = openai_server
    prefill = "def fib(n):"
    body = {"messages": [{"role": "user", "content": "Write fib."}, {"role": "assistant", "content": prefill}],
            "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 6, "temperature": 0}
    plain = _post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]
    echoed = _post(url, "/v1/chat/completions", {**body, "echo": True}).json()["choices"][0]["message"]
    assert echoed == {"role": "assistant", "content": prefill + plain["content"]}
    events = _events(url, "/v1/chat/completions", {**body, "echo": True})
    deltas = [c["delta"] for c in _choices(events)]
    assert deltas[0]["role"] == "assistant" and deltas[1] == {"content": prefill}
    assert "".join(d.get("content", "") for d in deltas) == echoed["content"]
    other_role = {**body, "messages": body["messages"][:1], "add_generation_prompt": True,
                  "continue_final_message": False, "echo": True}
    reply = _post(url, "/v1/chat/completions", other_role).json()["choices"][0]["message"]
    assert not reply["content"].startswith("Write fib.")  # the last message is the user's: nothing echoed


# ---- per-request engine errors ---------------------------------------------------------------------

MARKED = "def marked_for_failure():"


def _fail_submissions(error: Exception):
    """A patch under which the engine thread refuses requests whose prompt is MARKED with `error`, as a late
    per-request check (or a bug met by one request) would."""

    def patch(monkeypatch, engine) -> None:
        submit = engine.submit

        def refusing_submit(request_id, made):
            if made[0] == MARKED:
                raise error
            submit(request_id, made)

        monkeypatch.setattr(engine, "submit", refusing_submit)

    return patch


def _fail_outputs(monkeypatch, engine) -> None:
    """The engine fails requests whose prompt is MARKED at their end (RequestOutput.error, 'error')."""
    step = engine.step

    def failing_step():
        outputs = step()
        for output in outputs:
            if output.prompt == MARKED and output.finished:
                output.error = "the sampler produced no finite logits"
                for completion in output.outputs:
                    completion.finish_reason = "error"
        return outputs

    monkeypatch.setattr(engine, "step", failing_step)


@pytest.mark.parametrize("break_engine,param", [
    (_fail_submissions(ValueError("min_p cannot be honoured for this request")), "min_p"),
    (_fail_submissions(OverflowError("Python integer 2147483648 out of bounds for int32")), None),
    (_fail_outputs, None),
], ids=["value-error", "overflow-error", "error-output"])
def test_a_request_the_engine_fails_alone_is_400_and_the_server_goes_on(openai_server, monkeypatch, break_engine,
                                                                         param):
    url, engine = openai_server
    break_engine(monkeypatch, engine)
    response = _post(url, "/v1/completions", {"prompt": MARKED, "max_tokens": 3})
    assert response.status_code == 400, response.text
    assert "the engine failed this request" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == param
    events = _events(url, "/v1/completions", {"prompt": MARKED, "max_tokens": 3})
    assert "[DONE]" not in events
    assert events[-1]["error"]["code"] == 400 and "the engine failed" in events[-1]["error"]["message"]
    assert _post(url, "/v1/completions", {"prompt": "import os\n", "max_tokens": 3}).status_code == 200
    assert http_client.get(f"{url}/health").status_code == 200


# ---- generation defaults and usage options on a fake engine --------------------------------------------


class RecordingEngine(FakeEngine):
    """FakeEngine with generation defaults that records the SamplingParams of every request."""

    def __init__(self, generation_defaults: dict):
        super().__init__()
        self.requests.generation_defaults = generation_defaults
        self.params = []

    def make_requests(self, request_id, prompt, params, priority=0, tokenizer=None, cache_salt=None, lora_name=None):
        self.params.append(params)
        return super().make_requests(request_id, prompt, params, priority, tokenizer)


DEFAULTS = {"temperature": 0.25, "top_k": 5, "repetition_penalty": 1.2, "max_tokens": 3}


@pytest.fixture(scope="module")
def fake_server():
    """A server on a RecordingEngine, with --enable-force-include-usage and --enable-prompt-tokens-details."""
    engine = RecordingEngine(DEFAULTS)
    config = ServerConfig(enable_force_include_usage=True, enable_prompt_tokens_details=True)
    with running_server(build_app(engine, config)) as url:
        yield url, engine


def test_generation_defaults_fill_the_fields_a_request_leaves_unset(fake_server):
    url, engine = fake_server
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert _post(url, "/v1/chat/completions", chat).status_code == 200
    params = engine.params[-1]
    assert (params.temperature, params.top_k, params.repetition_penalty, params.max_tokens) == (0.25, 5, 1.2, 3)
    assert _post(url, "/v1/chat/completions",
                 {**chat, "temperature": 0.9, "top_k": 0, "max_tokens": 2}).status_code == 200
    params = engine.params[-1]
    assert (params.temperature, params.top_k, params.repetition_penalty, params.max_tokens) == (0.9, 0, 1.2, 2)
    assert _post(url, "/v1/completions", {"prompt": "hi"}).status_code == 200
    params = engine.params[-1]  # as in vLLM, completions keep OpenAI's max_tokens default of 16
    assert (params.temperature, params.top_k, params.max_tokens) == (0.25, 5, 16)


def test_the_applied_generation_defaults_are_logged_at_start_up(caplog):
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        build_app(RecordingEngine(DEFAULTS), ServerConfig())
        build_app(RecordingEngine({}), ServerConfig())
    lines = [r.getMessage() for r in caplog.records if "sampling defaults" in r.getMessage()]
    assert len(lines) == 2 and "'top_k': 5" in lines[0] and lines[1].endswith("none")


@pytest.mark.parametrize("options", [None, {"include_usage": False}, {"include_usage": True}])
def test_force_include_usage_and_prompt_tokens_details(fake_server, options):
    """--enable-force-include-usage, as vLLM's: the final usage chunk and the counts so far in every chunk, whatever
    stream_options say."""
    url, _ = fake_server
    extra = {} if options is None else {"stream_options": options}
    events = _events(url, "/v1/completions", {"prompt": "hi", "max_tokens": 3, **extra})
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert events[-2]["usage"] == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    counts = [e["usage"]["completion_tokens"] for e in events[:-2]]
    assert counts and counts == sorted(counts) and counts[-1] == 3
    chat = _events(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                 **extra})
    assert chat[-2]["usage"]["completion_tokens"] == 2
    counts = [e["usage"]["completion_tokens"] for e in chat[:-2]]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 2  # the role's chunk first
    usage = _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


# ---- request fields the server does not know ------------------------------------------------------------------------


def test_an_unknown_field_is_named_in_the_log_with_the_nearest_known_one(fake_server, caplog):
    url, _ = fake_server
    body = {"prompt": "hi", "temprature": 0.2, "metadata": {"team": "a"}, "user": "u1"}
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        assert _post(url, "/v1/completions", body).status_code == 200
    assert "request fields ignored (this server does not know them): temprature (did you mean temperature?)" \
        in caplog.text
    assert "metadata" not in caplog.text and "user" not in caplog.text  # OpenAI's, accepted on purpose


def test_reject_unknown_fields_answers_400_naming_the_field():
    config = ServerConfig(reject_unknown_fields=True)
    with running_server(build_app(FakeEngine(), config)) as url:
        response = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokns": 3})
        ok = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "user": "u1",
                                                 "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_tokns"
    assert error["message"] == "unknown request fields: max_tokns (did you mean max_tokens?)"
    assert ok.status_code == 200
