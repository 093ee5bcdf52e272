"""The keep-alive race: a client reusing a connection idle for about as long as the server keeps one open.

    python -m benchmarks.keep_alive                      # --timeout-keep-alive 5 (uvicorn's default) and 75 (ours)
    python -m benchmarks.keep_alive --timeouts 5 --rounds 5

httpx (and the openai client over it) keeps an idle connection 5 s (`keepalive_expiry`), as long as uvicorn keeps
one by default (`timeout_keep_alive`). A request sent on a connection idle for just under 5 s can meet the server's
close of it: a busy server's event loop runs its due keep-alive timer before it reads the request that came in
meanwhile, its kernel answers the request with a reset, and the request fails unanswered, never read. For each
timeout this starts `jaxserve serve` (the bundled model, nothing compiled before the first request), and per round
keeps 16 streamed completions generating while it opens httpx clients at once, 3 for each of 41 idle times spaced
over 4.95-5.05 s: each GETs /health, sleeps its idle time, then POSTs /tokenize on the kept connection. Prints how
many of those requests failed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections

import httpx

from jaxserve.bench.online import launched_server

IDLE_TIMES_S = [4.95 + 0.0025 * k for k in range(41)]  # across httpx's and uvicorn's 5 s


async def probe(url: str, idle_s: float) -> str | None:
    """One client's request on a connection idle `idle_s` seconds: None when answered 200, else what went wrong."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        await client.get("/health")
        await asyncio.sleep(idle_s)
        try:
            response = await client.post("/tokenize", json={"prompt": "def"})
        except httpx.TransportError as error:
            return type(error).__name__
        return None if response.status_code == 200 else f"HTTP {response.status_code}"


async def generate(client: httpx.AsyncClient, stop: asyncio.Event) -> None:
    """Streamed completions one after another until `stop`: the load the server's event loop serves meanwhile."""
    body = {"prompt": "def fibonacci(n):", "max_tokens": 64, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for _ in response.aiter_bytes():
                pass


async def probe_round(url: str, clients_per_idle: int, load_streams: int) -> list[str | None]:
    """Every probe at once (`clients_per_idle` for each idle time), while `load_streams` streams generate."""
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        load = [asyncio.create_task(generate(client, stop)) for _ in range(load_streams)]
        probes = [probe(url, idle_s) for idle_s in IDLE_TIMES_S for _ in range(clients_per_idle)]
        errors = await asyncio.gather(*probes)
        stop.set()
        await asyncio.gather(*load)
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeouts", type=int, nargs="+", default=[5, 75], help="--timeout-keep-alive values")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of probes per server")
    parser.add_argument("--clients-per-idle", type=int, default=3, help="clients sent at once for each idle time")
    parser.add_argument("--load-streams", type=int, default=16, help="streamed completions running meanwhile")
    args = parser.parse_args()
    print("| --timeout-keep-alive | requests on a connection idle 4.95-5.05 s | failed | errors |")
    print("|---:|---:|---:|---|")
    for timeout in args.timeouts:
        server_args = f"--skip-precompile --max-model-len 128 --timeout-keep-alive {timeout}"
        with launched_server(server_args, timeout_s=300) as (url, _, _):
            outcomes = [error for _ in range(args.rounds)
                        for error in asyncio.run(probe_round(url, args.clients_per_idle, args.load_streams))]
        failures = collections.Counter(error for error in outcomes if error)
        errors = ", ".join(f"{name} x{count}" for name, count in failures.items()) or "-"
        print(f"| {timeout} | {len(outcomes)} | {failures.total()} | {errors} |", flush=True)


if __name__ == "__main__":
    main()
