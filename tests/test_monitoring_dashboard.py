"""deploy/monitoring/: the Grafana dashboard is well-formed, and every metric and label its queries name is on a
running server's /metrics for both metric prefixes (jaxserve and vllm), so the dashboard cannot drift from what
the server exports; Prometheus runs every query against a server; the Prometheus config scrapes that /metrics, and
the compose file mounts files that exist."""

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import API_KEY
from helpers import http_client, running_server, small_engine_args
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.bench.online import free_port

MONITORING = Path(__file__).parent.parent / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "jaxserve-dashboard.json"
PREFIXES = ("jaxserve", "vllm")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range"}
TARGET_LABELS = {"instance", "job"}  # added by Prometheus when it scrapes


def _dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def _graph_panels(dashboard: dict) -> list[dict]:
    """Every panel but the rows, those inside collapsed rows included."""
    panels = []
    for panel in dashboard["panels"]:
        panels.extend(panel.get("panels", []) if panel["type"] == "row" else [panel])
    return panels


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    queries = [(panel["title"], target["expr"]) for panel in _graph_panels(dashboard) for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            queries.append((f"variable {variable['name']}", query["query"] if isinstance(query, dict) else query))
    return queries


def _metric_names(expr: str, prefix: str) -> set[str]:
    """The metric names `expr` reads once Grafana puts `prefix` in for `${prefix}`: what a selector names, without
    its functions, label matchers and ranges."""
    return set(re.findall(rf"(?<![\w:]){prefix}:[A-Za-z_][\w:]*", expr.replace("${prefix}", prefix)))


def _label_names(expr: str) -> set[str]:
    """The labels `expr` groups, matches or joins on."""
    expr = expr.replace("${prefix}", "prefix")
    labels = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        labels.update(name.strip() for name in group.split(",") if name.strip())
    for matchers in re.findall(r"\{([^{}]*)\}", expr):
        labels.update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
    return labels


@pytest.fixture(scope="module")
def vllm_server():
    """A second server, as `jaxserve serve --metrics-prefix vllm --api-key test-key` runs it, on an engine that
    compiles each step shape when it first needs it."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.server.app import build_app
    from jaxserve.server.config import ServerConfig

    options = small_engine_args(min_token_bucket=16, skip_precompile=True)
    options.pop("show_progress")
    engine = LLMEngine(EngineConfig.for_model(None, **options), show_progress=False)
    with running_server(build_app(engine, ServerConfig(api_key=API_KEY, metrics_prefix="vllm"))) as url:
        yield url


@pytest.fixture(scope="module", params=PREFIXES)
def exposition(request) -> tuple[str, dict[str, set[str]]]:
    """(prefix, {sample name: its label names}) of a running server's /metrics after it finished a completion,
    as Prometheus reads it: scraped without the API key."""
    prefix = request.param
    url = request.getfixturevalue("openai_server")[0] if prefix == "jaxserve" else request.getfixturevalue(
        "vllm_server")
    body = {"prompt": "def add(a, b):", "max_tokens": 4}
    response = http_client.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                                timeout=120)
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 30
    while True:  # until the finished request is counted (request_success_total has a sample from then on)
        response = http_client.get(f"{url}/metrics")
        assert response.status_code == 200, "/metrics must answer without the API key (prometheus.yml says so)"
        samples: dict[str, set[str]] = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                samples.setdefault(sample.name, set()).update(sample.labels)
        if f"{prefix}:request_success_total" in samples or time.monotonic() > deadline:
            return prefix, samples
        time.sleep(0.05)


def test_dashboard_is_well_formed():
    dashboard = _dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    ids = [panel["id"] for panel in dashboard["panels"]] + [
        child["id"] for panel in dashboard["panels"] for child in panel.get("panels", [])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        columns, rows = range(grid["x"], grid["x"] + grid["w"]), range(grid["y"], grid["y"] + grid["h"])
        cell = {(x, y) for x in columns for y in rows}
        assert not cells & cell, f"{panel['title']} overlaps another panel"
        cells |= cell

    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    prefix = variables["prefix"]
    assert prefix["type"] == "custom" and tuple(option["value"] for option in prefix["options"]) == PREFIXES
    assert tuple(value.strip() for value in prefix["query"].split(",")) == PREFIXES
    assert prefix["current"]["value"] == "jaxserve"  # the server's default --metrics-prefix
    assert variables["model_name"]["datasource"] == DATASOURCE

    panels = _graph_panels(dashboard)
    assert panels
    for panel in panels:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
    for where, expr in _queries(dashboard):
        assert _metric_names(expr, "prefix"), f"{where}: no ${{prefix}}: metric in {expr}"
        assert not re.search(r"\b(jaxserve|vllm):", expr), f"{where}: a metric without ${{prefix}}: {expr}"
        for name in re.findall(r"\$\{?(\w+)", expr):
            assert name in variables or name in GRAFANA_VARIABLES, f"{where}: undefined variable ${name}"


def test_every_metric_and_label_the_dashboard_queries_is_exported(exposition):
    prefix, samples = exposition
    dashboard = _dashboard()
    legends = {(panel["title"], target["expr"]): target.get("legendFormat", "")
               for panel in _graph_panels(dashboard) for target in panel["targets"]}
    missing = {}  # (an ordered set)
    for where, expr in _queries(dashboard):
        names = _metric_names(expr, prefix)
        missing.update(dict.fromkeys(f"{where}: metric {name}" for name in sorted(names - samples.keys())))
        if names and names <= samples.keys():
            labels = set().union(TARGET_LABELS, *(samples[name] for name in names))
            used = _label_names(expr) | set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legends.get((where, expr), "")))
            missing.update(dict.fromkeys(f"{where}: label {label} of {sorted(names)}"
                                         for label in sorted(used - labels)))
    assert not missing, f"the dashboard reads what /metrics (prefix {prefix}) does not export:\n" + "\n".join(missing)


def test_prometheus_scrapes_the_servers_metrics():
    from jaxserve.cli import build_parser

    with open(MONITORING / "prometheus.yml") as f:
        config = yaml.safe_load(f)
    assert config["global"]["scrape_interval"] == "5s"
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    port = build_parser().parse_args(["serve"]).port
    assert [f"localhost:{port}"] in [static["targets"] for static in job["static_configs"]]


def test_compose_mounts_the_configs_that_exist():
    with open(MONITORING / "docker-compose.yml") as f:
        services = yaml.safe_load(f)["services"]
    assert set(services) == {"prometheus", "grafana"}
    mounts = {}  # container path -> the file or folder here
    for service in services.values():
        image, _, tag = service["image"].partition(":")
        assert tag and tag != "latest", f"{image}: pin a tag"
        for volume in service["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("."):
                assert (MONITORING / source).exists(), f"{source} does not exist"
                mounts[target] = (MONITORING / source).resolve()
    assert f"--config.file={next(t for t, s in mounts.items() if s.name == 'prometheus.yml')}" in (
        services["prometheus"]["command"])

    provisioning = next(s for t, s in mounts.items() if t == "/etc/grafana/provisioning")
    with open(provisioning / "dashboards" / "jaxserve.yml") as f:
        (provider,) = yaml.safe_load(f)["providers"]
    dashboards = {s for t, s in mounts.items() if t.startswith(provider["options"]["path"] + "/")}
    assert dashboards == {DASHBOARD.resolve()}, "Grafana must load the dashboard from where compose mounts it"
    with open(provisioning / "datasources" / "prometheus.yml") as f:
        (datasource,) = yaml.safe_load(f)["datasources"]
    assert datasource["type"] == "prometheus"
    assert "--web.listen-address=127.0.0.1:9090" in services["prometheus"]["command"]
    assert datasource["url"] == "http://localhost:9090"


PROMETHEUS = shutil.which("prometheus")


@pytest.mark.skipif(PROMETHEUS is None, reason="no Prometheus: apt-get install prometheus (.ci/run does)")
def test_every_query_runs_in_prometheus_scraping_a_server(openai_server, tmp_path):
    """Prometheus itself (Debian's) scrapes the session's server every 0.5 s and evaluates each of the dashboard's
    queries as Grafana sends it (the variables put in): no query is refused, and each reads series."""
    url, _ = openai_server
    config = {"scrape_configs": [{"job_name": "jaxserve", "scrape_interval": "500ms", "scrape_timeout": "400ms",
                                  "static_configs": [{"targets": [url.removeprefix("http://")]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    api = f"http://127.0.0.1:{free_port()}/api/v1/query"
    with open(tmp_path / "prometheus.log", "w") as log:
        prometheus = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                                       f"--storage.tsdb.path={tmp_path / 'data'}",
                                       f"--web.listen-address={api.split('/')[2]}"], stdout=log, stderr=log)

    def query(expr: str) -> dict:
        return http_client.get(api, params={"query": expr}, timeout=10).json()

    try:
        deadline = time.monotonic() + 60
        while True:  # a few scrapes with requests finishing between them, so every rate() has two samples
            body = {"model": "tiny-stdlib-llama", "prompt": "import os\n", "max_tokens": 8}
            http_client.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                             timeout=60)
            try:
                scrapes = query('count_over_time(up{job="jaxserve"}[1m])')["data"]["result"]
            except (httpx.TransportError, json.JSONDecodeError):  # not listening, or "Service Unavailable" until ready
                scrapes = []
            if scrapes and float(scrapes[0]["value"][1]) >= 4:
                break
            assert prometheus.poll() is None and time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
            time.sleep(0.3)
        refused, empty = [], []
        for where, expr in _queries(_dashboard()):
            if where.startswith("variable"):
                continue  # label_values() is Grafana's, not PromQL: its metric is checked above
            promql = (expr.replace("${prefix}", "jaxserve").replace("$model_name", ".*")
                      .replace("$__rate_interval", "1m"))
            answer = query(promql)
            if answer["status"] != "success":
                refused.append(f"{where}: {promql}: {answer.get('error')}")
            elif not answer["data"]["result"] and "spec_decode" not in promql:  # no speculation on this server
                empty.append(f"{where}: {promql}")
        assert not refused, "\n".join(refused)
        assert not empty, "queries that read no series:\n" + "\n".join(empty)
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
