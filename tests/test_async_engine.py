"""AsyncLLMEngine and the server around it, over a fake engine that needs no compilation: streaming,
no spinning when idle, abort on close, back-pressure (503 + Retry-After), and engine failure."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from helpers import engine_stats, http_client, running_server

from jaxserve.config import EngineConfig
from jaxserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError
from jaxserve.engine.llm_engine import default_model_path
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.app import build_app
from jaxserve.server.config import ServerConfig


class FakeEngine:
    """LLMEngine's surface as the async engine and the server use it; every running request gets one
    token per step. `gate` (set by default) holds steps back; `fail` makes the next step raise."""

    def __init__(self):
        self.config = EngineConfig(page_size=16, enable_prefix_caching=False)
        self.model_path = default_model_path()
        self.max_model_len = 128
        self.core = SimpleNamespace(spec=SimpleNamespace(vocab_size=4096, classifier=None), num_pages=11,
                                    runner=SimpleNamespace(cache_dtype=np.dtype("float32")),
                                    kv=SimpleNamespace(host_pool=None))
        self.requests = SimpleNamespace(  # the RequestMaker's facts; no reasoning parser
            facts=SimpleNamespace(max_model_len=128, vocab_size=4096, classifier=None), reasoning=None,
            generation_defaults={})
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False
        self.steps = 0
        self.running: dict[str, list[int]] = {}  # request id -> [max tokens, tokens so far]
        self.aborted: list[str] = []
        self.completed: list[str] = []

    def make_requests(self, request_id, prompt, params, priority=0, tokenizer=None, cache_salt=None, lora_name=None):
        return prompt, [SimpleNamespace(sampling_params=params)]  # (text, the samples: engine requests' stand-ins)

    def on_peer_lost(self, callback):
        pass  # one process: no peer to lose

    def list_loras(self):
        return {}

    def submit(self, request_id, made):
        max_tokens = made[1][0].sampling_params.max_tokens
        if max_tokens == 13:
            raise ValueError("unlucky request")
        self.running[request_id] = [max_tokens, 0]

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        if self.running.pop(request_id, None) is None:
            return None
        return self._output(request_id, 0, "abort")

    def has_unfinished_requests(self):
        return bool(self.running)

    def is_sleeping(self):
        return False

    def step(self):
        self.gate.wait()
        if self.fail:
            raise RuntimeError("device lost")
        self.steps += 1
        outputs = []
        for request_id, state in list(self.running.items()):
            state[1] += 1
            finished = state[1] >= state[0]
            outputs.append(self._output(request_id, state[1], "length" if finished else None))
            if finished:
                del self.running[request_id]
                self.completed.append(request_id)
        return outputs

    def stats(self):
        return engine_stats(num_requests_running=len(self.running), steps=self.steps)

    @staticmethod
    def _output(request_id, num_tokens, finish_reason):
        completion = CompletionOutput(0, "x" * num_tokens, [7] * num_tokens, None, None, finish_reason)
        return RequestOutput(request_id, None, [1], [completion], finish_reason is not None, RequestMetrics(0.0))


def _submit(engine: AsyncLLMEngine, request_id: str, max_tokens: int = 5):
    return engine.submit(request_id, engine.make_requests(request_id, "hi", SamplingParams(max_tokens=max_tokens)))


async def _wait_for(condition, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _poll_until(condition, timeout_s: float = 10.0):
    """Block (outside any event loop) until `condition()` holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_outputs_stream_until_finished_and_the_idle_loop_does_not_spin():
    async def run():
        fake = FakeEngine()
        engine = AsyncLLMEngine(fake)
        engine.start()
        outputs = [output async for output in _submit(engine, "a", max_tokens=6)]
        assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == [7] * 6
        assert all(not o.finished for o in outputs[:-1])
        steps = fake.steps
        await asyncio.sleep(0.3)
        assert fake.steps == steps == 6 and engine.is_running  # blocked on its queue, not stepping
        await engine.stop()
        assert not engine.is_running

    asyncio.run(run())


def test_closing_a_stream_aborts_its_request():
    async def run():
        fake = FakeEngine()
        engine = AsyncLLMEngine(fake)
        engine.start()
        stream = _submit(engine, "a", max_tokens=10**9)  # (1000 could all be stepped before the abort, under load)
        await stream.__anext__()
        stream.close()
        await _wait_for(lambda: fake.aborted == ["a"])
        assert not fake.running
        await engine.stop()

    asyncio.run(run())


def test_a_request_the_engine_refuses_fails_alone():
    async def run():
        engine = AsyncLLMEngine(FakeEngine())
        engine.start()
        with pytest.raises(ValueError, match="unlucky"):
            async for _ in _submit(engine, "bad", max_tokens=13):
                pass
        assert [o async for o in _submit(engine, "good", max_tokens=3)][-1].finished and engine.is_running
        await engine.stop()

    asyncio.run(run())


def test_too_many_waiting_requests_overload_until_they_start():
    async def run():
        fake = FakeEngine()
        fake.gate.clear()
        engine = AsyncLLMEngine(fake, max_waiting_requests=2)
        engine.start()
        streams = [_submit(engine, "a"), _submit(engine, "b")]
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests=2"):
            engine.check_capacity()
        fake.gate.set()
        for stream in streams:
            assert [o async for o in stream][-1].finished
        engine.check_capacity(2)
        await engine.stop()

    asyncio.run(run())


def test_a_failing_engine_ends_every_request_with_an_error():
    async def run():
        fake = FakeEngine()
        fake.gate.clear()
        engine = AsyncLLMEngine(fake)
        engine.start()
        streams = [_submit(engine, "a"), _submit(engine, "b")]
        fake.fail = True
        fake.gate.set()
        for stream in streams:
            with pytest.raises(EngineDeadError, match="device lost"):
                async for _ in stream:
                    pass
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            engine.check_capacity()

    asyncio.run(run())


def test_http_back_pressure_is_503_with_retry_after():
    fake = FakeEngine()
    fake.gate.clear()
    app = build_app(fake, ServerConfig(max_waiting_requests=2, retry_after_s=3))
    with running_server(app) as url, ThreadPoolExecutor(2) as pool:
        body = {"prompt": "hi", "max_tokens": 3}
        waiting = [pool.submit(http_client.post, f"{url}/v1/completions", json=body, timeout=30) for _ in range(2)]
        _poll_until(lambda: app.state.async_engine.stats()["num_requests_unstarted"] == 2)
        response = http_client.post(f"{url}/v1/completions", json=body)
        assert response.status_code == 503 and response.headers["Retry-After"] == "3"
        assert "retry later" in response.json()["error"]["message"]
        fake.gate.set()
        assert [f.result().status_code for f in waiting] == [200, 200]
        assert http_client.post(f"{url}/v1/completions", json=body).status_code == 200


def test_http_engine_failure_turns_health_503_and_fails_requests():
    fake = FakeEngine()
    fake.gate.clear()
    with running_server(build_app(fake, ServerConfig())) as url, ThreadPoolExecutor(1) as pool:
        assert http_client.get(f"{url}/health").status_code == 200
        pending = pool.submit(http_client.post, f"{url}/v1/completions", json={"prompt": "hi"}, timeout=30)
        _poll_until(lambda: fake.running)
        fake.fail = True
        fake.gate.set()
        response = pending.result()
        assert response.status_code == 503 and "device lost" in response.json()["error"]["message"]
        assert http_client.get(f"{url}/health").status_code == 503
        assert http_client.post(f"{url}/v1/completions", json={"prompt": "hi"}).status_code == 503


def test_http_client_leaving_a_non_streamed_request_aborts_it():
    fake = FakeEngine()
    fake.gate.clear()
    with running_server(build_app(fake, ServerConfig())) as url:
        with pytest.raises(httpx.ReadTimeout):
            http_client.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 50}, timeout=0.5)
        time.sleep(0.2)  # the server notices the disconnect and queues the abort
        fake.gate.set()  # the step in progress ends; then the abort applies
        _poll_until(lambda: fake.aborted)
        assert len(fake.aborted) == 1 and not fake.running and not fake.completed
