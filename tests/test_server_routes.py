"""vLLM's further routes on the shared test server (default flags): /tokenize's options, /detokenize's
checks, vLLM's batched chat, SageMaker's /invocations and /ping, /load, and /tokenizer_info being off unless
enabled.

The flag-enabled side (/load counting, /tokenizer_info's content) runs against `jaxserve serve` in
tests/test_vllm_client.py.
"""

import json

import httpx
import pytest
from conftest import API_KEY
from helpers import http_client

MODEL = "tiny-stdlib-llama"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def f(x):"}]
BOS = 0  # the bundled tokenizer's <s>


def _assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """The response is `status` with OpenAI's error body (naming `param` when given); returns the error."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and "code" in error and "param" in error
    if param is not None:
        assert error["param"] == param, error
    return error


def _tokenize(url: str, **body) -> dict:
    response = http_client.post(f"{url}/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()


# ---- /tokenize -----------------------------------------------------------------------------------


def test_tokenize_prompt_adds_special_tokens_unless_told_not_to(openai_server):
    url, engine = openai_server
    default = _tokenize(url, prompt="import os")
    plain = _tokenize(url, prompt="import os", add_special_tokens=False)
    assert default["tokens"] == engine.tokenizer.encode("import os") and default["tokens"][0] == BOS
    assert plain["tokens"] == default["tokens"][1:]
    assert default["count"] == len(default["tokens"]) and default["max_model_len"] == engine.max_model_len
    assert default["token_strs"] is None  # vLLM's shape: the key is there, null unless asked for


def test_tokenize_messages_are_the_prompt_the_chat_route_runs(openai_server):
    url, _ = openai_server
    messages = MESSAGES[:1]
    tokens = _tokenize(url, messages=messages)["tokens"]
    assert tokens[0] != BOS  # vLLM's default for messages: the template's own special tokens only
    chat = http_client.post(f"{url}/v1/chat/completions", headers=AUTH,
                            json={"model": MODEL, "messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(tokens)
    with_special = _tokenize(url, messages=messages, add_special_tokens=True)["tokens"]
    assert with_special == [BOS, *tokens]


def test_tokenize_continue_final_message_leaves_the_last_message_open(openai_server):
    url, _ = openai_server
    closed = _tokenize(url, messages=MESSAGES, add_generation_prompt=False)["tokens"]
    open_ = _tokenize(url, messages=MESSAGES, add_generation_prompt=False, continue_final_message=True)["tokens"]
    assert len(open_) < len(closed) and closed[:len(open_)] == open_
    text = http_client.post(f"{url}/detokenize", json={"tokens": open_}).json()["prompt"]
    assert text.endswith("def f(x):")
    with_prompt = _tokenize(url, messages=MESSAGES)["tokens"]
    assert len(with_prompt) > len(closed)  # add_generation_prompt (the default) appends the assistant header
    both = http_client.post(f"{url}/tokenize", json={"messages": MESSAGES, "continue_final_message": True,
                                                     "add_generation_prompt": True})
    _assert_openai_error(both, 400, "messages")


def test_tokenize_passes_chat_template_kwargs_to_the_template(openai_server):
    url, _ = openai_server
    plain = _tokenize(url, messages=MESSAGES[:1])["tokens"]
    assert _tokenize(url, messages=MESSAGES[:1], chat_template_kwargs={"enable_thinking": False})["tokens"] == plain
    # A keyword the render already sets reaches the template call and is refused there: a 400, not a 500.
    clash = http_client.post(f"{url}/tokenize",
                             json={"messages": MESSAGES[:1], "chat_template_kwargs": {"tokenize": True}})
    _assert_openai_error(clash, 400, "messages")


def test_tokenize_return_token_strs(openai_server):
    url, engine = openai_server
    answer = _tokenize(url, prompt="def f(x):", return_token_strs=True)
    assert answer["token_strs"] == engine.tokenizer.convert_ids_to_tokens(answer["tokens"])
    assert answer["token_strs"][0] == "<s>" and len(answer["token_strs"]) == answer["count"]
    chat = _tokenize(url, messages=MESSAGES[:1], return_token_strs=True)
    assert len(chat["token_strs"]) == chat["count"] and chat["token_strs"][0] != "<s>"


@pytest.mark.parametrize("body,param", [
    pytest.param({}, "prompt", id="neither"),
    pytest.param({"prompt": "x", "messages": MESSAGES}, "prompt", id="both"),
    pytest.param({"messages": MESSAGES, "chat_template": "{{ messages }}"}, "chat_template", id="chat_template"),
    pytest.param({"prompt": [1, 2]}, "prompt", id="token-ids"),
    pytest.param({"prompt": "x", "model": "gpt-4"}, "model", id="unknown-model"),
])
def test_bad_tokenize_requests(openai_server, body, param):
    url, _ = openai_server
    status = 404 if param == "model" else 400
    _assert_openai_error(http_client.post(f"{url}/tokenize", json=body), status, param)


# ---- /detokenize ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [[-1], [10**9], [2**63], [1, 2, 2**31]], ids=str)
def test_detokenize_ids_outside_the_vocabulary_are_400(openai_server, tokens):
    url, _ = openai_server
    error = _assert_openai_error(http_client.post(f"{url}/detokenize", json={"tokens": tokens}), 400, "tokens")
    assert "vocabulary" in error["message"]


def test_detokenize_non_integer_ids_are_400(openai_server):
    url, _ = openai_server
    for tokens in ([1.5], ["a"], 5, None):
        _assert_openai_error(http_client.post(f"{url}/detokenize", json={"tokens": tokens}), 400)
    assert http_client.post(f"{url}/detokenize", json={"tokens": []}).json() == {"prompt": ""}


# ---- /v1/chat/completions/batch (vLLM's) ---------------------------------------------------------


def test_batch_chat_answers_each_conversation_as_its_own_chat(openai_server):
    url, _ = openai_server
    conversations = [MESSAGES[:1], [{"role": "user", "content": "import"}]]
    body = {"model": MODEL, "max_tokens": 5, "temperature": 0}
    answer = http_client.post(f"{url}/v1/chat/completions/batch", headers=AUTH,
                              json={**body, "messages": conversations})
    assert answer.status_code == 200, answer.text
    batch = answer.json()
    assert batch["object"] == "chat.completion" and [c["index"] for c in batch["choices"]] == [0, 1]
    singles = [http_client.post(f"{url}/v1/chat/completions", headers=AUTH, json={**body, "messages": m}).json()
               for m in conversations]
    assert [c["message"] for c in batch["choices"]] == [s["choices"][0]["message"] for s in singles]
    for key in ("prompt_tokens", "completion_tokens"):
        assert batch["usage"][key] == sum(s["usage"][key] for s in singles)


@pytest.mark.parametrize("extra,param", [
    ({"stream": True}, "stream"), ({"n": 2}, "n"), ({"use_beam_search": True}, "use_beam_search"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": [MESSAGES[:1], []]}, "messages.1"), ({"messages": []}, "messages"),
    ({"messages": [MESSAGES[:1]] * 5}, "messages"),  # the test server's --max-prompts is 4
], ids=["stream", "n", "beam-search", "tools", "empty-conversation", "no-conversation", "too-many"])
def test_batch_chat_refusals_name_the_field(openai_server, extra, param):
    url, _ = openai_server
    body = {"messages": [MESSAGES[:1]], "max_tokens": 2, **extra}
    _assert_openai_error(http_client.post(f"{url}/v1/chat/completions/batch", headers=AUTH, json=body), 400, param)


# ---- /invocations (SageMaker), /ping, /load, /tokenizer_info --------------------------------------


def test_invocations_with_messages_is_a_chat_completion(openai_server):
    url, _ = openai_server
    body = {"model": MODEL, "messages": MESSAGES[:1], "max_tokens": 6, "temperature": 0}
    direct = http_client.post(f"{url}/v1/chat/completions", headers=AUTH, json=body).json()
    answer = http_client.post(f"{url}/invocations", headers=AUTH, json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["object"] == "chat.completion"
    assert answer.json()["choices"][0]["message"] == direct["choices"][0]["message"]


def test_invocations_with_prompt_is_a_completion_streamed_or_not(openai_server):
    url, _ = openai_server
    body = {"prompt": "import os\n", "max_tokens": 6, "temperature": 0}
    direct = http_client.post(f"{url}/v1/completions", headers=AUTH, json=body).json()
    answer = http_client.post(f"{url}/invocations", headers=AUTH, json=body).json()
    assert answer["object"] == "text_completion" and answer["choices"][0]["text"] == direct["choices"][0]["text"]
    with http_client.stream("POST", f"{url}/invocations", headers=AUTH, json={**body, "stream": True}) as streamed:
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(choice["text"] for event in events[:-1] for choice in json.loads(event)["choices"])
    assert text == direct["choices"][0]["text"]


@pytest.mark.parametrize("content,param", [
    pytest.param(json.dumps({"max_tokens": 4}), None, id="neither-prompt-nor-messages"),
    pytest.param(json.dumps([{"prompt": "x"}]), None, id="not-an-object"),
    pytest.param("{not json", None, id="not-json"),
    pytest.param(json.dumps({"messages": MESSAGES, "temperature": "hot"}), "temperature", id="bad-chat-field"),
    pytest.param(json.dumps({"prompt": "x", "max_tokens": -3}), "max_tokens", id="bad-completion-field"),
    pytest.param(json.dumps({"prompt": "x", "model": "gpt-4"}), "model", id="unknown-model"),
])
def test_bad_invocations_are_openai_errors(openai_server, content, param):
    url, _ = openai_server
    response = http_client.post(f"{url}/invocations", headers={**AUTH, "Content-Type": "application/json"},
                                content=content)
    _assert_openai_error(response, 404 if param == "model" else 400, param)


def test_invocations_needs_the_api_key_when_one_is_set(openai_server):
    url, _ = openai_server
    response = http_client.post(f"{url}/invocations", json={"prompt": "x", "max_tokens": 2})
    _assert_openai_error(response, 401)


def test_runtime_lora_routes_are_off_unless_allowed(openai_server):
    url, _ = openai_server
    body = {"lora_name": "x", "lora_path": "/nowhere"}
    assert http_client.post(f"{url}/v1/load_lora_adapter", headers=AUTH, json=body).status_code == 404
    assert http_client.post(f"{url}/v1/unload_lora_adapter", headers=AUTH, json=body).status_code == 404


def test_no_cors_headers_unless_origins_are_allowed(openai_server):
    url, _ = openai_server
    answer = http_client.get(f"{url}/health", headers={"Origin": "https://app.example"})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_ping_is_health(openai_server):
    url, _ = openai_server
    assert http_client.get(f"{url}/ping").status_code == 200
    assert http_client.post(f"{url}/ping").status_code == 200


def test_load_is_zero_without_tracking_and_tokenizer_info_is_off(openai_server):
    url, _ = openai_server
    assert http_client.get(f"{url}/load").json() == {"server_load": 0}
    _assert_openai_error(http_client.get(f"{url}/tokenizer_info", headers=AUTH), 404)
