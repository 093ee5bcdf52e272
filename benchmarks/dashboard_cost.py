"""The live page's own cost (issue 51): the server's output tokens/s with nothing watching it, with a poller reading
/dashboard/data every second, and with the page open in headless Chromium (when one is installed), same server,
runs alternating.

    python -m benchmarks.dashboard_cost                       # 3 rounds of 512 requests, 16 streams at a time
    python -m benchmarks.dashboard_cost --rounds 2 --json out.json

The server is `jaxserve serve` on the bundled model (the engine core in its own process), launched once. A run is
`--requests` streaming completions (`--max-tokens` each, ignore_eos), `--concurrency` at a time; a warm-up run
comes first. Reported: each mode's output tokens/s, mean and best, and the ratio of its mean to the unwatched one's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import threading
import time

import httpx

from jaxserve.bench.online import launched_server

POLL_S = 1.0  # the page's own interval
POLL_MS: list[float] = []  # the poller's answers' times, milliseconds (under load: a step's wait included)


async def workload(url: str, requests: int, concurrency: int, max_tokens: int) -> tuple[int, float]:
    """Run every request, `concurrency` at a time; (output tokens, seconds)."""
    limit = asyncio.Semaphore(concurrency)

    async with httpx.AsyncClient(timeout=300) as client:
        async def one(index: int) -> int:
            body = {"prompt": f"def task_{index}(items):\n", "max_tokens": max_tokens, "ignore_eos": True,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            tokens = 0
            async with limit, client.stream("POST", f"{url}/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                        tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            return tokens

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(requests)))
    return sum(counts), time.perf_counter() - started


@contextlib.contextmanager
def poller(url: str):
    """A thread reading /dashboard/data every POLL_S seconds (what the page does) for the block's time; each answer's
    milliseconds go to POLL_MS."""
    stop = threading.Event()

    def run() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.wait(POLL_S):
                started = time.perf_counter()
                client.get(f"{url}/dashboard/data").raise_for_status()
                POLL_MS.append(1e3 * (time.perf_counter() - started))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def chromium():
    """A headless Chromium (selenium), or None where none is installed."""
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        return None
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return None
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,1100"):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


@contextlib.contextmanager
def page_open(browser, url: str):
    """The live page open in `browser` for the block's time."""
    browser.get(f"{url}/dashboard")
    try:
        yield
    finally:
        browser.get("about:blank")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--server-args", default="", help="more `jaxserve serve` flags")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    browser = chromium()
    modes = {"off": contextlib.nullcontext, "poll": lambda: poller(url)}
    if browser is not None:
        modes["browser"] = lambda: page_open(browser, url)
    results: dict[str, list[float]] = {mode: [] for mode in modes}
    try:
        with launched_server(args.server_args, timeout_s=600) as (url, command, _):
            run = lambda: asyncio.run(workload(url, args.requests, args.concurrency, args.max_tokens))  # noqa: E731
            run()  # warm-up
            for round_ in range(args.rounds):
                for mode, context in modes.items():
                    with context():
                        tokens, seconds = run()
                    results[mode].append(tokens / seconds)
                    print(f"round {round_ + 1} {mode:8s} {tokens} tokens in {seconds:.2f} s: "
                          f"{tokens / seconds:.1f} tokens/s", flush=True)
    finally:
        if browser is not None:
            browser.quit()
    base = statistics.mean(results["off"])
    summary = {mode: {"mean": statistics.mean(rates), "best": max(rates), "runs": rates,
                      "mean_vs_off": statistics.mean(rates) / base} for mode, rates in results.items()}
    for mode, row in summary.items():
        print(f"{mode:8s} mean {row['mean']:.1f} best {row['best']:.1f} tokens/s ({row['mean_vs_off']:.3f}x off)")
    polls = {"count": len(POLL_MS), "median_ms": statistics.median(POLL_MS), "max_ms": max(POLL_MS)}
    print(f"/dashboard/data under load: {polls['count']} polls, median {polls['median_ms']:.1f} ms, "
          f"max {polls['max_ms']:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"server": command, "args": vars(args), "results": summary, "polls": polls}, f, indent=2)


if __name__ == "__main__":
    main()
