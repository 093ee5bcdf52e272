"""A client written against vLLM's OpenAI server works unchanged against `jaxserve serve`.

The server runs as a user would start it for a vLLM client (`--api-key`, `--metrics-prefix vllm`,
`--enable-server-load-tracking`, `--enable-tokenizer-info-endpoint`), and is driven by the official
`openai` client with vLLM's `extra_body` fields, by raw HTTP on vLLM's other routes, and read through
vLLM's metric names. What needs a model that knows something (a sensible answer) is not checked;
what each field does to the tokens is.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import yaml
from helpers import TEST_CACHE_DIR, http_client, small_engine_args

from jaxserve.engine.llm_engine import default_model_path

KEY = "vllm-client-key"
MODEL = "tiny-stdlib-llama"
PROMPT = "def fibonacci(n):"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://app.example"
VLLM_FLAGS = ["--api-key", KEY, "--metrics-prefix", "vllm", "--enable-server-load-tracking",
              "--enable-tokenizer-info-endpoint", "--allowed-origins", f'["{ORIGIN}"]']
TEMPLATE_MARK = "[custom template]\n"  # what the server's --chat-template writes before the bundled template's text


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, process: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + 240
    while True:
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        try:
            if http_client.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`jaxserve serve` with vLLM-style flags on the bundled model (the test session's shapes)."""
    folder = tmp_path_factory.mktemp("vllm_server")
    options = small_engine_args()
    options.pop("show_progress")
    config = folder / "engine.yaml"
    config.write_text(yaml.safe_dump(options))
    port = _free_port()
    log = folder / "serve.log"
    template = folder / "chat_template.jinja"
    with open(os.path.join(default_model_path(), "chat_template.jinja")) as f:
        template.write_text("{{ '" + TEMPLATE_MARK.replace("\n", "\\n") + "' }}" + f.read())
    command = [sys.executable, "-m", "jaxserve", "serve", "--config", str(config), "--port", str(port),
               "--compilation-cache-dir", TEST_CACHE_DIR, "--chat-template", str(template), *VLLM_FLAGS]
    with open(log, "w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process, log)
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        finally:
            process.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def prompt_ids(server) -> list[int]:
    return http_client.post(f"{server}/tokenize", json={"prompt": PROMPT}).json()["tokens"]


@pytest.fixture(scope="module")
def greedy(client) -> list[int]:
    """The greedy continuation's first 8 token ids, read with vLLM's `return_token_ids`."""
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    return response.choices[0].token_ids


def _completion(client, **extra_body):
    """A greedy 8-token completion of PROMPT with vLLM's `extra_body` fields."""
    body = {"return_token_ids": True, "ignore_eos": True, **extra_body}
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=body)


# ---- vLLM's sampling extras, through the openai client ---------------------------------------------


def test_neutral_vllm_extras_change_nothing_and_token_ids_come_back(client, greedy, prompt_ids):
    response = _completion(client, top_k=1, min_p=0.0, repetition_penalty=1.0, min_tokens=8,
                           skip_special_tokens=True, include_stop_str_in_output=False,
                           spaces_between_special_tokens=True)
    choice = response.choices[0]
    assert choice.token_ids == greedy and len(greedy) == 8
    assert choice.prompt_token_ids == prompt_ids
    assert response.usage.completion_tokens == 8 and response.usage.prompt_tokens == len(prompt_ids)


def test_stop_token_ids_end_the_output_at_that_token(client, greedy):
    stop = greedy[3]
    choice = _completion(client, stop_token_ids=[stop]).choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    assert choice.token_ids == greedy[:greedy.index(stop) + 1]


def test_min_tokens_holds_off_a_stop_token(client, greedy):
    stop = greedy[0]
    choice = _completion(client, stop_token_ids=[stop], min_tokens=4).choices[0]
    assert len(choice.token_ids) >= 4 and stop not in choice.token_ids[:4]


def test_logit_bias_forces_a_token(client, greedy):
    forced = greedy[0] + 1
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                         logit_bias={str(forced): 100},
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    assert response.choices[0].token_ids == [forced] * 4


def test_allowed_token_ids_keep_sampling_inside_the_set(client, greedy):
    allowed = sorted({greedy[0] + 1, greedy[1] + 2})
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3,
                                         extra_body={"allowed_token_ids": allowed, "return_token_ids": True,
                                                     "ignore_eos": True})
    assert len(response.choices[0].token_ids) == 6 and set(response.choices[0].token_ids) <= set(allowed)


def test_bad_words_are_never_generated(client, server, greedy):
    texts = [http_client.post(f"{server}/detokenize", json={"tokens": [t]}).json()["prompt"] for t in greedy]
    index = next(i for i, text in enumerate(texts) if text.strip().isidentifier())
    choice = _completion(client, bad_words=[texts[index].strip()]).choices[0]
    assert choice.token_ids[:index] == greedy[:index]
    assert greedy[index] not in choice.token_ids


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, prompt_ids):
    response = _completion(client, truncate_prompt_tokens=3)
    assert response.usage.prompt_tokens == 3 and response.choices[0].prompt_token_ids == prompt_ids[-3:]


def test_prompt_logprobs_in_vllm_shape(client, prompt_ids):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                         extra_body={"prompt_logprobs": 1})
    entries = response.choices[0].prompt_logprobs
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for token_id, entry in zip(prompt_ids[1:], entries[1:]):
        own = entry[str(token_id)]
        assert own["logprob"] <= 0.0 and own["rank"] >= 1
        assert 1 <= len(entry) <= 2 and min(e["rank"] for e in entry.values()) == 1


def test_chat_with_vllm_extras(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
        extra_body={"top_k": 5, "min_p": 0.0, "repetition_penalty": 1.1, "min_tokens": 5, "ignore_eos": True,
                    "skip_special_tokens": True, "include_stop_str_in_output": False, "return_token_ids": True,
                    "add_generation_prompt": True, "chat_template_kwargs": {}})
    assert len(response.choices[0].token_ids) == 5 and response.usage.completion_tokens == 5
    assert response.prompt_token_ids and response.usage.prompt_tokens == len(response.prompt_token_ids)


# ---- vLLM's routes ---------------------------------------------------------------------------------


def test_vllm_routes(server, client):
    assert http_client.get(f"{server}/health").status_code == 200
    assert http_client.get(f"{server}/ping").status_code == 200
    assert isinstance(http_client.get(f"{server}/version").json()["version"], str)
    assert [m.id for m in client.models.list().data] == [MODEL]
    tokens = http_client.post(f"{server}/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert set(tokens) == {"tokens", "token_strs", "count", "max_model_len"}
    text = http_client.post(f"{server}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith(PROMPT)
    info = http_client.get(f"{server}/tokenizer_info", headers=AUTH).json()
    assert info["tokenizer_class"] and info["eos_token"] == "</s>" and "messages" in info["chat_template"]
    # vLLM's shape: each added token by its id, as its text alone (vLLM keeps AddedToken.content only)
    assert info["added_tokens_decoder"] == {"0": "<s>", "1": "</s>", "2": "<pad>"}
    answer = http_client.post(f"{server}/invocations", headers=AUTH, json={"prompt": PROMPT, "max_tokens": 2}).json()
    assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] == 2


def test_chat_template_flag_replaces_the_tokenizers(server, client):
    messages = [{"role": "user", "content": "hi"}]
    tokens = http_client.post(f"{server}/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    text = http_client.post(f"{server}/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]
    assert text.startswith(TEMPLATE_MARK + "<|user|>\nhi")
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == len(tokens)  # the chat route renders with it too
    info = http_client.get(f"{server}/tokenizer_info", headers=AUTH).json()
    assert info["chat_template"].startswith("{{ '" + TEMPLATE_MARK.replace("\n", "\\n"))


def test_cors_lets_the_allowed_origin_in_only(server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    answer = http_client.options(f"{server}/v1/chat/completions", headers=preflight)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in answer.headers["access-control-allow-headers"].lower()
    refused = http_client.options(f"{server}/v1/chat/completions", headers={**preflight, "Origin": "https://elsewhere"})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    models = http_client.get(f"{server}/v1/models", headers={**AUTH, "Origin": ORIGIN})
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == ORIGIN
    unauthorized = http_client.get(f"{server}/v1/models", headers={"Origin": ORIGIN})
    assert unauthorized.status_code == 401 and unauthorized.headers["access-control-allow-origin"] == ORIGIN


def test_server_load_counts_requests_in_flight(server):
    """/load while one streamed request runs (polled from here, since the tiny model is quick) and after."""
    assert http_client.get(f"{server}/load").json() == {"server_load": 0}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "n": 4, "stream": True, "ignore_eos": True}
    seen = []

    def stream() -> None:
        with http_client.stream("POST", f"{server}/v1/completions", headers=AUTH, json=body, timeout=60) as response:
            seen.append(sum(1 for line in response.iter_lines() if line.startswith("data: ")))

    worker = threading.Thread(target=stream)
    with httpx.Client(base_url=server) as http:
        worker.start()
        loads = []
        while worker.is_alive():
            loads.append(http.get("/load").json()["server_load"])
        worker.join()
        assert seen and seen[0] > 100  # the stream ran to its end
        assert 1 in loads and set(loads) <= {0, 1}, loads
        deadline = time.monotonic() + 10  # the response may reach us a moment before the server closes it
        while http.get("/load").json()["server_load"] != 0:
            assert time.monotonic() < deadline, "the load did not go back to 0"
            time.sleep(0.05)


def test_vllm_error_codes(server, client):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="meta-llama/Llama-3.1-8B-Instruct", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"top_k": 2**31})
    assert "top_k" in str(error.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"guided_regex": "[0-9]+"})
    assert http_client.get(f"{server}/no/such/route").status_code == 404


VLLM_METRICS = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
    "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket", "vllm:request_inference_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_bucket", "vllm:request_decode_time_seconds_bucket",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket", "vllm:request_params_n_bucket",
    "vllm:request_params_max_tokens_bucket", "vllm:iteration_tokens_total_bucket", "vllm:cache_config_info",
]


def test_vllm_metric_names(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)  # something to count
    text = http_client.get(f"{server}/metrics").text
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    names = {line.split("{")[0].split(" ")[0] for line in samples}
    missing = [name for name in VLLM_METRICS if name not in names]
    assert not missing, missing
    assert not any(name.startswith("jaxserve:") for name in names)
    assert f'model_name="{MODEL}"' in next(line for line in samples if line.startswith("vllm:num_requests_running"))
