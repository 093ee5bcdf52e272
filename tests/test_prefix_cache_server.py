"""Prefix caching through the HTTP server: hits show in /metrics and in usage, and
POST /reset_prefix_cache forgets the cached pages (vLLM's route)."""

from conftest import API_KEY
from helpers import http_client
from prometheus_client.parser import text_string_to_metric_families

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "def parse_arguments(argv):\n    parser = argparse.ArgumentParser(description='the tool')\n" * 2


def _hits(url: str) -> float:
    text = http_client.get(f"{url}/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "jaxserve:prefix_cache_hits_total")


def _complete(url: str) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    response = http_client.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_repeated_prompt_hits_the_cache_until_it_is_reset(openai_server):
    url, engine = openai_server
    first = _complete(url)
    before = _hits(url)
    second = _complete(url)
    prompt_tokens = second["usage"]["prompt_tokens"]
    page_size = engine.config.cache_config.page_size
    assert _hits(url) - before == (prompt_tokens - 1) // page_size * page_size > 0
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert http_client.post(f"{url}/reset_prefix_cache", headers=HEADERS).status_code == 200
    assert http_client.post(f"{url}/reset_prefix_cache").status_code == 401
    before = _hits(url)
    third = _complete(url)
    assert _hits(url) == before, "after a reset nothing is cached"
    assert third["choices"][0]["text"] == first["choices"][0]["text"]
