"""The engine in an engine-core process of its own (engine/core_process.py), the server over its client
(engine/core_client.py): the same outputs as the engine in the server's process, a client that leaves gives its pages
back, calls between steps keep their errors; several front ends (`--api-server-count`) share the port and the core,
one that dies is replaced while its requests are aborted in the core, and a core that dies fails what runs and stops
the server (a server that dies takes its core with it: tests/test_cli_serve.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from unittest import mock

import httpx
import msgspec
import numpy as np
import pytest
import yaml

from benchmarks.disconnect_soak import child_processes, running
from jaxserve.config import EngineConfig
from jaxserve.engine import core_client
from jaxserve.engine.async_engine import EngineDeadError, EngineOverloadedError
from jaxserve.engine.core_client import EngineCoreClient
from jaxserve.engine.core_messages import DeltaCursor, NewRequest, SampleDelta, apply_delta
from jaxserve.engine.host_gc import CPYTHON_FIRST_THRESHOLD, ENGINE_FIRST_THRESHOLD
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.pooling.pooled import PER_TOKEN, PooledPrompt
from jaxserve.request import Logprob, Request, RequestStatus
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.server.app import build_app
from jaxserve.server.config import ServerConfig
from tests.helpers import FAST_COMPILE_XLA_FLAG, TEST_CACHE_DIR, http_client, running_server, small_engine_args

MODEL = "tiny-stdlib-llama"


def _config() -> EngineConfig:
    options = small_engine_args(skip_precompile=True)
    options.pop("show_progress")
    return EngineConfig.for_model(None, **options)


# What the front end's client did to its garbage collector: the first-generation threshold it left, and how many
# times it froze the objects its start-up left (the freeze itself: tests/test_host_gc.py)
FRONT_END_GC: dict[str, int] = {}


@pytest.fixture(scope="module")
def servers():
    """(the URL of a server over an engine-core process, its client, the URL of one over the same engine in
    process)."""
    gc.set_threshold(CPYTHON_FIRST_THRESHOLD, *gc.get_threshold()[1:])  # a fresh front end's process: CPython's
    with mock.patch.object(core_client, "freeze_start_up_objects") as freeze:
        client = EngineCoreClient.launch(_config())
    FRONT_END_GC.update(threshold=gc.get_threshold()[0], freezes=freeze.call_count)
    with running_server(build_app(client, ServerConfig())) as core_url:
        with running_server(build_app(LLMEngine(_config(), show_progress=False), ServerConfig())) as thread_url:
            yield core_url, client, thread_url
    assert not client.process.is_alive()  # the app's shutdown stopped it


REQUESTS = [
    ("/v1/completions", {"prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0, "logprobs": 2,
                         "echo": True}),
    ("/v1/completions", {"prompt": "import os\n", "max_tokens": 10, "temperature": 0.8, "seed": 7, "n": 2,
                         "prompt_logprobs": 1}),
    ("/v1/completions", {"prompt": "class Stack:", "max_tokens": 8, "temperature": 0.9, "seed": 3, "best_of": 3}),
    ("/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 40, "temperature": 0, "stop": ["\n\n", "return"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Sort a list"}], "max_tokens": 10,
                              "temperature": 0, "logprobs": True, "top_logprobs": 2}),
]


def _choices(url: str, route: str, body: dict) -> list:
    response = http_client.post(f"{url}{route}", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"]


def test_a_front_end_tunes_its_garbage_collector(servers):
    """Its outputs allocate per token as an engine's steps do: CPython's defaults cost the front end a third of its
    time at 512 streams (engine/host_gc.py)."""
    assert FRONT_END_GC == {"threshold": ENGINE_FIRST_THRESHOLD, "freezes": 1}


@pytest.mark.parametrize("route, body", REQUESTS)
def test_outputs_equal_the_engine_in_the_servers_process(servers, route, body):
    core_url, _, thread_url = servers
    assert _choices(core_url, route, body) == _choices(thread_url, route, body)


def _streamed_text(url: str, body: dict) -> str:
    text = ""
    with http_client.stream("POST", f"{url}/v1/completions", json={"model": MODEL, "stream": True, **body},
                            timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_a_stream_equals_the_whole_reply(servers):
    core_url, _, thread_url = servers
    body = {"prompt": "def parse(line):", "max_tokens": 24, "temperature": 0, "stop": [")\n"]}
    assert _streamed_text(core_url, body) == _streamed_text(thread_url, body) == _choices(
        core_url, "/v1/completions", body)[0]["text"]


def _settled(client: EngineCoreClient, timeout_s: float = 10.0) -> dict:
    """The core's counters once nothing runs or waits."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        idle = stats["num_requests_running"] == stats["num_requests_waiting"] == 0
        if idle and stats["kv_pages_free"] == stats["kv_pages_total"] or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def test_a_client_that_leaves_aborts_its_request_in_the_core_and_its_pages_come_back(servers):
    core_url, client, _ = servers
    body = {"model": MODEL, "prompt": "def soak(x):", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with http_client.stream("POST", f"{core_url}/v1/completions", json=body, timeout=60) as response:
        chunks = response.iter_lines()
        while not next(chunks).startswith("data: {"):
            pass
    stats = _settled(client)
    assert stats["num_requests_running"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["generation_tokens"] > 0


def test_calls_between_steps_keep_their_results_and_errors(servers):
    core_url, client, _ = servers
    assert http_client.post(f"{core_url}/reset_prefix_cache").status_code == 200

    async def remove_unknown_adapter():
        await client.remove_lora("nope")

    with pytest.raises(ValueError, match="no LoRA adapter .nope. is loaded"):
        asyncio.run_coroutine_threadsafe(remove_unknown_adapter(), client._loop).result(timeout=30)
    assert client.is_running


def test_the_live_pages_pool_map_comes_from_the_core_through_a_call(servers):
    core_url, _, thread_url = servers
    for url in (core_url, thread_url):
        kv = http_client.get(f"{url}/dashboard/data", timeout=30).json()["kv"]
        assert sum(run for _, run in kv["runs"]) == kv["pages_total"]
        free = sum(run for state, run in kv["runs"] if kv["states"][state] in ("free", "cached"))
        assert free == kv["pages_free"], "idle: no page is held"


def _scraped(url: str, name: str) -> float:
    """One sample's value from a server's /metrics."""
    return next(float(line.split()[-1]) for line in http_client.get(f"{url}/metrics", timeout=30).text.splitlines()
                if line.startswith(name + "{"))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_metrics_count_every_tokens_gap_though_outputs_are_built_when_read(servers, stream):
    """The front end builds a running request's output only when its reader reads (never before the end, for a reply
    sent whole); each step's move still reaches the inter-token metrics."""
    core_url, _, _ = servers
    name = "jaxserve:inter_token_latency_seconds_count"
    before = _scraped(core_url, name)
    body = {"model": MODEL, "prompt": "def gaps(x):", "max_tokens": 9, "ignore_eos": True, "stream": stream}
    response = http_client.post(f"{core_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert _scraped(core_url, name) - before == 8  # 9 tokens, 8 gaps


def test_back_pressure_counts_the_requests_the_core_has_not_started(servers):
    core_url, client, _ = servers
    with pytest.raises(EngineOverloadedError, match="retry later"):
        client.check_capacity(client.max_waiting_requests + 1)
    limit, client.max_waiting_requests = client.max_waiting_requests, 0  # every request now waits too many
    try:
        response = http_client.post(f"{core_url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    finally:
        client.max_waiting_requests = limit
    assert response.status_code == 503 and response.headers["retry-after"] == "1", response.text


async def _read_all(stream) -> None:
    async for _ in stream:
        pass


@pytest.mark.parametrize("broken", ["send", "read"])
def test_a_send_or_a_read_that_fails_ends_what_runs_and_calls_on_dead(broken):
    """A send to the core that fails (the process out of file descriptors, say), or an error while applying the core's
    messages, must not leave requests waiting for outputs that never come: they end with EngineDeadError, the client
    stops running and `on_dead` runs once (before: a request waiting forever)."""
    client = EngineCoreClient.launch(_config())
    dead = []
    client.on_dead = dead.append

    async def submit_while_broken() -> None:
        client.start()
        if broken == "send":
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(OSError(24, "Too many open files"))
            breaking = mock.patch.object(client._socket, "send", return_value=failed)
            reason = r"could not be sent \(OSError\(24, 'Too many open files'\)\)"
        else:
            breaking = mock.patch.object(client._output_processor, "advance", side_effect=RuntimeError("a bug"))
            reason = r"reading the engine core's messages failed \(RuntimeError\('a bug'\)\)"
        with breaking:
            stream = client.submit("r", client.make_requests("r", "def f(x):", SamplingParams(max_tokens=4)))
            with pytest.raises(EngineDeadError, match=reason):
                await asyncio.wait_for(_read_all(stream), 60)
        assert not client.is_running
        await client.stop()

    asyncio.run(submit_while_broken())
    assert len(dead) == 1 and isinstance(dead[0], EngineDeadError)
    assert not client.process.is_alive()  # stop() still shut the core down


def test_a_request_the_core_refuses_fails_alone(servers):
    """The core builds each request again from what the front end checked; one it refuses (here an adapter the
    front end does not know of, past the server's model check) ends with an error and the engine goes on."""
    _, client, _ = servers

    async def submit_unknown_adapter():
        made = client.make_requests("refused", "def f():", SamplingParams(max_tokens=4), lora_name="nope")
        async for _ in client.submit("refused", made):
            pass

    with pytest.raises(ValueError, match="nope"):
        asyncio.run_coroutine_threadsafe(submit_unknown_adapter(), client._loop).result(timeout=30)
    assert client.is_running and _settled(client)["kv_pages_free"] == client.stats()["kv_pages_total"]


# ---- the messages' own round trip ---------------------------------------------------------------------------------


def _request(**fields) -> Request:
    return Request(request_id="r", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(logprobs=1),
                   eos_token_ids=(0,), seed=0, max_tokens=8, **fields)


@pytest.mark.parametrize("pooling_type", ["MEAN", PER_TOKEN])
def test_deltas_bring_a_front_end_copy_level_with_the_cores_sample(pooling_type):
    core = _request(prompt_logprobs=[None], pooled=PooledPrompt(pooling_type, True, None))
    copy = _request(prompt_logprobs=[None], pooled=PooledPrompt(pooling_type, True, None))
    cursor = DeltaCursor()
    core.output_token_ids += [5, 6]
    core.output_logprobs += [{5: Logprob(-0.5, 1), 9: Logprob(-1.5, 2)}, {6: Logprob(-0.25, 1)}]
    core.prompt_logprobs += [{2: Logprob(-2.0, 3)}]
    core.pooled.add(np.arange(8, dtype=np.float32).reshape(2, 4), 2)
    apply_delta(copy, _round_trip(cursor.delta(core)))
    core.output_token_ids.append(7)
    core.output_logprobs.append({7: Logprob(-0.125, 1)})
    core.prompt_logprobs.append({3: Logprob(-1.0, 1)})
    core.pooled.add(np.ones((1, 4), np.float32), 1)
    core.status, core.stop_reason, core.num_cached_tokens = RequestStatus.FINISHED_STOPPED, 7, 16
    apply_delta(copy, _round_trip(cursor.delta(core)))
    for field in ("output_token_ids", "output_logprobs", "prompt_logprobs", "status", "stop_reason",
                  "num_cached_tokens"):
        assert getattr(copy, field) == getattr(core, field), field
    assert copy.pooled.num_pooled == 3
    if pooling_type == PER_TOKEN:
        assert copy.pooled.token_data() == core.pooled.token_data()
    else:
        assert copy.pooled.embedding() == core.pooled.embedding()


def test_a_new_request_keeps_every_sampling_option_through_the_channel():
    params = SamplingParams(n=2, temperature=0.5, stop=["x"], logit_bias={3: 1.5}, seed=7,
                            output_kind=RequestOutputKind.DELTA)
    sent = NewRequest("r", [1, 2, 3], params, None, "generate", 1, "salt", None)
    received = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=NewRequest)
    assert received == sent and received.params.output_kind is RequestOutputKind.DELTA


def _round_trip(delta: SampleDelta) -> SampleDelta:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(delta), type=SampleDelta)


# ---- failures, through `jaxserve serve` ---------------------------------------------------------------------------


def _serve(tmp_path, name: str, *flags: str) -> tuple[subprocess.Popen, str, str]:
    """A `jaxserve serve` of the test shapes, its engine in a core process, with `flags`; (the process, its URL, its
    log path)."""
    options = small_engine_args()
    options.pop("show_progress")
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(options))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path / f"{name}.log"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_COMPILE_XLA_FLAG}
    with open(log, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "jaxserve", "serve", "--config", str(config), "--port",
                                    str(port), "--compilation-cache-dir", TEST_CACHE_DIR, "--skip-precompile", *flags],
                                   stdout=log_file, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        try:
            if http_client.get(f"{url}/health").status_code == 200:
                return process, url, log
        except httpx.TransportError:
            time.sleep(0.2)


def _core_pid(server: subprocess.Popen) -> int:
    """The engine core's process id: the server's child named so."""
    for pid in child_processes(server.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"multiprocessing.resource_tracker" not in f.read():
                return pid
    raise AssertionError("the server has no engine core process")


def _wait_for_line(log, text: str, server: subprocess.Popen, timeout_s: float = 60) -> None:
    """Wait until the server's log has `text`."""
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert server.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def _kill_the_core_mid_stream(server: subprocess.Popen, url: str, log) -> None:
    """Kill the engine core while a request streams: the stream ends with an error event, /health answers 503
    within a second, and the server exits with status 1 saying why."""
    core = _core_pid(server)
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with http_client.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        os.kill(core, signal.SIGKILL)
        killed = time.monotonic()
        while http_client.get(f"{url}/health").status_code != 503:
            assert time.monotonic() - killed < 1.0, "/health still answers 200 a second after the core died"
            time.sleep(0.02)
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and "engine core process died" in events[-2], events[-3:]
    assert server.wait(timeout=30) == 1
    assert "jaxserve serve: the engine core process died (exit code -9)" in log.read_text()


def _metric(url: str, name: str) -> float:
    """The sum of a metric's samples on /metrics."""
    text = http_client.get(f"{url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"jaxserve:{name}"))


def _stream_until_done_or_broken(url: str, body: dict) -> bool:
    """Stream a completion to its end; False when its connection broke first."""
    try:
        with http_client.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            return any(line == "data: [DONE]" for line in response.iter_lines())
    except httpx.TransportError:
        return False


def test_front_ends_share_the_port_and_the_cores_one_that_dies_is_replaced_and_a_dead_core_stops_them(tmp_path):
    server, url, log = _serve(tmp_path, "front_ends", "--api-server-count", "2")
    try:
        first = [int(line.rsplit(" ", 2)[1]) for line in log.read_text().splitlines()
                 if "front end process" in line and line.endswith("started")]
        assert len(first) == 1, log.read_text()
        _wait_for_line(log, f"Started server process [{first[0]}]", server)  # the second front end serves too
        body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
        answers = [http_client.post(f"{url}/v1/completions", json=body, timeout=60) for _ in range(8)]
        assert [a.status_code for a in answers] == [200] * 8
        assert len({a.json()["choices"][0]["text"] for a in answers}) == 1
        # every scrape, whichever front end answers it, counts the requests of both
        assert [_metric(url, "request_success_total") for _ in range(4)] == [8.0] * 4
        long = {"model": MODEL, "prompt": "def g(x):", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with concurrent.futures.ThreadPoolExecutor(10) as pool:  # (on the one that lives: all but 1 in 1024 times)
            streams = [pool.submit(_stream_until_done_or_broken, url, long) for _ in range(10)]
            time.sleep(0.5)
            os.kill(first[0], signal.SIGKILL)
            ended = [stream.result(timeout=60) for stream in streams]
        assert any(ended), "no stream was on the front end that lived"
        if not all(ended):  # some were on the one that died: the core aborted them
            _wait_for_line(log, f"front end front-end-{first[0]} has gone;", server)
        deadline = time.monotonic() + 20
        while _metric(url, "num_requests_running") or _metric(url, "kv_cache_usage_perc"):
            assert time.monotonic() < deadline, "the dead front end's requests still run in the core"
            time.sleep(0.1)
        while "starting another" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert http_client.get(f"{url}/health").status_code == 200
        assert all(http_client.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
                   for _ in range(4))
        children = child_processes(server.pid)
        _kill_the_core_mid_stream(server, url, log)
    finally:
        server.kill()
    assert not any(running(pid) for pid in children), log.read_text()  # the front ends went with the server
