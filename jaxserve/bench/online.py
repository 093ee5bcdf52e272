"""`jaxserve bench serve`: timed streaming requests to a running OpenAI-compatible server.

Sends a seeded workload to /v1/completions (or /v1/chat/completions) of jaxserve, vLLM or any
OpenAI-compatible server, with Poisson or gamma arrivals at one request rate or a sweep of them
(optionally capped at a concurrency), and reports per rate: request and token throughput, time to
first token (TTFT), time per output token (TPOT), inter-token latency (ITL) and end-to-end latency
(mean, p50, p90, p99, in ms), goodput under SLOs, and the client's own cost per streamed chunk.
With --launch it starts a `jaxserve serve` itself and always stops it at the end.

Example:
    jaxserve bench serve --launch --request-rate 2 4 8 inf --num-requests 64 --plot-dir bench-out
    jaxserve bench serve --base-url http://127.0.0.1:8000 --workload sharegpt --endpoint /v1/chat/completions
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

import numpy as np
from tqdm import tqdm

from jaxserve.bench import stats
from jaxserve.bench.http_client import RawResponse, Target, post_streaming, request_bytes, request_json, trace_of
from jaxserve.bench.results import write_json
from jaxserve.bench.workloads import BenchRequest, Workload, add_workload_arguments, workload_from_args
from jaxserve.engine.host_gc import freeze_start_up_objects, tune_garbage_collector

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_MAX_MODEL_LEN = 1024  # tokens; when the server does not report its own
HEALTH_POLL_S = 0.1  # between GET /health polls of a launched server
ERRORS_KEPT = 5  # distinct error messages kept per rate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `jaxserve bench serve`."""
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server's URL, without /v1 (default: %(default)s)")
    server.add_argument("--endpoint", choices=ENDPOINTS, default=ENDPOINTS[0],
                        help="the chat endpoint needs text prompts (--workload sharegpt) (default: %(default)s)")
    server.add_argument("--model", help="the model name to send (default: the first one GET /v1/models lists)")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    server.add_argument("--tokenizer", help="tokenizer folder for the workload (default: the served model's folder "
                                            "when /v1/models names a local one, else the bundled model)")
    server.add_argument("--max-model-len", type=int,
                        help="longest prompt + output the workload may hold, in tokens (default: what /v1/models "
                             f"reports, else {DEFAULT_MAX_MODEL_LEN})")
    server.add_argument("--request-timeout", type=float, default=1800.0,
                        help="a request still streaming after this many seconds fails (default: %(default)s)")
    server.add_argument("--continuous-usage-stats", action="store_true",
                        help="ask for the token count in every chunk (exact tokens per chunk when the server "
                             "streams several tokens at once)")
    launch = parser.add_argument_group("launching a server")
    launch.add_argument("--launch", action="store_true",
                        help="start `jaxserve serve` on a free port for the run (--base-url is then ignored) "
                             "and stop it at the end")
    launch.add_argument("--server-args", default="",
                        help="extra `jaxserve serve` flags for --launch, in one string, e.g. \"--max-num-seqs 64\" "
                             "(not --host or --port: it picks them)")
    launch.add_argument("--launch-timeout", type=float, default=600.0,
                        help="seconds to wait for the launched server's GET /health 200 (default: %(default)s)")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                      help="requests per second; several values sweep them; inf sends all at once "
                           "(default: inf)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="shape of the gamma-distributed gaps between arrivals: 1 is Poisson, below 1 burstier, "
                           "above 1 more regular (default: %(default)s)")
    load.add_argument("--max-concurrency", type=int, help="most requests in flight at once (default: no limit)")
    load.add_argument("--slo-ttft", type=float, help="goodput SLO on time to first token, in ms")
    load.add_argument("--slo-tpot", type=float, help="goodput SLO on time per output token, in ms")
    add_workload_arguments(parser)
    output = parser.add_argument_group("output")
    output.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    output.add_argument("--plot-dir", metavar="DIR", help="write latency_vs_rate.png here")
    output.add_argument("--no-progress", action="store_true", help="no progress bar")


def arrival_schedule(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """When each request is sent, in seconds after the start: (num_requests,) float64, the first at 0.

    Gaps between arrivals are Gamma(shape=burstiness, scale=1 / (request_rate * burstiness)): mean
    1 / request_rate, Poisson arrivals for burstiness 1. An infinite rate sends everything at 0."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=max(num_requests - 1, 0))  # s
    return np.concatenate([[0.0], np.cumsum(gaps)])[:num_requests]


def request_body(request: BenchRequest, model: str, endpoint: str, continuous_usage_stats: bool) -> bytes:
    """The JSON body of one streamed, greedy, EOS-ignoring request: token ids as the prompt when the
    request has no text (completions only), else its text."""
    stream_options = {"include_usage": True}
    if continuous_usage_stats:  # only when asked: servers other than vLLM and jaxserve may refuse the field
        stream_options["continuous_usage_stats"] = True
    body = {"model": model, "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": stream_options}
    if endpoint == "/v1/chat/completions":
        body.update(messages=[{"role": "user", "content": request.prompt_text}],
                    max_completion_tokens=request.output_len)
    else:
        prompt = request.prompt_text if request.prompt_text is not None else list(request.prompt_token_ids)
        body.update(prompt=prompt, max_tokens=request.output_len)
    return json.dumps(body).encode()


async def send_all(target: Target, requests: Sequence[bytes], schedule: np.ndarray, max_concurrency: int | None,
                   timeout_s: float, progress: tqdm) -> tuple[list[RawResponse], float, int, float]:
    """Send each request (from request_bytes) at its scheduled time; (responses in request order, start
    time (s), most requests in flight at once, the client thread's CPU time over the run (s))."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    in_flight = 0
    most = 0

    async def send(request: bytes) -> RawResponse:
        nonlocal in_flight, most
        async with limit:
            in_flight += 1
            most = max(most, in_flight)
            response = await post_streaming(target, request, timeout_s)
            in_flight -= 1
        progress.update(1)
        return response

    cpu_start = time.thread_time()  # s: the event loop's thread only, so a server in this process is not counted
    start = time.perf_counter()
    tasks = []
    for request, due in zip(requests, schedule):
        delay = start + due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(request)))
    responses = await asyncio.gather(*tasks)
    return responses, start, most, time.thread_time() - cpu_start


def run_loop(coroutine):
    """Run the client on uvloop when it is installed (less client CPU taken from the server), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def measure_rate(args: argparse.Namespace, target: Target, workload: Workload, requests: list[bytes],
                 rate: float) -> dict:
    """One timed run of the whole workload at `rate` requests/s; its JSON-able result."""
    schedule = arrival_schedule(len(requests), rate, args.burstiness, args.seed)
    rate_value = "inf" if math.isinf(rate) else rate  # JSON has no infinity
    with tqdm(total=len(requests), desc=f"rate {rate_label(rate_value)}/s", unit="req",
              disable=args.no_progress or not sys.stderr.isatty()) as progress:
        responses, start, most, client_cpu_s = run_loop(send_all(
            target, requests, schedule, args.max_concurrency, args.request_timeout, progress))
    parse_start = time.perf_counter()
    traces = [trace_of(response, len(request.prompt_token_ids))
              for response, request in zip(responses, workload.requests)]
    parse_s = time.perf_counter() - parse_start
    ok = [t for t in traces if t.error is None]
    tokens = stats.token_totals(traces)
    duration = max(t.end for t in traces) - start  # s
    chunks = sum(len(t.chunk_times) for t in traces)
    errors = list(dict.fromkeys(t.error for t in traces if t.error))[:ERRORS_KEPT]
    per_chunk_us = 1e6 / max(chunks, 1)
    return {
        "request_rate": rate_value,
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(traces) - len(ok),
        "errors": errors,
        "max_concurrency_reached": most,
        **tokens,
        "expected_output_tokens": workload.num_output_tokens,
        **stats.throughput(len(ok), tokens["prompt_tokens"], tokens["output_tokens"], duration),
        "latency_ms": stats.latency_summary(traces),
        "goodput": stats.goodput(traces, duration, args.slo_ttft, args.slo_tpot),
        "client": {
            "chunks": chunks,
            "busy_us_per_chunk": sum(r.busy_s for r in responses) * per_chunk_us,
            "cpu_us_per_chunk": client_cpu_s * per_chunk_us,
            "parse_us_per_chunk": parse_s * per_chunk_us,
        },
    }


def server_info(target: Target, api_key: str | None) -> dict:
    """The first model card of GET /v1/models; ValueError naming --base-url when that fails."""
    url = target.url("/v1/models")
    try:
        status, body = request_json("GET", url, api_key)
    except OSError as exc:
        raise ValueError(f"cannot reach the server at {url} (check --base-url): {exc}") from exc
    if status != 200 or not isinstance(body, dict) or not body.get("data"):
        raise ValueError(f"GET {url} answered {status} {str(body)[:200]}; is --base-url an OpenAI-compatible "
                         "server (and --api-key right)?")
    return body["data"][0]


def reset_prefix_cache(target: Target, api_key: str | None) -> bool:
    """Ask the server to forget its prefix cache (POST /reset_prefix_cache, jaxserve's and vLLM's dev
    route), so that each rate starts cold; whether it did."""
    try:
        status, _ = request_json("POST", target.url("/reset_prefix_cache"), api_key)
    except OSError:
        return False
    return status == 200


def load_workload(args: argparse.Namespace, card: dict) -> tuple[Workload, str, int]:
    """The workload of the options, with the tokenizer folder and max_model_len it was built for."""
    from jaxserve.engine.llm_engine import default_model_path
    from jaxserve.tokenizer import load_tokenizer

    root = card.get("root")
    tokenizer_path = args.tokenizer or (root if isinstance(root, str) and os.path.isdir(root) else default_model_path())
    max_model_len = args.max_model_len or card.get("max_model_len") or DEFAULT_MAX_MODEL_LEN
    workload = workload_from_args(args, load_tokenizer(tokenizer_path), max_model_len)
    if args.endpoint == "/v1/chat/completions" and any(r.prompt_text is None for r in workload.requests):
        raise ValueError(f"--endpoint {args.endpoint} needs text prompts: use --workload sharegpt")
    return workload, tokenizer_path, max_model_len


def benchmark(args: argparse.Namespace, base_url: str) -> dict:
    """Warm up, then run the workload once per request rate against the server at `base_url`."""
    target = Target.from_url(base_url)
    card = server_info(target, args.api_key)
    model = args.model or card["id"]
    workload, tokenizer_path, max_model_len = load_workload(args, card)
    requests = [request_bytes(target, args.endpoint, request_body(r, model, args.endpoint, args.continuous_usage_stats),
                              args.api_key) for r in workload.requests]
    warm_up = trace_of(run_loop(post_streaming(target, requests[0], args.request_timeout)),
                       len(workload.requests[0].prompt_token_ids))
    if warm_up.error:
        raise ValueError(f"the warm-up request to {target.url(args.endpoint)} failed: {warm_up.error}")
    rates = []
    for rate in args.request_rate:
        cache_reset = reset_prefix_cache(target, args.api_key)
        rates.append({**measure_rate(args, target, workload, requests, rate), "prefix_cache_reset": cache_reset})
    return {
        "base_url": base_url, "endpoint": args.endpoint, "model": model, "tokenizer": tokenizer_path,
        "max_model_len": max_model_len,
        "workload": {"name": workload.name, "description": workload.description,
                     "num_requests": len(workload.requests), "prompt_tokens": workload.num_prompt_tokens,
                     "output_tokens": workload.num_output_tokens},
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed,
        "slo_ttft_ms": args.slo_ttft, "slo_tpot_ms": args.slo_tpot, "rates": rates,
    }


# ---- a launched `jaxserve serve` --------------------------------------------------------------------

def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: str, lines: int = 30) -> str:
    """The last lines of a log file."""
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Terminate; kill if it lingers past `grace_s` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def launched_server(server_args: str, timeout_s: float) -> Iterator[tuple[str, str, float]]:
    """Start `jaxserve serve` on a free port with `server_args`; yield (base URL, command, start-up seconds:
    from the launch to the first GET /health 200) once it is healthy, and stop it on exit, whatever happens. ValueError
    (with its log's tail) when it exits or is not healthy within `timeout_s` seconds."""
    port = free_port()
    # every bucket compiled before the first request (server_args may say otherwise): a sweep measures steady serving
    argv = [sys.executable, "-m", "jaxserve", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", "--no-background-compile", *shlex.split(server_args)]
    command = shlex.join(argv)
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="jaxserve-bench-serve-") as folder:
        log_path = os.path.join(folder, "server.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            launched = time.perf_counter()
            deadline = launched + timeout_s
            while not healthy(url):
                if proc.poll() is not None:
                    raise ValueError(f"the launched server exited with code {proc.returncode}: {command}\n"
                                     f"{log_tail(log_path)}")
                if time.perf_counter() > deadline:
                    raise ValueError(f"the launched server was not healthy after {timeout_s:g} s (--launch-timeout)"
                                     f": {command}\n{log_tail(log_path)}")
                time.sleep(HEALTH_POLL_S)
            yield url, command, time.perf_counter() - launched
        finally:
            stop_process(proc)


def healthy(url: str) -> bool:
    """Whether GET /health answers 200."""
    try:
        return request_json("GET", url + "/health", None, timeout_s=2.0)[0] == 200
    except OSError:
        return False


# ---- report -----------------------------------------------------------------------------------------

def report_lines(result: dict) -> list[str]:
    """The report: a throughput table and a latency table, one row per request rate."""
    w = result["workload"]
    lines = [f"## jaxserve bench serve: {result['model']} at {result['base_url']}{result['endpoint']}", "",
             f"Workload {w['name']}: {w['description']}; burstiness {result['burstiness']:g}, max concurrency "
             f"{result['max_concurrency'] or 'unlimited'}, seed {result['seed']}."]
    if "server_command" in result:
        lines.append(f"Launched server: {result['server_command']}")
    lines += ["",
              "| rate (req/s) | duration (s) | ok | failed | req/s | output tok/s | total tok/s | goodput req/s "
              "| max in flight | client busy / CPU / parse (us/chunk) |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rates"]:
        c = r["client"]
        lines.append(f"| {rate_label(r['request_rate'])} | {r['duration_s']:.2f} | {r['completed']} | {r['failed']} "
                     f"| {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | {r['total_tokens_per_s']:.1f} "
                     f"| {r['goodput']['requests_per_s']:.2f} | {r['max_concurrency_reached']} "
                     f"| {c['busy_us_per_chunk']:.1f} / {c['cpu_us_per_chunk']:.1f} / {c['parse_us_per_chunk']:.1f} |")
    lines += ["", "Client cost per streamed chunk: busy = time in its receive callback; CPU = its thread's CPU time "
              "over the run (event loop, sockets, kernel); parse = HTTP and SSE parsing after the run."]
    metrics = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
    lines += ["", "Latency in ms (mean / p50 / p90 / p99):", "",
              "| rate (req/s) | " + " | ".join(m[:-3].upper() for m in metrics) + " |",
              "|---:|" + "---:|" * len(metrics)]
    for r in result["rates"]:
        cells = [" / ".join(_ms(r["latency_ms"][m][k]) for k in ("mean", "p50", "p90", "p99")) for m in metrics]
        lines.append(f"| {rate_label(r['request_rate'])} | " + " | ".join(cells) + " |")
    for r in result["rates"]:
        for error in r["errors"]:
            lines.append(f"rate {rate_label(r['request_rate'])}: failed request: {error}")
        if not r["failed"] and r["output_tokens"] != r["expected_output_tokens"]:
            lines.append(f"rate {rate_label(r['request_rate'])}: {r['output_tokens']} output tokens, "
                         f"{r['expected_output_tokens']} asked for: does the server honour ignore_eos?")
    return lines


def rate_label(rate: float | str) -> str:
    """A request rate as reports write it: "inf", or the number in its shortest form."""
    return rate if isinstance(rate, str) else f"{rate:g}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def run_as_command(args: argparse.Namespace) -> dict:
    """`jaxserve bench serve` in a process of its own: Python's collector tuned as the engine's is (engine/host_gc.py),
    then `run`. Its raw responses are many small objects: at CPython's defaults the client spent 34-46 us of CPU a
    chunk at 512 streams against 18-25 tuned, CPU that a server on the same host does not get (docs/benchmarks.md)."""
    tune_garbage_collector()
    freeze_start_up_objects()
    return run(args)


def run(args: argparse.Namespace) -> dict:
    """Run `jaxserve bench serve`: print the report, write --json and --plot-dir; the result."""
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    for rate in args.request_rate:
        arrival_schedule(0, rate, args.burstiness)  # validates both
    if args.launch:
        with launched_server(args.server_args, args.launch_timeout) as (url, command, startup_s):
            print(f"server healthy {startup_s:.1f} s after launch (loading and compiling every step shape)")
            result = {**benchmark(args, url), "server_command": command, "server_startup_s": startup_s}
    else:
        result = benchmark(args, args.base_url)
    print("\n".join(report_lines(result)))
    if args.plot_dir:
        from jaxserve.bench.plots import latency_vs_rate

        os.makedirs(args.plot_dir, exist_ok=True)
        result["plots"] = [latency_vs_rate(result["rates"], os.path.join(args.plot_dir, "latency_vs_rate.png"))]
        print(f"wrote {result['plots'][0]}")
    if args.json:
        write_json(args.json, result)
    return result
