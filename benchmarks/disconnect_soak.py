"""A soak of streaming requests of which a share of clients leave mid-stream (issue 49): every page comes back to the
pool, nothing is left running, and the server's process ends when stopped.

    python -m benchmarks.disconnect_soak                            # 2000 requests, 20 % disconnects
    python -m benchmarks.disconnect_soak --requests 200 --json out.json

The server is benchmarks/serving_capacity.py's: the real app over a FakeRunner engine (no device time) in its own
process. An httpx client keeps `--concurrency` streaming completions in flight (32-token prompts, 64 tokens each,
ignore_eos); every fifth request (by default) closes its connection after its first chunk. Afterwards /metrics must
show no request running or waiting and no KV page in use, and the process must exit on SIGTERM leaving no process
of its own behind (the engine core's, by default: `--engine thread` runs the engine in the server's process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time

import httpx

from benchmarks.serving_capacity import fake_server
from jaxserve.engine.core_process import process_alive

OUTPUT_LEN = 64


async def one_request(client: httpx.AsyncClient, url: str, index: int, leave: bool) -> tuple[int, bool]:
    """Stream one completion; when `leave`, close the connection after the first chunk. (chunks read, finished)."""
    body = {"prompt": f"def soak_{index}(x):", "max_tokens": OUTPUT_LEN, "ignore_eos": True, "stream": True}
    chunks = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return chunks, True
            chunks += 1
            if leave:
                return chunks, False  # leaving the block closes the connection mid-stream
    return chunks, False


async def soak(url: str, requests: int, concurrency: int, leave_every: int) -> dict:
    """Run every request, `concurrency` at a time; counts of finished and abandoned streams."""
    limit = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)

    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def run(index: int) -> tuple[int, bool]:
            async with limit:
                return await one_request(client, url, index, leave_every > 0 and index % leave_every == 0)

        started = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(requests)))
    return {"requests": requests, "finished": sum(done for _, done in results),
            "abandoned": sum(not done for _, done in results), "chunks": sum(c for c, _ in results),
            "seconds": time.perf_counter() - started}


def settled(url: str, timeout_s: float = 30.0) -> dict:
    """/metrics once nothing runs or waits (or the timeout passes): the requests, the KV pool's use and the samples
    the engine aborted."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = {"aborted_samples": 0.0}
        for line in httpx.get(f"{url}/metrics").text.splitlines():
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
                if line.startswith(f"jaxserve:{name}{{"):
                    values[name] = float(line.rsplit(" ", 1)[1])
            if line.startswith("jaxserve:request_success_total{") and 'finished_reason="abort"' in line:
                values["aborted_samples"] += float(line.rsplit(" ", 1)[1])  # the engine aborted them mid-stream
        if values["num_requests_running"] == values["num_requests_waiting"] == 0 or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def child_processes(pid: int) -> list[int]:
    """The process ids of `pid`'s children (Linux's /proc)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def running(pid: int, timeout_s: float = 5.0) -> bool:
    """Whether process `pid` is still there (not a zombie) after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process_alive(pid):
            return False
        time.sleep(0.05)
    return True


def main(argv: list[str] | None = None) -> dict:
    """Run the soak; print and return what it found (and write it as JSON when asked)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--leave-every", type=int, default=5, help="every Nth client leaves after its first chunk")
    parser.add_argument("--engine", choices=["thread", "process"], default="process",
                        help="the engine on a thread of the server's process, or in an engine-core process")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        stats_path = os.path.join(folder, "stats.json")
        with fake_server(args.concurrency, stats_path, args.engine) as (url, process):
            children = child_processes(process.pid)  # the engine core's (and multiprocessing's resource tracker)
            result = asyncio.run(soak(url, args.requests, args.concurrency, args.leave_every))
            result["after"] = settled(url)
        result["server_exit_code"] = process.returncode  # fake_server has stopped it
        result["engine"], result["child_processes"] = args.engine, len(children)
        result["processes_left"] = [pid for pid in children if running(pid)]
        with open(stats_path) as f:
            stats = json.load(f)
    result["kv_pages_free_at_stop"], result["kv_pages_total"] = stats["kv_pages_free"], stats["kv_pages_total"]
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
