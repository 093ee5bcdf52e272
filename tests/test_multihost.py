"""Multi-host serving on the CPU: two processes of two simulated devices each form one tensor-parallel mesh of 4
(JAX's distributed runtime, gloo collectives). Their greedy tokens equal one process's at TP 4 and at TP 1, offline
and through the server on the leader; a follower killed mid-request turns the leader's /health to 503 within
seconds and the leader exits non-zero (bounded); bad launch arguments are clear errors."""

import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from multihost_worker import ENGINE, GREEDY, SAMPLED

from jaxserve import LLM, SamplingParams
from jaxserve.cli import _engine_config, build_parser
from jaxserve.config import EngineConfig
from jaxserve.distributed import runtime
from helpers import checkpoint, expected, http_client, perturbed_checkpoint, pythonpath_without_torch

TESTS = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(TESTS, "multihost_worker.py")
START_TIMEOUT_S = 400  # both processes compile the buckets they use (a follower never reads the leader's cache)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Launch:
    """The two worker processes; the leader's OFFLINE line, parsed."""

    def __init__(self, log_dir, new_weights: str):
        coordinator, self.http_port = f"127.0.0.1:{_free_port()}", _free_port()
        # the tests' folder (helpers, the worker's imports) and this checkout's root (its jaxserve, not an install's)
        env = {**os.environ, "PYTHONPATH": pythonpath_without_torch(TESTS, os.path.dirname(TESTS)),
               "JAXSERVE_TEST_NEW_WEIGHTS": new_weights}
        self.logs = [open(log_dir / f"process{i}.log", "w+") for i in range(2)]
        self.processes = [subprocess.Popen([sys.executable, WORKER, coordinator, str(i), str(self.http_port)],
                                           env=env, stdout=subprocess.PIPE if i == 0 else self.logs[i],
                                           stderr=self.logs[i], text=True) for i in range(2)]
        self.offline = None  # the leader's OFFLINE line, parsed (wait_offline)
        self.one_process = None  # one process's tokens at TP 4 and TP 1 (the fixture)

    def wait_offline(self) -> None:
        """Wait for the leader's OFFLINE line (both processes built, the offline run done)."""
        import json

        line = self._leader_line("OFFLINE ", START_TIMEOUT_S)
        self.offline = json.loads(line[len("OFFLINE "):])

    def _leader_line(self, prefix: str, timeout_s: float) -> str:
        found: list[str] = []

        def read() -> None:
            for line in self.processes[0].stdout:
                if line.startswith(prefix):
                    found.append(line)
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not found:
            raise AssertionError(f"the leader printed no {prefix!r} line; logs:\n{self.log_tail()}")
        return found[0]

    def log_tail(self) -> str:
        tails = []
        for log in self.logs:
            log.flush()
            log.seek(0)
            tails.append(log.read()[-3000:])
        return "\n---\n".join(tails)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)
        for log in self.logs:
            log.close()


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """The two-process launch, and one process's tokens at TP 4 and TP 1 computed here while it starts."""
    new_weights = str(tmp_path_factory.mktemp("new-weights"))
    perturbed_checkpoint("llama", new_weights)
    launch = Launch(tmp_path_factory.mktemp("multihost"), new_weights)
    try:
        launch.one_process = _one_process_outputs(new_weights)
        launch.wait_offline()
        yield launch
    finally:
        launch.close()


def _one_process_outputs(new_weights: str) -> dict:
    """Greedy and sampled tokens of one process at TP 4 and at TP 1, on the same engine options; at TP 1 the
    greedy tokens after an update to `new_weights` too."""
    prompts = expected("llama")["prompts"]
    outputs = {}
    for tp in (4, 1):
        llm = LLM(checkpoint("llama"), tensor_parallel_size=tp, **ENGINE)
        greedy = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
        sampled = llm.generate(prompts[:4], SamplingParams(**SAMPLED), use_tqdm=False)
        outputs[tp] = {"greedy": [o.outputs[0].token_ids for o in greedy],
                       "sampled": [o.outputs[0].token_ids for o in sampled]}
    llm.update_weights(new_weights)
    outputs[1]["updated"] = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(**GREEDY),
                                                                          use_tqdm=False)]
    return outputs


def test_offline_tokens_equal_one_process_at_tp4_and_tp1(launch):
    one_process = launch.one_process
    assert launch.offline["greedy"] == one_process[4]["greedy"] == one_process[1]["greedy"] == \
        expected("llama")["outputs"]
    assert launch.offline["sampled"] == one_process[4]["sampled"]  # the same keys and the same mesh: same draws


def test_a_weight_update_reaches_every_process(launch):
    """update_weights(folder) is mirrored: each process reads its shards of the new weights."""
    assert launch.offline["updated"] == launch.one_process[1]["updated"] != launch.offline["greedy"]


def _wait_healthy(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if http_client.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the leader's server did not come up")


def test_server_on_the_leader_gives_the_same_tokens(launch):
    _wait_healthy(launch.url)
    want = expected("llama")
    body = {"model": "llama", "prompt": want["prompts"], "return_token_ids": True, **GREEDY}
    response = http_client.post(f"{launch.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda choice: choice["index"])
    assert [choice["token_ids"] for choice in choices] == want["outputs"]


def test_a_lost_follower_makes_the_leader_unhealthy_and_exit(launch):
    _wait_healthy(launch.url)
    # the longest reply the engine takes (max_model_len 96): the follower dies while it streams, after its first
    # token (a kill before the request reached the server would test a refused connection instead)
    body = {"model": "llama", "prompt": [1, 2, 3], "max_tokens": 90, "ignore_eos": True, "stream": True}
    events: list[str] = []
    streaming, failures = threading.Event(), []

    def stream() -> None:
        try:
            with http_client.stream("POST", f"{launch.url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        events.append(line)
                        streaming.set()
        except httpx.HTTPError as error:  # the leader's exit may cut the connection after the error event
            failures.append(repr(error))
        streaming.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert streaming.wait(timeout=60) and events, f"the stream never started: {failures}\n{launch.log_tail()}"
    launch.processes[1].kill()
    killed = time.monotonic()
    status = None
    while time.monotonic() - killed < 10 and status != 503:
        try:
            status = http_client.get(f"{launch.url}/health", timeout=2).status_code
        except httpx.HTTPError:
            status = None
        time.sleep(0.05)
    assert status == 503, f"/health never turned 503 after the follower died\n{launch.log_tail()}"
    unhealthy_after = time.monotonic() - killed
    leader = launch.processes[0]
    assert leader.wait(timeout=30) != 0, "the leader must exit non-zero when a follower is lost"
    reader.join(timeout=10)
    assert unhealthy_after < 5
    # the stream ends with a 503 error event: the lost-peer hook's ("the multi-host launch broke: follower 1 is
    # gone") or, when the engine loop's own call to the lost follower fails first, the engine loop's
    seen = "\n".join(events[-3:]) + f"\n{failures}\n{launch.log_tail()}"
    assert not any('"finish_reason":"length"' in event.replace(" ", "") for event in events), seen
    errors = [event for event in events if '"error"' in event]
    assert errors and ("multi-host launch broke" in errors[-1] or "engine failed" in errors[-1]), seen


# ---- launch arguments -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options,message", [
    (dict(distributed_coordinator="127.0.0.1:1234", num_processes=2, process_id=2), "process_id must be in"),
    (dict(distributed_coordinator="127.0.0.1:1234", num_processes=2, process_id=-1), "process_id must be in"),
    (dict(num_processes=2), "needs distributed_coordinator"),
    (dict(distributed_coordinator="nohostport", num_processes=2), "must be HOST:PORT"),
    (dict(distributed_coordinator="127.0.0.1:1234"), "num_processes is 1"),
    (dict(distributed_coordinator="127.0.0.1:1234", num_processes=2, data_parallel_size=2), "one multi-host engine"),
    (dict(distributed_coordinator="127.0.0.1:1234", num_processes=2, preemption_mode="swap"), "by recompute"),
    (dict(num_processes=0), "num_processes must be an integer >= 1"),
    (dict(data_parallel_size=0), "data_parallel_size must be an integer >= 1"),
])
def test_inconsistent_launch_arguments_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_the_command_line_flags_reach_the_config():
    args = build_parser().parse_args(["serve", "--distributed-coordinator", "10.0.0.1:8476", "--num-processes", "4",
                                      "--process-id", "3", "--distributed-timeout-s", "90", "--tensor-parallel-size",
                                      "8"])
    config = _engine_config(args)
    parallel = config.parallel_config
    assert (parallel.distributed_coordinator, parallel.num_processes, parallel.process_id) == ("10.0.0.1:8476", 4, 3)
    assert config.parallel_config.distributed_timeout_s == 90


def test_a_mesh_must_span_every_process_equally():
    group = runtime.ProcessGroup(process_id=0, num_processes=1, coordinator_host="127.0.0.1")
    with pytest.raises(ValueError, match="tensor_parallel_size must be 4"):
        runtime.check_mesh_spans_processes(3, group)
    with pytest.raises(ValueError, match="not 4 each"):
        runtime.check_mesh_spans_processes(4, runtime.ProcessGroup(0, 2, "127.0.0.1"))


def test_an_unreachable_coordinator_is_a_clear_error():
    started = time.monotonic()
    with pytest.raises(ValueError, match="cannot reach the coordinator at 127.0.0.1:.* within 1 s"):
        runtime.join(f"127.0.0.1:{_free_port()}", num_processes=2, process_id=1, timeout_s=1)
    assert time.monotonic() - started < 10


def test_a_process_that_never_comes_ends_the_leader_with_a_message():
    code = ("import sys; from jaxserve.distributed import runtime; "
            "runtime.join(sys.argv[1], num_processes=2, process_id=0, timeout_s=2)")
    result = subprocess.run([sys.executable, "-c", code, f"127.0.0.1:{_free_port()}"], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == runtime.EXIT_START_FAILED, result.stderr[-2000:]
    assert "did not all join the coordinator" in result.stderr
