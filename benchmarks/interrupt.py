"""Ctrl-C at each point of a `jaxserve` command: how long the process takes to be gone, and what it prints.

    python benchmarks/interrupt.py                 # every phase, 3 times each
    python benchmarks/interrupt.py --phases compile serve --repeats 1

Each run starts the console script (`python -m jaxserve.console`, as the installed `jaxserve` runs it) on the
bundled model, waits for its phase, sends SIGINT and times until the process has exited:
  import    0.3 s after the start (jax is being imported)
  compile   `generate --no-skip-precompile` with an empty compilation cache, once the step buckets' compiles have
            started (its progress bar on stderr): XLA compiles on worker threads
  generate  `generate` of 100,000 tokens (skip_precompile), once it has streamed some text
  serve     `serve` (skip_precompile), once /health answers 200, and again while a streamed completion runs
Each run must end with exit status 130, `jaxserve: interrupted` on stderr and no traceback.
"""

from __future__ import annotations

import argparse
import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

PHASES = ("import", "compile", "generate", "serve", "serve-streaming")
PROMPT = "def fibonacci(n):"
TIMEOUT_S = 300  # for a phase to be reached


class Command:
    """A `jaxserve` command in a child process, its stdout and stderr collected by reader threads."""

    def __init__(self, argv: list[str]):
        self.process = subprocess.Popen([sys.executable, "-m", "jaxserve.console", *argv], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.output = {"stdout": bytearray(), "stderr": bytearray()}
        self.readers = [threading.Thread(target=self._read, args=(name,), daemon=True) for name in self.output]
        for reader in self.readers:
            reader.start()

    def _read(self, name: str) -> None:
        stream = getattr(self.process, name)
        while chunk := stream.read1(4096):
            self.output[name] += chunk

    def text(self, name: str) -> str:
        """What the command wrote to `name` so far."""
        return self.output[name].decode(errors="replace")

    def wait_for(self, ready, what: str) -> None:
        """Poll `ready()` until true; RuntimeError if the command exits or TIMEOUT_S passes first."""
        deadline = time.monotonic() + TIMEOUT_S
        while not ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"never reached {what}: exit {self.process.poll()}\n{self.text('stderr')[-2000:]}")
            time.sleep(0.05)

    def interrupt(self) -> dict:
        """SIGINT, then wait for the process to end: seconds to exit, its status, and what it printed."""
        sent = time.monotonic()
        self.process.send_signal(signal.SIGINT)
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        exit_s = time.monotonic() - sent
        for reader in self.readers:
            reader.join(timeout=5)
        stderr = self.text("stderr")
        return {"exit_s": exit_s, "exit_code": code, "message": "jaxserve: interrupted" in stderr,
                "traceback": "Traceback" in stderr, "stderr_tail": stderr[-300:]}


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def healthy(port: int) -> bool:
    """Whether the server on `port` answers /health with 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def stream_completion(port: int, received: list[bytes]) -> None:
    """A long streamed completion, its chunks appended to `received` until the connection ends."""
    body = (b'{"model": "tiny-stdlib-llama", "prompt": "def f(x):", "max_tokens": 100000, "stream": true, '
            b'"ignore_eos": true}')
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            while chunk := response.read1(1024):
                received.append(chunk)
    except (OSError, http.client.HTTPException):
        pass  # the server went away: that is the point


def measure(phase: str, cache_dir: str) -> dict:
    """One run of `phase` (PHASES) with the compilation cache `cache_dir` (the compile phase: an empty one)."""
    if phase == "import":
        command = Command(["generate", "--prompt", PROMPT, "--skip-precompile", "--compilation-cache-dir", cache_dir])
        time.sleep(0.3)
    elif phase == "compile":
        empty = tempfile.mkdtemp(prefix="jaxserve-interrupt-cache-")
        command = Command(["generate", "--prompt", PROMPT, "--no-skip-precompile", "--compilation-cache-dir", empty])
        command.wait_for(lambda: "compiling step buckets" in command.text("stderr"), "the compiles")
    elif phase == "generate":
        command = Command(["generate", "--prompt", PROMPT, "--max-tokens", "100000", "--skip-precompile",
                           "--compilation-cache-dir", cache_dir])
        command.wait_for(lambda: len(command.text("stdout")) > len(PROMPT) + 20, "streamed text")
    else:
        port = free_port()
        command = Command(["serve", "--port", str(port), "--skip-precompile", "--compilation-cache-dir", cache_dir,
                           "--log-level", "warning"])
        command.wait_for(lambda: healthy(port), "/health 200")
        if phase == "serve-streaming":
            received: list[bytes] = []
            threading.Thread(target=stream_completion, args=(port, received), daemon=True).start()
            command.wait_for(lambda: len(received) >= 3, "streamed chunks")
    return {"phase": phase, **command.interrupt()}


def main(argv: list[str] | None = None) -> list[dict]:
    """Measure every phase asked for; prints a table and returns the runs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "jaxserve-interrupt-warm-cache"),
                        help="the compilation cache of every phase but `compile` (which starts from an empty one)")
    args = parser.parse_args(argv)
    runs = [measure(phase, args.cache_dir) for phase in args.phases for _ in range(args.repeats)]
    print(f"{'phase':<16}{'exit s':>8}{'status':>8}  message  traceback")
    for run in runs:
        print(f"{run['phase']:<16}{run['exit_s']:>8.3f}{run['exit_code']:>8}  {str(run['message']):<8} "
              f"{run['traceback']}")
    return runs


if __name__ == "__main__":
    main()
