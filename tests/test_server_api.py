"""The HTTP server driven by the official `openai` client: completions and chat, streamed and not.

The server is a real uvicorn on a free localhost port (conftest's `openai_server`) serving the
bundled model; greedy text is checked against Hugging Face's recorded output for that model.
"""

import json
import os

import openai
import pytest
from conftest import API_KEY
from helpers import http_client

MODEL = "tiny-stdlib-llama"
EXPECTED = os.path.join(os.path.dirname(__file__), "fixtures", "default_model_expected.json")


@pytest.fixture(scope="module")
def client(openai_server):
    url, _ = openai_server
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)


def _streamed_completion(client, **request) -> tuple[dict[int, str], dict[int, str], object]:
    """Concatenated text and finish reason per choice index, and the usage of a streamed completion."""
    texts, reasons, usage = {}, {}, None
    for chunk in client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **request):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage


def _streamed_chat(client, **request) -> tuple[dict[int, str], dict[int, str], object]:
    texts, reasons, usage = {}, {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                                **request):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage


def test_greedy_completion_equals_hugging_face(client, openai_server):
    _, engine = openai_server
    with open(EXPECTED) as f:
        cases = json.load(f)["cases"]
    for case in cases[:3]:
        response = client.completions.create(model=MODEL, prompt=case["prompt"], max_tokens=32, temperature=0)
        choice = response.choices[0]
        assert choice.text == engine.tokenizer.decode(case["output_token_ids"])
        assert choice.finish_reason == "length"
        assert response.usage.completion_tokens == 32
        assert response.usage.prompt_tokens == len(case["prompt_token_ids"])


def test_token_id_prompts_and_several_prompts(client, openai_server):
    url, _ = openai_server
    single = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=8, temperature=0)
    ids = http_client.post(f"{url}/tokenize", json={"prompt": "import os\n"}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == single.choices[0].text
    both = client.completions.create(model=MODEL, prompt=["import os\n", "class A:"], max_tokens=8, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.choices[0].text == both.choices[1].text == single.choices[0].text  # greedy: n samples agree
    assert both.usage.completion_tokens == 32


def test_seeded_sampling_streamed_equals_not_streamed(client):
    request = dict(prompt="def parse(", max_tokens=24, temperature=0.9, top_p=0.95, seed=7, n=2)
    response = client.completions.create(model=MODEL, **request)
    texts, reasons, usage = _streamed_completion(client, **request)
    assert {c.index: c.text for c in response.choices} == texts
    assert {c.index: c.finish_reason for c in response.choices} == reasons
    assert usage.completion_tokens == response.usage.completion_tokens
    assert response.choices[0].text != response.choices[1].text  # seeds seed+0 and seed+1
    again = client.completions.create(model=MODEL, **request)
    assert [c.text for c in again.choices] == [c.text for c in response.choices]


def test_chat_streamed_equals_not_streamed(client):
    request = dict(messages=[{"role": "system", "content": "Write Python."},
                             {"role": "user", "content": [{"type": "text", "text": "a sort function"}]}],
                   max_completion_tokens=20, temperature=0.8, seed=3)
    response = client.chat.completions.create(model=MODEL, **request)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert response.usage.completion_tokens <= 20
    texts, reasons, usage = _streamed_chat(client, **request)
    assert texts == {0: choice.message.content}
    assert reasons == {0: choice.finish_reason}
    assert usage.total_tokens == response.usage.total_tokens


def test_stop_strings_hold_back_text_while_streaming(client):
    request = dict(prompt="def fibonacci(n):", max_tokens=48, temperature=0, stop=["    ", ">>>"])
    response = client.completions.create(model=MODEL, **request)
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and "    " not in choice.text and ">>>" not in choice.text
    texts, reasons, _ = _streamed_completion(client, **request)
    assert texts == {0: choice.text} and reasons == {0: "stop"}


def test_completion_logprobs(client):
    response = client.completions.create(model=MODEL, prompt="import sys\n", max_tokens=12, temperature=0, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == response.usage.completion_tokens == 12
    assert "".join(logprobs.tokens) == response.choices[0].text
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert top[token] == logprob == max(top.values())  # greedy picks the most likely token
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs(client):
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode() == entry.token


def test_models_version_tokenize_detokenize(openai_server, client):
    url, engine = openai_server
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert http_client.get(f"{url}/version").json()["version"]
    tokens = http_client.post(f"{url}/tokenize", json={"prompt": "print('hi')"}).json()
    assert tokens["tokens"] == engine.tokenizer.encode("print('hi')") and tokens["count"] == len(tokens["tokens"])
    text = http_client.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == engine.tokenizer.decode(tokens["tokens"]) and text.endswith("print('hi')")
    chat = http_client.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 1
