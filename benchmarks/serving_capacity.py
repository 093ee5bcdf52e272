"""The serving path's own capacity (issue 49): streamed tokens/s through `jaxserve serve`'s HTTP front end when the
device takes no time, at 64, 256 and 512 concurrent SSE streams.

    python -m benchmarks.serving_capacity                        # 64, 256 and 512 streams
    python -m benchmarks.serving_capacity --streams 512 --json out.json

For each stream count N, a server is started in its own process: the real app (`build_app`: FastAPI, the async
engine, detokenizing, SSE at stream interval 1) over an LLMEngine whose runner is benchmarks/host_step.py's
FakeRunner (its samples ready at once, no device work), max_num_seqs N. `jaxserve bench serve` then sends N
streaming completions at once (--max-concurrency N): prompts of 32 tokens, 256 output tokens each (ignore_eos),
through its raw-socket client, on the same 2-core machine. Reported per N: the streamed output tokens/s (all
tokens over the run's wall time), TTFT and inter-token latency, the client's own CPU per chunk, and the engine's
host time per step from the server's step timing (schedule, build, update, output) and the front end's CPU per
generated token, read when the server stops. `--replies whole` sends the same N requests not streamed (the same
raw-socket client), each reply whole at its end.

    python -m benchmarks.serving_capacity --streams 512 --engine process --replies streamed whole
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from unittest import mock

from benchmarks.host_step import FakeRunner, corpus_token_ids, model_folder
from jaxserve.bench.http_client import Target, parse_http, post_streaming, request_bytes, request_json
from jaxserve.bench.online import free_port, healthy, log_tail, stop_process
from jaxserve.bench.results import write_json
from jaxserve.bench.stats import summarize
from jaxserve.config import EngineConfig
from jaxserve.engine import core_builder
from jaxserve.engine.llm_engine import LLMEngine, default_model_path
from jaxserve.kv.cache_manager import pages_for_tokens
from jaxserve.tokenizer import load_tokenizer

PROMPT_LEN = 32
OUTPUT_LEN = 256
MAX_MODEL_LEN = 512  # a page-rounded room for the prompt and the output


def fake_engine(config: EngineConfig) -> LLMEngine:
    """An LLMEngine of `config` over a FakeRunner (the engine-core process's `make_engine`), its samples drawn from a
    text of as many tokens as its rows stream (the draws wrap around it)."""
    rows = config.scheduler_config.max_num_seqs
    corpus = corpus_token_ids(load_tokenizer(default_model_path()), min(rows * (PROMPT_LEN + OUTPUT_LEN), 200_000))
    with mock.patch.object(core_builder, "Runner", functools.partial(FakeRunner, corpus)):
        return LLMEngine(config, show_progress=False)


def serve(port: int, rows: int, stats_path: str, engine: str) -> None:
    """Run the real app over a FakeRunner engine of `rows` rows on `port` until SIGTERM, the engine in this process
    (`engine` thread) or in an engine-core process (process); then write the engine's stats (its step timing among
    them) to `stats_path`."""
    import uvicorn

    from jaxserve.engine.core_client import EngineCoreClient
    from jaxserve.server.app import build_app
    from jaxserve.server.config import ServerConfig
    from jaxserve.server.front_ends import raise_open_files_limit, uvicorn_config

    raise_open_files_limit()  # as `serve` does
    server_config = ServerConfig(port=port, max_waiting_requests=4 * rows, stream_interval=1)
    with model_folder(MAX_MODEL_LEN) as folder:
        config = EngineConfig(model=folder, max_model_len=MAX_MODEL_LEN, page_size=16,
                              num_pages=rows * pages_for_tokens(MAX_MODEL_LEN, 16) + 1, max_num_seqs=rows,
                              max_num_batched_tokens=max(8192, rows), skip_precompile=True,
                              compilation_cache_dir=None, enable_structured_outputs=False)
        if engine == "process":
            served = EngineCoreClient.launch(config, server_config.max_waiting_requests, 1, make_engine=fake_engine)
        else:
            served = fake_engine(config)
        app = build_app(served, server_config)
        # uvicorn raises the SIGTERM it shut down on again once it has restored the handler it found: a no-op
        # one here lets the stats below be written
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        uvicorn.Server(uvicorn_config(app, server_config, "warning", host="127.0.0.1", port=port)).run()
        with open(stats_path, "w") as f:  # the async engine's: the engine's counters and the front end's CPU
            json.dump(app.state.async_engine.stats(), f)


@contextlib.contextmanager
def fake_server(rows: int, stats_path: str, engine: str):
    """A `serve` process for `rows` streams (its engine `thread` or `process`); yields (its base URL, the process) once
    /health answers, and stops it (SIGTERM, then SIGKILL after 30 s) on exit."""
    port = free_port()
    log_path = stats_path + ".log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.serving_capacity", "--serve", str(port), "--rows",
                                 str(rows), "--stats", stats_path, "--engine", engine],
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fake server did not start:\n{log_tail(log_path)}")
            time.sleep(0.2)
        yield url, proc
    finally:
        stop_process(proc)  # SIGTERM: uvicorn shuts down gracefully, then `serve` writes the stats


async def whole_replies(url: str, rows: int) -> dict:
    """`rows` completions at once, each sent whole (not streamed), of the workload `jaxserve bench serve` streams
    (PROMPT_LEN-token prompts, OUTPUT_LEN tokens each), through its raw-socket client (a connection per request);
    the figures its report reads: output tokens/s over the run's wall time, end-to-end latency (as both TTFT and
    ITL: a whole reply's tokens all come at its end)."""
    target = Target.from_url(url)
    model = request_json("GET", target.url("/v1/models"), None)[1]["data"][0]["id"]

    async def one(i: int) -> tuple[int, float]:
        body = {"model": model, "prompt": [100 + (i + j) % 1000 for j in range(PROMPT_LEN)],
                "max_tokens": OUTPUT_LEN, "ignore_eos": True, "temperature": 0}
        response = await post_streaming(target, request_bytes(target, "/v1/completions", json.dumps(body).encode(),
                                                              None), timeout_s=600)
        seconds = response.end - response.start
        if response.error is not None:
            return -1, seconds
        status, reply, _ = parse_http(response.reads, response.read_times)
        return (json.loads(reply)["usage"]["completion_tokens"] if status == 200 else -1), seconds

    start = time.perf_counter()
    done = await asyncio.gather(*(one(i) for i in range(rows)))
    duration = time.perf_counter() - start
    tokens = sum(n for n, _ in done if n > 0)
    latency = summarize([1000 * s for n, s in done if n > 0])
    return {"output_tokens": tokens, "duration_s": duration, "output_tokens_per_s": tokens / duration,
            "failed": sum(n < 0 for n, _ in done), "latency_ms": {"ttft_ms": latency, "itl_ms": latency},
            "client": None}


def measure(rows: int, engine: str, whole: bool = False) -> dict:
    """One stream count on one engine layout (`whole`: each reply sent whole, not streamed): the client's figures
    and the server's step timing."""
    with tempfile.TemporaryDirectory() as folder:
        stats_path, result_path = os.path.join(folder, "stats.json"), os.path.join(folder, "client.json")
        with fake_server(rows, stats_path, engine) as (url, _):
            if whole:
                asyncio.run(whole_replies(url, rows))  # (a warm-up, as `bench serve` runs its own)
                client = asyncio.run(whole_replies(url, rows))
            else:
                subprocess.run([sys.executable, "-m", "jaxserve", "bench", "serve", "--base-url", url,
                                "--request-rate", "inf", "--max-concurrency", str(rows), "--num-requests", str(rows),
                                "--input-len-dist", "fixed", "--input-len", str(PROMPT_LEN), "--output-len-dist",
                                "fixed", "--output-len", str(OUTPUT_LEN), "--no-progress", "--json", result_path],
                               check=True, stdout=subprocess.DEVNULL)
                with open(result_path) as f:
                    client = json.load(f)["rates"][0]
        with open(stats_path) as f:
            stats = json.load(f)
    timing = stats["timing"]
    latency = client["latency_ms"]
    return {"engine": engine, "streams": rows, "replies": "whole" if whole else "streamed",
            "output_tokens": client["output_tokens"], "duration_s": client["duration_s"],
            "output_tokens_per_s": client["output_tokens_per_s"], "failed": client["failed"],
            "ttft_ms": latency["ttft_ms"], "itl_ms": latency["itl_ms"], "client": client["client"],
            "engine_steps": timing["steps"],
            # the front end's thread from the engine's start (the client's warm-up requests included)
            "front_end_cpu_us_per_token": 1e6 * stats["front_end_cpu_s"] / stats["generation_tokens"],
            "engine_ms_per_step": {key.removesuffix("_ms"): timing[key] for key in timing if key.endswith("_ms")}}


def report(results: list[dict]) -> str:
    """A markdown table of the results."""
    lines = ["| engine | requests | replies | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | engine steps | "
             "host ms per step: schedule / build / update / output / send | front end CPU us per token | failed |",
             "|---|---:|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in results:
        ms = r["engine_ms_per_step"]
        lines.append(f"| {r['engine']} | {r['streams']} | {r['replies']} | {r['output_tokens_per_s']:.0f} | "
                     f"{r['ttft_ms']['p50']:.0f} / "
                     f"{r['ttft_ms']['p99']:.0f} | {r['itl_ms']['p50']:.1f} / {r['itl_ms']['p99']:.1f} | "
                     f"{r['engine_steps']} | {ms['schedule']:.2f} / {ms['build']:.2f} / {ms['update']:.2f} / "
                     f"{ms['output']:.2f} / {ms.get('send', 0.0):.2f} | "
                     f"{r['front_end_cpu_us_per_token']:.1f} | {r['failed']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    """Measure each stream count in turn; print the table (and write the JSON when asked)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--engine", nargs="+", choices=["thread", "process"], default=["thread", "process"],
                        help="the engine's layouts, each measured at every stream count in turn: on a thread of the "
                             "server's process (as before issue 49), in an engine-core process")
    parser.add_argument("--replies", nargs="+", choices=["streamed", "whole"], default=["streamed"],
                        help="each measured at every count in turn: streamed (SSE, through `jaxserve bench serve`), "
                             "or sent whole (the same requests not streamed; end-to-end latency in the TTFT and "
                             "ITL columns)")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the server process
    parser.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--stats", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve, args.rows, args.stats, args.engine[0])
        return []
    results = [measure(rows, engine, replies == "whole") for rows in args.streams for engine in args.engine
               for replies in args.replies]
    print(report(results))
    if args.json:
        write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
