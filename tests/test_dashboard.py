"""The live page (server/dashboard.py): /dashboard/data's snapshot is behind the API key and its KV pool map agrees with
the engine's counters; the page itself, in headless Chromium against a server under load, shows numbers that move and
end equal to /metrics'. JAXSERVE_DASHBOARD_SCREENSHOT=PATH saves a screenshot of it under load (docs/bench/)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import threading
import time

import pytest
from conftest import API_KEY
from helpers import http_client
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.kv import PAGE_STATES
from jaxserve.server.app import build_app
from jaxserve.server.config import ServerConfig
from jaxserve.server.metrics import RecentSamples

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
SHARED_PREFIX = "def parse_arguments(argv):\n    parser = argparse.ArgumentParser(description='the tool')\n"


def _data(url: str) -> dict:
    response = http_client.get(f"{url}/dashboard/data", headers=HEADERS, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _page_counts(kv: dict) -> dict[str, int]:
    """Pages per state in the snapshot's run-length encoded map."""
    counts = dict.fromkeys(kv["states"], 0)
    for state, run in kv["runs"]:
        counts[kv["states"][state]] += run
    return counts


def _metric(url: str, name: str) -> float:
    text = http_client.get(f"{url}/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _complete(url: str, prompt: str, max_tokens: int, stream: bool = False) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    with http_client.stream("POST", f"{url}/v1/completions", json=body, headers=HEADERS, timeout=60) as response:
        assert response.status_code == 200
        for _ in response.iter_lines():
            pass


def test_the_data_needs_the_api_key_and_the_page_does_not(openai_server):
    url, _ = openai_server
    assert http_client.get(f"{url}/dashboard/data").status_code == 401
    assert http_client.get(f"{url}/dashboard/data", headers={"Authorization": "Bearer nope"}).status_code == 401
    page = http_client.get(f"{url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/dashboard/data" in page.text and "<canvas" in page.text
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.text), "the page fetches nothing from elsewhere"


def test_the_snapshot_counts_agree_with_the_engine_and_the_pool_map(openai_server):
    url, engine = openai_server
    _complete(url, SHARED_PREFIX * 2, 8)  # its full prompt pages stay cached once it has finished
    data = _data(url)
    assert set(data) == {"time", "model", "replicas", "running", "requests", "kv", "counters", "spec_decode",
                         "latency", "timing"}
    assert data["running"] and data["replicas"] == 1 and data["requests"]["running"] == 0
    stats = engine.stats()  # idle: the engine thread changes nothing meanwhile
    kv = data["kv"]
    assert kv["states"] == list(PAGE_STATES)
    assert kv["pages_total"] == stats["kv_pages_total"] and kv["pages_free"] == stats["kv_pages_free"]
    counts = _page_counts(kv)
    assert sum(counts.values()) == kv["pages_total"]
    assert counts["free"] + counts["cached"] == kv["pages_free"], "idle: no page is held"
    assert counts["cached"] >= 2 and counts["in_use"] == counts["shared"] == 0
    assert data["counters"]["generation_tokens"] == stats["generation_tokens"]
    assert data["counters"]["prefix_cache_queries"] == stats["prefix_cache_queries"]
    assert data["latency"]["ttft_s"]["count"] >= 1 and data["latency"]["ttft_s"]["p50"] > 0
    assert data["latency"]["itl_s"]["count"] >= 1
    assert data["timing"]["steps"] == stats["timing"]["steps"] and "wait_ms" in data["timing"]
    assert data["spec_decode"] == {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                                   "enabled": False}


def test_recent_samples_give_the_percentiles_of_their_window():
    recent = RecentSamples(window_s=10)
    for second in range(100):
        recent.add(float(second), now=second)
    assert recent.percentiles(now=100.0) == {"count": 10, "p50": 95.0, "p90": 99.0, "p99": 99.0}
    assert recent.percentiles(now=200.0) == {"count": 0, "p50": None, "p90": None, "p99": None}


def test_the_flag_turns_the_page_off(openai_server):
    _, engine = openai_server
    paths = {getattr(route, "path", None) for route in build_app(engine, ServerConfig(enable_dashboard=False)).routes}
    assert "/dashboard" not in paths and "/dashboard/data" not in paths and "/metrics" in paths


def _browser():
    """A headless Chromium driven by selenium, or a pytest skip saying what is missing."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None or importlib.util.find_spec("selenium") is None:
        pytest.skip("no headless Chromium: apt-get install chromium chromium-driver and pip install selenium")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,1180"):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(driver_path), options=options)


def _shown(browser, element_id: str) -> str:
    """The element's text; the page redraws some elements on each refresh, so one found just before a redraw is
    looked up again."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(20):
        try:
            return browser.find_element("id", element_id).text
        except StaleElementReferenceException:
            time.sleep(0.05)
    return browser.find_element("id", element_id).text


def test_the_page_in_a_browser_shows_live_numbers_equal_to_the_metrics(openai_server):
    url, _ = openai_server
    browser = _browser()
    stop, errors = threading.Event(), []

    def load(worker: int) -> None:  # streams sharing a prompt prefix: shared pages while they run, cached after
        count = 0
        while not stop.is_set():
            try:
                _complete(url, f"{SHARED_PREFIX * 2}# worker {worker}, request {count}\n", 96, stream=True)
            except Exception as error:  # surfaced below
                errors.append(error)
                return
            count += 1

    threads = [threading.Thread(target=load, args=(worker,)) for worker in range(6)]
    try:
        browser.get(f"{url}/dashboard?key={API_KEY}")
        deadline = time.monotonic() + 30  # generous: a loaded CI machine; a working page takes about a second
        while not _shown(browser, "generation-tokens").isdigit():
            assert time.monotonic() < deadline, f"the page shows no numbers: {_shown(browser, 'status')}"
            time.sleep(0.1)
        first = int(_shown(browser, "generation-tokens"))
        for thread in threads:
            thread.start()
        seen_running, deadline = False, time.monotonic() + 30
        while not (seen_running and int(_shown(browser, "generation-tokens")) > first
                   and float(_shown(browser, "gen-rate")) > 0 and int(_shown(browser, "map-in_use")) > 0):
            assert time.monotonic() < deadline, "the page's numbers did not move under load"
            seen_running = seen_running or int(_shown(browser, "running")) > 0
            time.sleep(0.1)
        screenshot = os.environ.get("JAXSERVE_DASHBOARD_SCREENSHOT")
        if screenshot:
            time.sleep(2.5)  # a few polls under load: the rate chart and the step timeline fill in
            browser.save_screenshot(screenshot)
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors, errors
        # Idle now: within a poll or two the page shows what /metrics says.
        expected = {"generation-tokens": "jaxserve:generation_tokens_total",
                    "prefix-queries": "jaxserve:prefix_cache_queries_total",
                    "prefix-hits": "jaxserve:prefix_cache_hits_total"}
        deadline = time.monotonic() + 15
        while True:
            shown = {element: _shown(browser, element) for element in expected}
            metrics = {element: str(int(_metric(url, name))) for element, name in expected.items()}
            if shown == metrics and _shown(browser, "running") == "0":
                break
            assert time.monotonic() < deadline, f"the page shows {shown}, /metrics says {metrics}"
            time.sleep(0.2)
        assert int(shown["prefix-hits"]) > 0
        pages = {state: int(_shown(browser, f"map-{state}")) for state in PAGE_STATES}
        assert sum(pages.values()) == int(_shown(browser, "kv-total")) and pages["cached"] > 0
    finally:
        stop.set()
        browser.quit()
