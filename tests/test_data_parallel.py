"""Data-parallel replicas (`data_parallel_size: 2`) behind one server, in this process over two of the simulated
CPU devices: the same tokens as one replica, the load split evenly on a uniform workload, requests sharing a
prefix kept on one replica, and the engine metrics per replica; and the same replicas as engine-core processes."""

import concurrent.futures

import jax
import pytest
from helpers import http_client, running_server, small_engine_args
from prometheus_client.parser import text_string_to_metric_families

from jaxserve import LLM, SamplingParams
from jaxserve.cli import main
from jaxserve.config import EngineConfig
from jaxserve.engine.core_client import EngineCoreClient
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.replicas import ROUTED_PREFIX_PAGES, DataParallelEngine, ReplicaRouter
from jaxserve.server.app import build_app
from jaxserve.server.config import ServerConfig

PROMPTS = [f"def function_{i}(value):\n    return" for i in range(16)]
GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def server():
    options = small_engine_args()
    options.pop("show_progress")
    engine = LLMEngine(EngineConfig.for_model(None, data_parallel_size=2, **options), show_progress=False)
    app = build_app(engine, ServerConfig(served_model_name="tiny"))
    with running_server(app) as url:
        yield url, app.state.async_engine


def _complete(url: str, prompt: str, **fields) -> dict:
    body = {"model": "tiny", "prompt": prompt, "return_token_ids": True, **GREEDY, **fields}
    response = http_client.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _engine_metrics(url: str) -> dict[tuple[str, str], float]:
    """(metric sample name, replica) -> value, for the samples that carry a replica label."""
    text = http_client.get(f"{url}/metrics", timeout=30).text
    return {(sample.name, sample.labels["replica"]): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if "replica" in sample.labels}


def test_replicas_run_on_disjoint_devices(server):
    _, front = server
    meshes = [replica.engine.core.mesh.devices.tolist() for replica in front.replicas]
    assert meshes == [[jax.devices()[0]], [jax.devices()[1]]]
    pools = [replica.engine.core.runner.kv_caches[0] for replica in front.replicas]
    assert [pool.sharding.device_set for pool in pools] == [{jax.devices()[0]}, {jax.devices()[1]}]


def test_replicas_give_one_replicas_tokens_and_share_the_load(server):
    url, _ = server
    options = small_engine_args()
    one = LLM(**options).generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    before = _engine_metrics(url)
    # one request of 16 prompts: all are routed before any finishes, so the uniform load splits evenly (separate
    # concurrent requests would split by how fast each replica drains, as least-outstanding routing should)
    body = {"model": "tiny", "prompt": PROMPTS, "return_token_ids": True, **GREEDY}
    response = http_client.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda choice: choice["index"])
    assert [choice["token_ids"] for choice in choices] == [o.outputs[0].token_ids for o in one]
    after = _engine_metrics(url)
    moved = {replica: after[("jaxserve:generation_tokens_total", replica)]
             - before.get(("jaxserve:generation_tokens_total", replica), 0) for replica in ("0", "1")}
    assert sum(moved.values()) == len(PROMPTS) * GREEDY["max_tokens"]
    assert abs(moved["0"] - moved["1"]) <= 0.1 * max(moved.values()), moved  # within 10 %
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # and concurrent single requests: the same tokens
        singles = list(pool.map(lambda prompt: _complete(url, prompt), PROMPTS[:4]))
    assert [choice["token_ids"] for choice in singles] == [o.outputs[0].token_ids for o in one[:4]]


def test_replicas_in_engine_core_processes_give_the_same_tokens_and_share_the_load(server):
    """`jaxserve serve`'s default layout: each replica an engine-core process over its own device."""
    url, _ = server
    options = small_engine_args()
    options.pop("show_progress")
    clients = EngineCoreClient.launch_replicas(EngineConfig.for_model(None, data_parallel_size=2, **options), 2)
    with running_server(build_app(DataParallelEngine(clients), ServerConfig(served_model_name="tiny"))) as core_url:
        body = {"model": "tiny", "prompt": PROMPTS, "return_token_ids": True, **GREEDY}
        answers = [http_client.post(f"{each}/v1/completions", json=body, timeout=120) for each in (url, core_url)]
        assert [a.status_code for a in answers] == [200, 200], answers[1].text
        in_process, in_cores = (sorted(a.json()["choices"], key=lambda c: c["index"]) for a in answers)
        assert [c["token_ids"] for c in in_cores] == [c["token_ids"] for c in in_process]
        metrics = _engine_metrics(core_url)
        moved = [metrics[("jaxserve:generation_tokens_total", replica)] for replica in ("0", "1")]
        assert sum(moved) == len(PROMPTS) * GREEDY["max_tokens"] and min(moved) > 0, moved
    assert not any(client.process.is_alive() for client in clients)  # the app's shutdown stopped each core


def test_metrics_carry_each_replicas_engine_state(server):
    url, _ = server
    _complete(url, "import os")
    metrics = _engine_metrics(url)
    for name in ("jaxserve:num_requests_running", "jaxserve:num_requests_waiting", "jaxserve:kv_cache_usage_perc",
                 "jaxserve:prompt_tokens_total", "jaxserve:prefix_cache_queries_total"):
        assert {(name, "0"), (name, "1")} <= set(metrics), name
    assert metrics[("jaxserve:num_requests_running", "0")] == metrics[("jaxserve:num_requests_running", "1")] == 0
    assert metrics[("jaxserve:kv_cache_usage_perc", "0")] == metrics[("jaxserve:kv_cache_usage_perc", "1")] == 0


def test_requests_sharing_a_prefix_go_where_it_is_cached(server):
    url, _ = server
    prefix = "class Shared:\n    def method(self, value):\n        return value * 2\n" * 3
    before = _engine_metrics(url)
    for i in range(4):
        _complete(url, prefix + f"# {i}", max_tokens=2)
    after = _engine_metrics(url)
    hits = {replica: after[("jaxserve:prefix_cache_hits_total", replica)]
            - before[("jaxserve:prefix_cache_hits_total", replica)] for replica in ("0", "1")}
    # the first request computes the prefix on one replica; the other three find it there
    assert min(hits.values()) == 0 and max(hits.values()) > 0, hits
    response = http_client.post(f"{url}/reset_prefix_cache", timeout=30)
    assert response.status_code == 200


# ---- the router on its own ----------------------------------------------------------------------------------------


def test_router_takes_the_least_outstanding_replica_and_forgets_finished_requests():
    router = ReplicaRouter(3, page_size=4)
    picks = [router.route([i, i + 1], cost=10) for i in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]
    router.finished(1, 10)
    router.finished(1, 10)
    assert router.route([99], cost=5) == 1
    assert router.outstanding == [20, 5, 20]


def test_router_keeps_a_prefix_on_its_replica_unless_that_one_is_too_busy():
    router = ReplicaRouter(2, page_size=4)
    shared = list(range(12))  # three whole pages: 12 tokens a replica that saw them need not compute
    # replica 0 takes the prefix, then keeps it while its extra load (5, then 10) is under the 12 it saves;
    # at 15 outstanding the idle replica wins
    assert [router.route(shared + [100 + i], cost=5) for i in range(4)] == [0, 0, 0, 1]
    assert (router.cached_tokens(0, router.page_hashes(shared))
            == router.cached_tokens(1, router.page_hashes(shared)) == 12)
    assert router.route(list(range(50, 62)), cost=5) == 1  # no prefix anywhere: the least outstanding (5 < 15)


def test_router_follows_the_prefix_caches_salts():
    router = ReplicaRouter(2, page_size=4)
    shared = list(range(12))
    router.route(shared, cost=5, cache_salt="team-a")
    assert router.cached_tokens(0, router.page_hashes(shared, "team-a")) == 12
    assert router.cached_tokens(0, router.page_hashes(shared, "team-b")) == 0  # salts never share pages
    assert router.cached_tokens(0, router.page_hashes(shared)) == 0


def test_router_hashes_only_whole_pages_up_to_its_limit():
    router = ReplicaRouter(2, page_size=4)
    assert len(router.page_hashes(list(range(7)))) == 1
    assert len(router.page_hashes(list(range(4 * (ROUTED_PREFIX_PAGES + 5))))) == ROUTED_PREFIX_PAGES
    assert router.page_hashes([1, 2, 3, 4, 5, 6, 7, 8])[1] != router.page_hashes([9, 9, 9, 9, 5, 6, 7, 8])[1]


def test_offline_data_parallel_is_refused_with_the_way_to_do_it():
    with pytest.raises(ValueError, match="jaxserve serve.*the offline LLM runs one engine"):
        LLM(data_parallel_size=2)


def test_more_replicas_than_devices_is_a_clear_error_before_loading():
    config = EngineConfig.for_model(None, data_parallel_size=3, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size 3 x tensor_parallel_size 2 needs 6 devices, but 4"):
        LLMEngine(config, show_progress=False)


def test_generate_refuses_replicas_it_would_not_run(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "hi", "--data-parallel-size", "2"])
    assert exit_info.value.code == 2
    assert "`jaxserve generate` runs one engine" in capsys.readouterr().err
