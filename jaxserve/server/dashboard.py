"""The live page (`GET /dashboard`) and the snapshot it polls every second (`GET /dashboard/data`).

The page is one static HTML file with its CSS and JavaScript inline (server/static/dashboard.html): no build step,
nothing fetched from elsewhere. It is served without the API key and asks for it (a `?key=` query or a field, kept in
the browser's sessionStorage); the data route is behind the key like /v1. A snapshot is the engine counters of the
last step (the same `replica_stats()` /metrics reads, summed over data-parallel replicas), the first replica's KV pool
map and step timing, and the TTFT and inter-token latency percentiles of the last minute (ServerMetrics' recent
samples). Rates (tokens/s, the step timeline of the last second) are the page's differences between two snapshots.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from jaxserve.engine.async_engine import EngineDeadError
from jaxserve.kv import PAGE_STATES
from jaxserve.server.metrics import ServerMetrics

# Engine counters a snapshot sums over the replicas.
COUNTERS = ("steps", "prompt_tokens", "generation_tokens", "preemptions", "swapped_out_requests", "swapped_out_pages",
            "swapped_in_pages", "prefix_cache_queries", "prefix_cache_hits")
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def page_html() -> str:
    """The live page: static/dashboard.html, shipped as package data."""
    return resources.files("jaxserve.server").joinpath("static/dashboard.html").read_text(encoding="utf-8")


async def snapshot(engine, metrics: ServerMetrics, replica_stats: Callable[[], list[dict]], model_name: str) -> dict:
    """What the live page shows now: the requests, the KV pool (and its map, None when the engine is not running),
    the counters, the latency percentiles and the step timing (see docs/server.md)."""
    replicas = replica_stats()
    first = replicas[0]

    def total(key: str) -> int:
        return sum(stats[key] for stats in replicas)

    try:
        runs = await engine.kv_page_states()
    except EngineDeadError:
        runs = None
    spec = {key: sum(stats["spec_decode"][key] for stats in replicas) for key in SPEC_COUNTERS}
    return {
        "time": time.time(),
        "model": model_name,
        "replicas": len(replicas),
        "running": engine.is_running,
        "requests": {"running": total("num_requests_running"), "waiting": total("num_requests_waiting"),
                     "swapped": total("num_requests_swapped"),
                     "unstarted": sum(stats.get("num_requests_unstarted", 0) for stats in replicas)},
        "kv": {"pages_total": total("kv_pages_total"), "pages_free": total("kv_pages_free"),
               "page_size": engine.model.kv_cache.page_size, "states": list(PAGE_STATES), "runs": runs},
        "counters": {key: total(key) for key in COUNTERS},
        "spec_decode": {**spec, "enabled": bool(first["spec_decode"]["accepted_per_position"])},
        "latency": {"window_s": metrics.recent_first_token.window_s,
                    "ttft_s": metrics.recent_first_token.percentiles(),
                    "itl_s": metrics.recent_inter_token.percentiles()},
        "timing": first["timing"],
    }


def add_dashboard_routes(app: FastAPI, engine, metrics: ServerMetrics, replica_stats: Callable[[], list[dict]],
                         model_name: str, guard: list) -> None:
    """`GET /dashboard` (the page, open) and `GET /dashboard/data` (the snapshot, behind `guard`: the API key)."""
    html = page_html()

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        """The live page."""
        return HTMLResponse(html)

    @app.get("/dashboard/data", dependencies=guard)
    async def dashboard_data() -> dict:
        """The live page's snapshot."""
        return await snapshot(engine, metrics, replica_stats, model_name)
