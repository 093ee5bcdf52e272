"""Shared helpers for engine tests: fixture checkpoints, their HF outputs, small engine configs."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import threading
import time

import numpy as np

CHECKPOINTS = os.path.join(os.path.dirname(__file__), "fixtures", "checkpoints")
ARCHITECTURES = ("llama", "llama-linear", "mistral", "qwen2", "qwen3")
# One compilation cache for the whole test session, so engines with equal shapes compile once.
TEST_CACHE_DIR = os.path.join(tempfile.gettempdir(), "jaxserve-test-xla-cache")


def checkpoint(name: str) -> str:
    """Path of a fixture checkpoint folder."""
    return os.path.join(CHECKPOINTS, name)


def expected(name: str) -> dict:
    """HF greedy outputs of a fixture checkpoint: prompts, outputs (20 tokens each), logits."""
    with open(os.path.join(checkpoint(name), "expected.json")) as f:
        data = json.load(f)
    data["logits"] = np.load(os.path.join(checkpoint(name), "expected_logits.npy"))  # (12, V) float32
    return data


def engine_stats(**values) -> dict:
    """An engine's stats() as the metrics collector reads it: every counter and gauge 0 unless given."""
    stats = dict.fromkeys(("num_requests_running", "num_requests_waiting", "num_requests_swapped", "preemptions",
                           "prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
                           "swapped_out_requests", "swapped_out_pages", "swapped_in_pages", "steps"), 0)
    stats.update(kv_pages_free=10, kv_pages_total=10, cpu_cache_usage_perc=0.0,
                 spec_decode={"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                              "accepted_per_position": []})
    return {**stats, **values}


def small_engine_args(**overrides) -> dict:
    """Engine options with small bucket ladders so tests compile quickly."""
    args = dict(
        max_model_len=128,
        page_size=16,
        num_pages=64,
        max_num_seqs=32,
        max_num_batched_tokens=64,
        min_token_bucket=16,
        compilation_cache_dir=TEST_CACHE_DIR,
        show_progress=False,
    )
    args.update(overrides)
    return args


@contextlib.contextmanager
def running_server(app):
    """Serve an ASGI app with a real uvicorn server on a free localhost port; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
