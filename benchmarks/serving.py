#!/usr/bin/env python
"""Serving benchmark: `jaxserve serve` start-up time, and streamed serving throughput vs offline `LLM.generate`.

Measures, on the bundled default model (jaxserve/assets/tiny-stdlib-llama, configs/tiny-cpu.yaml):

1. start-up time: from launching `python -m jaxserve.cli serve --port P --compilation-cache-dir D
   --log-level warning` as a subprocess until GET /health answers 200 (polled every 50 ms; the server
   binds only after loading and compiling). "cold" uses a brand-new empty cache folder D, "warm" a
   second launch on the same, now filled, D. Goals: cold < 30 s, warm < 10 s.
2. throughput: N requests (prompts of deterministic Python-like source lines, ~16..128 tokens), each
   max_tokens M, temperature 0, ignore_eos (so each produces exactly M tokens), with the same engine
   options (--max-num-seqs, --max-num-batched-tokens, one shared compilation cache) on both sides:
   (a) offline: `LLM.generate(all prompts)` in a separate worker process (idle while the server runs),
       after an untimed warm-up generate;
   (b) server: `jaxserve serve` (idle while the offline worker runs), after an untimed warm-up request;
       N concurrent streaming POST /v1/completions, each on its own raw asyncio connection, timed from
       the first request sent to the end of the last stream. The client only collects raw bytes while
       the clock runs and parses HTTP and the SSE events afterwards, since it shares the CPU with the
       server.
   Output tok/s = completion tokens / elapsed (server: from each stream's final usage chunk). The
   greedy streamed text of every request is checked against the offline text of the same prompt.
   Offline and server runs alternate --repeats times; the report gives the best of each, their ratio
   (goal server/offline >= 0.90) and the per-repeat ratios.

Every server and the worker are killed at the end, whatever happens.

Example:
    python benchmarks/serving.py                                   # 64 requests x 128 tokens, 2 repeats
    python benchmarks/serving.py --num-requests 8 --max-tokens 16 --repeats 1    # smoke run
    python benchmarks/serving.py --skip-startup --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

STARTUP_GOALS_S = {"cold": 30.0, "warm": 10.0}
RATIO_GOAL = 0.90
HEALTH_POLL_S = 0.05
WORKER_MARK = "@@serving-bench@@ "  # prefix of the worker's protocol lines on its stdout


# ---- server processes ---------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def log_tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


class Server:
    """A `jaxserve serve` subprocess; output goes to a log file. Use as a context manager: always killed."""

    def __init__(self, args, port: int, cache_dir: str, log_path: str, engine_flags: list[str] = ()):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.argv = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port),
                     "--compilation-cache-dir", cache_dir, "--log-level", "warning", *engine_flags]
        self.proc: subprocess.Popen | None = None
        self.startup_timeout_s = args.startup_timeout

    @property
    def command(self) -> str:
        return " ".join(shlex.quote(a) for a in self.argv)

    def __enter__(self) -> "Server":
        if port_in_use(self.port):
            raise RuntimeError(f"port {self.port} is already in use; pick another --port (or 0 for a free one)")
        return self

    def start_and_wait(self) -> float:
        """Launch, poll GET /health every 50 ms; seconds from launch to the first 200."""
        with httpx.Client(timeout=2.0, trust_env=False) as client, open(self.log_path, "wb") as log:
            t0 = time.perf_counter()
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
            deadline = t0 + self.startup_timeout_s
            while True:
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return time.perf_counter() - t0
                except httpx.TransportError:
                    pass
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with code {self.proc.returncode} before it was healthy; "
                                       f"log {self.log_path}:\n{log_tail(self.log_path)}")
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"the server was not healthy after {self.startup_timeout_s:.0f}s; "
                                       f"log {self.log_path}:\n{log_tail(self.log_path)}")
                time.sleep(HEALTH_POLL_S)

    def __exit__(self, *exc) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen | None, grace_s: float = 30.0) -> None:
    """terminate, wait; kill if it lingers."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- 1. start-up time -----------------------------------------------------------------------------

def measure_startup(args, workdir: str, log) -> dict:
    cache_dir = os.path.join(workdir, "startup-xla-cache")
    os.makedirs(cache_dir)  # brand-new and empty: the cold launch
    result = {"cache_dir": cache_dir, "commands": {}}
    for label in ("cold", "warm"):
        port = args.port or free_port()
        with Server(args, port, cache_dir, os.path.join(workdir, f"server-startup-{label}.log")) as server:
            log(f"startup {label}: {server.command}")
            seconds = server.start_and_wait()
        result[label] = seconds
        result["commands"][label] = server.command
        files = sum(len(f) for _, _, f in os.walk(cache_dir))
        log(f"  healthy after {seconds:.2f}s (goal < {STARTUP_GOALS_S[label]:.0f}s); cache now holds {files} files")
        result[f"cache_files_after_{label}"] = files
    return result


# ---- 2a. offline worker -----------------------------------------------------------------------------

IDENTS = ["x", "y", "value", "items", "result", "count", "name", "path", "data", "index", "key", "node", "buf",
          "line", "total", "offset", "parts", "state", "config", "other"]
FUNCS = ["parse", "load", "update", "merge", "visit", "encode", "resolve", "split", "render", "collect"]
CLASSES = ["Parser", "Loader", "Node", "Buffer", "Config", "Visitor", "Cache", "Reader"]
MODULES = ["os", "sys", "re", "json", "itertools", "collections", "functools", "pathlib"]


def source_line(rng: random.Random) -> str:
    """One line of plausible Python."""
    a, b, c = rng.sample(IDENTS, 3)
    n = rng.randint(0, 99)
    f, cls, mod = rng.choice(FUNCS), rng.choice(CLASSES), rng.choice(MODULES)
    return rng.choice([
        f"def {f}_{a}({b}, {c}=None):",
        f"    {a} = {b} + {n}",
        f"    if {a} > {n}:",
        f"        return {b}",
        f"    for {a} in range({n}):",
        f"        {a}.append({b}[{c}])",
        f"import {mod}",
        f"from {mod} import {f}",
        f"class {cls}(object):",
        f"    self.{a} = {b}",
        f"    {a} = {mod}.{f}({b}, {c})",
        f"    while {a} < len({b}):",
        f"        {a} += {n}",
        f"    return {a}, {b}",
        f"# {f} the {a} of each {b}",
        f"    {a} = [{b} for {b} in {c} if {b}]",
        f"    raise ValueError('bad {a}: %r' % ({b},))",
    ])


def make_prompts(tokenizer, num: int, min_tokens: int, max_tokens: int, seed: int) -> list[str]:
    """Deterministic prompts of source lines, each about uniform[min_tokens, max_tokens] tokens long."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        target = rng.randint(min_tokens, max_tokens)
        lines = [source_line(rng)]
        while len(tokenizer.encode("\n".join(lines))) < target:
            lines.append(source_line(rng))
        if len(lines) > 1 and len(tokenizer.encode("\n".join(lines))) > max_tokens:
            lines.pop()
        prompts.append("\n".join(lines) + "\n")
    return prompts


def offline_worker() -> int:
    """The offline side (`--offline-worker`): a JSON config on the first stdin line, then one timed
    generate per "run" line; protocol lines on stdout start with WORKER_MARK."""

    def send(obj):
        print(WORKER_MARK + json.dumps(obj), flush=True)

    config = json.loads(sys.stdin.readline())
    from jaxserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(show_progress=False, **config["engine"])
    build_s = time.perf_counter() - t0
    prompts = make_prompts(llm.get_tokenizer(), config["num_requests"], config["min_prompt"], config["max_prompt"],
                           config["seed"])
    params = SamplingParams(temperature=0.0, max_tokens=config["max_tokens"], ignore_eos=True)
    warm = prompts[:min(2, len(prompts))]
    llm.generate(warm, params, use_tqdm=False)  # untimed warm-up
    send({"ready": True, "build_s": build_s, "prompts": prompts})
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        send({"elapsed_s": elapsed,
              "prompt_tokens": [len(o.prompt_token_ids) for o in outputs],
              "completion_tokens": [len(o.outputs[0].token_ids) for o in outputs],
              "texts": [o.outputs[0].text for o in outputs]})
    return 0


class OfflineWorker:
    """This script re-run with --offline-worker; always killed on exit."""

    def __init__(self, config: dict, log_path: str):
        self.argv = [sys.executable, os.path.abspath(__file__), "--offline-worker"]
        self.config = config
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "OfflineWorker":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1, start_new_session=True)
        self.proc.stdin.write(json.dumps(self.config) + "\n")
        self.proc.stdin.flush()
        return self

    def receive(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                raise RuntimeError(f"the offline worker exited with code {self.proc.returncode}; "
                                   f"log {self.log_path}:\n{log_tail(self.log_path)}")
            if line.startswith(WORKER_MARK):
                return json.loads(line[len(WORKER_MARK):])

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self.receive()

    def __exit__(self, *exc) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.close()  # EOF: the worker leaves its loop
                self.proc.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            pass
        stop_process(self.proc)
        self._log.close()


# ---- 2b. server client ------------------------------------------------------------------------------

def run_client(coroutine):
    """Run the client on uvloop when it is installed (less client CPU taken from the server), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def request_body(prompt: str, max_tokens: int) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()


async def stream_once(host: str, port: int, body: bytes) -> tuple[int, bytes, float | None, float]:
    """POST one streamed completion over a raw socket (`Connection: close`, so the body ends at EOF);
    (status, de-chunked body, time of the first body bytes, time of the end).

    The client shares the CPU with the server, so while the clock runs it only reads bytes: no HTTP
    parsing per chunk (an HTTP library such as httpx parses every chunk in Python)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
    first = None
    parts = []
    while True:
        data = await reader.read(1 << 16)
        if not data:
            break
        if first is None:
            first = time.perf_counter()
        parts.append(data)
    end = time.perf_counter()
    writer.close()
    head, _, payload = b"".join(parts).partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        payload = dechunk(payload)
    return status, payload, first, end


def dechunk(payload: bytes) -> bytes:
    """The body of an HTTP/1.1 chunked transfer encoding."""
    out, pos = [], 0
    while True:
        line_end = payload.index(b"\r\n", pos)
        size = int(payload[pos:line_end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(payload[line_end + 2:line_end + 2 + size])
        pos = line_end + 2 + size + 2


def parse_stream(status: int, raw: bytes) -> dict:
    """Text, completion tokens (usage chunk) and problems of one streamed completion."""
    problems = []
    if status != 200:
        return {"text": "", "completion_tokens": 0, "problems": [f"HTTP {status}: {raw[:200]!r}"]}
    events = [e for e in raw.decode("utf-8", errors="replace").split("\n\n") if e.strip()]
    if not events or events[-1].strip() != "data: [DONE]":
        problems.append("the stream did not end with data: [DONE]")
    text, usage = [], None
    for event in events:
        if not event.startswith("data: ") or event.strip() == "data: [DONE]":
            continue
        chunk = json.loads(event[len("data: "):])
        if "error" in chunk:
            problems.append(f"error chunk: {chunk['error']}")
        for choice in chunk.get("choices", ()):
            text.append(choice.get("text", ""))
        if chunk.get("usage"):
            usage = chunk["usage"]
    if usage is None:
        problems.append("no usage chunk")
    return {"text": "".join(text), "completion_tokens": usage["completion_tokens"] if usage else 0,
            "problems": problems}


async def serve_run(url: str, prompts: list[str], max_tokens: int, warm_up: bool) -> dict:
    """Optionally a warm-up, then all prompts at once as concurrent streams."""
    host, port = url.removeprefix("http://").split(":")
    port = int(port)
    if warm_up:
        warm = prompts[:min(2, len(prompts))]
        done = await asyncio.gather(*(stream_once(host, port, request_body(p, max_tokens)) for p in warm))
        for status, raw, _, _ in done:
            if parse_stream(status, raw)["problems"]:
                raise RuntimeError(f"warm-up request failed: {parse_stream(status, raw)['problems']}")
    bodies = [request_body(p, max_tokens) for p in prompts]
    t0 = time.perf_counter()
    done = await asyncio.gather(*(stream_once(host, port, body) for body in bodies))
    elapsed = max(end for _, _, _, end in done) - t0
    parsed = [parse_stream(status, raw) for status, raw, _, _ in done]
    ttft = sorted(first - t0 for _, _, first, _ in done if first is not None)
    return {"elapsed_s": elapsed, "completion_tokens": [p["completion_tokens"] for p in parsed],
            "texts": [p["text"] for p in parsed], "problems": [p["problems"] for p in parsed],
            "first_bytes_p50_s": statistics.median(ttft) if ttft else None,
            "first_bytes_max_s": ttft[-1] if ttft else None}


# ---- 2. throughput -----------------------------------------------------------------------------------

def measure_throughput(args, workdir: str, log) -> dict:
    cache_dir = args.compilation_cache_dir or os.path.join(workdir, "throughput-xla-cache")
    engine = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
              "compilation_cache_dir": cache_dir}
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--stream-interval", str(args.stream_interval)]
    config = {"engine": engine, "num_requests": args.num_requests, "max_tokens": args.max_tokens,
              "min_prompt": args.min_prompt, "max_prompt": args.max_prompt, "seed": args.seed}
    expected = args.num_requests * args.max_tokens
    runs = []
    with OfflineWorker(config, os.path.join(workdir, "offline-worker.log")) as worker:
        log(f"offline worker: building LLM({', '.join(f'{k}={v!r}' for k, v in engine.items())}) ...")
        ready = worker.receive()
        prompts = ready["prompts"]
        log(f"  ready (engine built in {ready['build_s']:.1f}s, warm-up done)")
        port = args.port or free_port()
        with Server(args, port, cache_dir, os.path.join(workdir, "server-throughput.log"), flags) as server:
            log(f"server: {server.command}")
            startup_s = server.start_and_wait()
            log(f"  healthy after {startup_s:.2f}s (compilation cache shared with the offline worker)")
            for repeat in range(args.repeats):
                off = worker.run()
                off_tokens = sum(off["completion_tokens"])
                off["tok_per_s"] = off_tokens / off["elapsed_s"]
                log(f"repeat {repeat + 1}/{args.repeats}: offline {off['elapsed_s']:.2f}s, {off_tokens} tokens, "
                    f"{off['tok_per_s']:.1f} tok/s")
                srv = run_client(serve_run(server.url, prompts, args.max_tokens, warm_up=repeat == 0))
                srv_tokens = sum(srv["completion_tokens"])
                srv["tok_per_s"] = srv_tokens / srv["elapsed_s"]
                bad = [i for i, p in enumerate(srv["problems"]) if p]
                for i in bad[:5]:
                    log(f"  !!! request {i}: {'; '.join(srv['problems'][i])}")
                matches = sum(a == b for a, b in zip(srv["texts"], off["texts"]))
                log(f"  server {srv['elapsed_s']:.2f}s, {srv_tokens} tokens, {srv['tok_per_s']:.1f} tok/s "
                    f"(ratio {srv['tok_per_s'] / off['tok_per_s']:.3f}); streamed text == offline text for "
                    f"{matches}/{len(prompts)}")
                if off_tokens != expected or srv_tokens != expected:
                    log(f"  !!! expected {expected} completion tokens on each side")
                for i, (a, b) in enumerate(zip(srv["texts"], off["texts"])):
                    if a != b:
                        log(f"  first text mismatch, request {i}: server {a[:60]!r}... vs offline {b[:60]!r}...")
                        break
                runs.append({"offline_s": off["elapsed_s"], "offline_tok_per_s": off["tok_per_s"],
                             "offline_tokens": off_tokens, "server_s": srv["elapsed_s"],
                             "server_tok_per_s": srv["tok_per_s"], "server_tokens": srv_tokens,
                             "ratio": srv["tok_per_s"] / off["tok_per_s"], "text_matches": matches,
                             "failed_requests": len(bad), "first_bytes_p50_s": srv["first_bytes_p50_s"],
                             "first_bytes_max_s": srv["first_bytes_max_s"]})
            prompt_tokens = off["prompt_tokens"]
    best_off = max(r["offline_tok_per_s"] for r in runs)
    best_srv = max(r["server_tok_per_s"] for r in runs)
    return {"runs": runs, "best_offline_tok_per_s": best_off, "best_server_tok_per_s": best_srv,
            "ratio": best_srv / best_off, "num_requests": len(prompts), "expected_tokens": expected,
            "prompt_tokens_min": min(prompt_tokens), "prompt_tokens_max": max(prompt_tokens),
            "prompt_tokens_mean": statistics.mean(prompt_tokens), "server_startup_s": startup_s,
            "server_command": server.command, "cache_dir": cache_dir}


# ---- report ----------------------------------------------------------------------------------------

def verdict(ok: bool) -> str:
    return "OK" if ok else "MISSED"


def print_report(res: dict, args) -> None:
    out = print
    out("")
    out("## jaxserve serving benchmark")
    out("")
    out("| measurement | value | goal | status |")
    out("|---|---:|---|---|")
    s = res.get("startup")
    if s:
        for label, what in (("cold", "empty compilation cache"), ("warm", "reused compilation cache")):
            out(f"| start-up to /health 200, {label} ({what}) | {s[label]:.2f} s | < {STARTUP_GOALS_S[label]:.0f} s "
                f"| {verdict(s[label] < STARTUP_GOALS_S[label])} |")
    t = res.get("throughput")
    if t:
        runs = t["runs"]
        n = t["num_requests"]
        out(f"| offline `LLM.generate`, best of {len(runs)} | {t['best_offline_tok_per_s']:.1f} tok/s | | |")
        out(f"| server, {n} concurrent streams, best of {len(runs)} | {t['best_server_tok_per_s']:.1f} tok/s | | |")
        out(f"| server / offline (best / best) | {t['ratio']:.3f} | >= {RATIO_GOAL:.2f} "
            f"| {verdict(t['ratio'] >= RATIO_GOAL)} |")
        worst = min(r["text_matches"] for r in runs)
        out(f"| greedy streamed text == offline text (worst repeat) | {worst}/{n} | {n}/{n} | {verdict(worst == n)} |")
        tokens_ok = all(r["offline_tokens"] == r["server_tokens"] == t["expected_tokens"] for r in runs)
        failed = sum(r["failed_requests"] for r in runs)
        out(f"| completion tokens per run (offline / server) | {runs[-1]['offline_tokens']} / {runs[-1]['server_tokens']} "
            f"| {t['expected_tokens']} each | {verdict(tokens_ok and not failed)} |")
        out("")
        out(f"Workload: {n} requests, prompt tokens {t['prompt_tokens_min']}..{t['prompt_tokens_max']} "
            f"(mean {t['prompt_tokens_mean']:.1f}), max_tokens {args.max_tokens}, temperature 0, ignore_eos; "
            f"engine max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens} "
            f"on both sides. Throughput server started in {t['server_startup_s']:.2f}s.")
        out("")
        out("| repeat | offline s | offline tok/s | server s | server tok/s | server/offline | first bytes p50 / max s "
            "| text match | failed |")
        out("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for i, r in enumerate(runs, 1):
            fb = ("-" if r["first_bytes_p50_s"] is None
                  else f"{r['first_bytes_p50_s']:.2f} / {r['first_bytes_max_s']:.2f}")
            out(f"| {i} | {r['offline_s']:.2f} | {r['offline_tok_per_s']:.1f} | {r['server_s']:.2f} "
                f"| {r['server_tok_per_s']:.1f} | {r['ratio']:.3f} | {fb} | {r['text_matches']}/{n} "
                f"| {r['failed_requests']} |")
    out("")
    if s:
        out(f"start-up server command: {s['commands']['cold']}")
    if t:
        out(f"throughput server command: {t['server_command']}")
    out(f"command: {res['command']}")


# ---- main --------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64, help="N concurrent requests (and offline prompts)")
    p.add_argument("--max-tokens", type=int, default=128, help="M tokens per request (EOS ignored)")
    p.add_argument("--repeats", type=int, default=2, help="alternating offline/server timed runs; best of each is used")
    p.add_argument("--min-prompt", type=int, default=16, help="prompt length target range, in tokens")
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    p.add_argument("--max-num-seqs", type=int, default=64, help="engine option, same for offline and server")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="engine option, same for offline and server")
    p.add_argument("--stream-interval", type=int, default=1, help="server option: stream every N tokens")
    p.add_argument("--compilation-cache-dir", default=None,
                   help="cache shared by the offline worker and the throughput server (default: a fresh temporary "
                        "one; start-up always uses its own fresh one)")
    p.add_argument("--port", type=int, default=0, help="server port (0: a free port per launch)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="give up on a server after this many seconds")
    p.add_argument("--skip-startup", action="store_true", help="skip the start-up measurement")
    p.add_argument("--skip-throughput", action="store_true", help="skip the throughput measurement")
    p.add_argument("--keep-workdir", action="store_true", help="keep the temporary folder (server logs, caches)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("num_requests", "max_tokens", "repeats", "min_prompt"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_prompt < args.min_prompt:
        p.error("--max-prompt must be >= --min-prompt")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.offline_worker:
        return offline_worker()
    start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)

    res = {"command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])}
    workdir = tempfile.mkdtemp(prefix="jaxserve-serving-bench-")
    log(f"work folder {workdir} (server logs, compilation caches)")
    try:
        if not args.skip_startup:
            res["startup"] = measure_startup(args, workdir, log)
        if not args.skip_throughput:
            res["throughput"] = measure_throughput(args, workdir, log)
    finally:
        if args.keep_workdir:
            log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print_report(res, args)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
