"""Bad input over raw HTTP: each gets the right status and an OpenAI-shaped error, and the server
stays healthy and keeps serving afterwards."""

import httpx
import pytest
from conftest import API_KEY
from helpers import http_client

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD = {"model": "tiny-stdlib-llama", "prompt": "import os\n", "max_tokens": 4}


def _post(url: str, path: str, body=None, content: bytes | None = None, headers: dict | None = None) -> httpx.Response:
    headers = AUTH if headers is None else headers
    if content is not None:
        return http_client.post(url + path, content=content, headers={**headers, "Content-Type": "application/json"})
    return http_client.post(url + path, json=body, headers=headers)


def _assert_openai_error(response: httpx.Response, status: int, param: str | None = None, words: str = "") -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert "code" in error and "param" in error
    if param is not None:
        assert error["param"] == param, error
    assert words.lower() in error["message"].lower(), error["message"]


BAD_COMPLETIONS = [
    pytest.param({**GOOD, "max_tokens": "many"}, "max_tokens", "max_tokens", id="max_tokens-string"),
    pytest.param({**GOOD, "prompt": {"text": "hi"}}, "prompt", "prompt", id="prompt-object"),
    pytest.param({**GOOD, "stop": 5}, "stop", "stop", id="stop-int"),
    pytest.param({key: value for key, value in GOOD.items() if key != "prompt"}, "prompt", "field required",
                 id="missing-prompt"),
    pytest.param({**GOOD, "temperature": -1}, "temperature", "temperature", id="negative-temperature"),
    pytest.param({**GOOD, "top_p": 1.5}, "top_p", "top_p", id="top_p-over-1"),
    pytest.param({**GOOD, "max_tokens": 0}, "max_tokens", "max_tokens", id="zero-max_tokens"),
    pytest.param({**GOOD, "n": 0}, "n", "n must be", id="zero-n"),
    pytest.param({**GOOD, "n": 5}, "n", "n must be", id="n-over-limit"),
    pytest.param({**GOOD, "logprobs": 21}, "logprobs", "logprobs", id="too-many-logprobs"),
    pytest.param({**GOOD, "presence_penalty": 3}, "presence_penalty", "presence_penalty", id="presence_penalty-range"),
    pytest.param({**GOOD, "prompt": ""}, "prompt", "empty", id="empty-prompt"),
    pytest.param({**GOOD, "prompt": [1, 2, 10**9]}, "prompt", "vocabulary", id="token-outside-vocabulary"),
    pytest.param({**GOOD, "prompt": "x " * 400}, "prompt", "max_model_len", id="prompt-over-max_model_len"),
    pytest.param({**GOOD, "prompt": ["a", "b", "c", "d", "e"]}, "prompt", "1 to 4", id="too-many-prompts"),
    pytest.param({**GOOD, "guided_json": {"type": "object"}}, "guided_json", "enable_structured_outputs off",
                 id="guided_json-on-an-engine-without-structured-output"),
    pytest.param({**GOOD, "response_format": {"type": "json_object"}}, "response_format",
                 "enable_structured_outputs off", id="response_format-on-an-engine-without-structured-output"),
    pytest.param({**GOOD, "logit_bias": {"5": 101}}, "logit_bias", "logit_bias", id="logit_bias-range"),
    pytest.param({**GOOD, "priority": 3}, "priority", "scheduling-policy", id="priority-under-fcfs"),
    pytest.param({**GOOD, "min_tokens": 9}, "min_tokens", "min_tokens", id="min_tokens-over-max_tokens"),
    pytest.param({**GOOD, "thinking_token_budget": -2}, "thinking_token_budget", "int >= 0",
                 id="negative-thinking_token_budget"),
    pytest.param({**GOOD, "thinking_token_budget": 8}, "thinking_token_budget", "reasoning_parser",
                 id="thinking_token_budget-without-a-reasoning-parser"),
]


@pytest.mark.parametrize("body,param,words", BAD_COMPLETIONS)
def test_bad_completion_requests_are_400(openai_server, body, param, words):
    url, _ = openai_server
    _assert_openai_error(_post(url, "/v1/completions", body), 400, param, words)


BAD_CHATS = [
    pytest.param({"messages": []}, "messages", "at least 1", id="no-messages"),
    pytest.param({"messages": [{"content": "hi"}]}, "messages.0.role", "field required", id="message-without-role"),
    pytest.param({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                 "messages.0.content", "", id="image-content"),
    pytest.param({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, None, "logprobs=true",
                 id="top_logprobs-without-logprobs"),
    pytest.param({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools.0",
                 "field required", id="tool-without-function"),
    pytest.param({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
        "name": "f"}}]}, "tool_choice", "--tool-call-parser", id="auto-tool-choice-without-a-parser"),
    pytest.param({"messages": [{"role": "user", "content": "hi"}], "guided_choice": ["a"]}, "guided_choice",
                 "enable_structured_outputs off", id="constraint-on-an-engine-without-structured-output"),
]


@pytest.mark.parametrize("body,param,words", BAD_CHATS)
def test_bad_chat_requests_are_400(openai_server, body, param, words):
    url, _ = openai_server
    response = _post(url, "/v1/chat/completions", body)
    _assert_openai_error(response, 400, None, words)
    if param is not None:
        assert response.json()["error"]["param"].startswith(param)


def test_a_body_that_is_not_a_json_object_is_400_saying_what_to_send(openai_server):
    url, _ = openai_server
    _assert_openai_error(_post(url, "/v1/completions", content=b'{"prompt": "hi", '), 400, None,
                         "the request body is not valid JSON: Expecting property name enclosed in double quotes at "
                         "character 17")
    _assert_openai_error(_post(url, "/v1/completions", content=b"[1, 2]"), 400, None,
                         "the request body must be a JSON object ({...}), got an array")
    _assert_openai_error(_post(url, "/v1/completions", content=b""), 400, None, "the request body is empty")
    form = http_client.post(url + "/v1/completions", data={"model": "tiny-stdlib-llama", "prompt": "hi"}, headers=AUTH)
    _assert_openai_error(form, 400, None, "must be a JSON object sent with Content-Type: application/json, not "
                         "application/x-www-form-urlencoded")


def test_unknown_model_is_404(openai_server):
    url, _ = openai_server
    _assert_openai_error(_post(url, "/v1/completions", {**GOOD, "model": "gpt-5"}), 404, "model", "gpt-5")
    body = {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}
    _assert_openai_error(_post(url, "/v1/chat/completions", body), 404, "model")


def test_missing_or_wrong_api_key_is_401_on_every_v1_route(openai_server):
    url, _ = openai_server
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        _assert_openai_error(_post(url, "/v1/completions", GOOD, headers=headers), 401, None, "API key")
        _assert_openai_error(http_client.get(f"{url}/v1/models", headers=headers), 401)
    assert http_client.get(f"{url}/health").status_code == 200  # not a /v1 route


def test_body_over_the_limit_is_413(openai_server):
    url, _ = openai_server
    response = _post(url, "/v1/completions", {**GOOD, "prompt": "x" * 100_000})
    _assert_openai_error(response, 413, None, "limit")


def test_unknown_route_and_wrong_method(openai_server):
    url, _ = openai_server
    _assert_openai_error(http_client.get(f"{url}/v1/engines", headers=AUTH), 404)
    _assert_openai_error(http_client.get(f"{url}/v1/completions", headers=AUTH), 405)


def test_server_stays_healthy_after_bad_input(openai_server):
    url, engine = openai_server
    for body in (b"{", b'{"prompt": 5}', b'{"prompt": "hi", "n": -1}'):
        assert _post(url, "/v1/completions", content=body).status_code == 400
    assert http_client.get(f"{url}/health").status_code == 200
    response = _post(url, "/v1/completions", GOOD)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]
