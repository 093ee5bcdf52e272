"""Several front-end processes over the same engine-core processes (`jaxserve serve --api-server-count N`).

The first front end is the `serve` process itself: it starts the engine-core processes, serves HTTP like the others
and supervises them. The other N - 1 are spawned once the cores are ready (`run_front_end`): each joins every core
(EngineCoreClient.join) and serves the same port, the kernel spreading connections over them (SO_REUSEPORT). A
front end that dies is started again, and the core aborts its requests (their pages come back); the cores keep
serving the other front ends. The request metrics of every front end are summed on /metrics (prometheus-client's
multiprocess mode, in a folder `prepare_metrics` makes before prometheus-client is imported); the engine's come
from the cores, the same in each, and each engine step is counted by the first front end only.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import resource
import shutil
import signal
import socket
import tempfile
import threading

from jaxserve.config import EngineConfig
from jaxserve.engine.core_client import CoreAddress, EngineCoreClient
from jaxserve.engine.core_process import die_with_parent
from jaxserve.engine.replicas import DataParallelEngine
from jaxserve.logs import configure_logging
from jaxserve.server.config import ServerConfig

logger = logging.getLogger("jaxserve")
STOP_TIMEOUT_S = 10.0  # how long a front end may take to finish its responses when the server stops
SHUTDOWN_GRACE_S = 5  # uvicorn's timeout_graceful_shutdown: how long a stopping front end lets responses run
RESTART_CHECK_S = 0.5  # how often the supervisor looks for a front end that died
OPEN_FILES_WANTED = 65536  # the soft limit on open files `serve` raises itself to, where the hard limit allows
OPEN_FILES_LOW = 4096  # under this many, `serve` warns: a few thousand connections would reach the limit
OPEN_FILES_RESERVED = 256  # descriptors kept from connections for the process's own (a front end uses about 30)


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files (and so its children's: they inherit it) to the hard limit, at
    most OPEN_FILES_WANTED, and return the limit it leaves. Each client connection holds a file descriptor: Linux's
    usual soft limit, 1024, is reached below a thousand streams, and past it the server can neither accept a client
    nor send its engine core a message. Logs a raise, and warns when the limit stays under OPEN_FILES_LOW."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            logger.info("raised the open files limit from %d to %d (a descriptor per connection)", soft, target)
            soft = target
        except (ValueError, OSError) as error:
            logger.warning("could not raise the open files limit from %d to %d: %s", soft, target, error)
    if soft != resource.RLIM_INFINITY and soft < OPEN_FILES_LOW:
        logger.warning("the open files limit is %d (its hard limit %s): connections past %d at once are answered "
                       "503; raise the hard limit (ulimit -Hn, or the container's nofile)", soft,
                       "unlimited" if hard == resource.RLIM_INFINITY else hard, connection_limit(soft))
    return soft


def connection_limit(open_files_limit: int) -> int | None:
    """uvicorn's `limit_concurrency` for a process allowed `open_files_limit` descriptors: the connections (and
    requests) past it are answered 503 at once, which clients retry, instead of the process running out of
    descriptors (where it could no longer reach its engine core); None (no limit) when open files are unlimited."""
    if open_files_limit == resource.RLIM_INFINITY:
        return None
    return max(open_files_limit - OPEN_FILES_RESERVED, 1)


def uvicorn_config(app, server_config: ServerConfig, log_level: str, **settings):
    """uvicorn's Config of a front end serving `app`: `settings` (`serve`'s TLS and root path, and the host and port
    where it does not serve given sockets) beside what every front end shares: its graceful shutdown, the
    keep-alive timeout, and the 503s past this process's open-files limit (`connection_limit`)."""
    import uvicorn

    open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
                          timeout_keep_alive=server_config.timeout_keep_alive,
                          limit_concurrency=connection_limit(open_files), **settings)


def prepare_metrics() -> str:
    """Make a fresh folder for the front ends' shared request metrics and name it in PROMETHEUS_MULTIPROC_DIR (call
    before prometheus-client is imported: it reads the variable then); returns the folder."""
    folder = tempfile.mkdtemp(prefix="jaxserve-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    return folder


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port that other processes may bind too (SO_REUSEPORT: the kernel spreads the
    connections)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def core_addresses(engine: EngineCoreClient | DataParallelEngine) -> list[CoreAddress]:
    """Where each engine-core process of `engine` listens, in replica order."""
    return [client.core for client in getattr(engine, "replicas", [engine])]


def run_front_end(engine_config: EngineConfig, server_config: ServerConfig, cores: list[CoreAddress], listen: dict,
                  log_level: str) -> None:
    """A front-end process's target: join the cores, serve HTTP on the shared port until SIGTERM (or until a core
    dies)."""
    import uvicorn

    from jaxserve.server.app import build_app

    configure_logging(log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the first front end's; this one ends with it
    die_with_parent()
    clients = [EngineCoreClient.join(engine_config, core, server_config.max_waiting_requests,
                                     server_config.stream_interval) for core in cores]
    engine = clients[0] if len(clients) == 1 else DataParallelEngine(clients)
    app = build_app(engine, server_config, observe_steps=False)
    server = uvicorn.Server(uvicorn_config(app, server_config, log_level, **listen))
    for client in clients:
        client.on_dead = lambda error: setattr(server, "should_exit", True)
    sock = listening_socket(server_config.host, server_config.port)
    server.run(sockets=[sock])


class FrontEnds:
    """The first front end's supervisor of the others: starts them, starts again one that dies, stops them."""

    def __init__(self, count: int, engine_config: EngineConfig, server_config: ServerConfig,
                 cores: list[CoreAddress], listen: dict, log_level: str, metrics_folder: str):
        self._args = (engine_config, server_config, cores, listen, log_level)
        self._metrics_folder = metrics_folder
        self._context = multiprocessing.get_context("spawn")
        self.processes = [self._spawn() for _ in range(count)]
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="jaxserve-front-ends", daemon=True)
        self._watcher.start()

    def _spawn(self) -> multiprocessing.process.BaseProcess:
        process = self._context.Process(target=run_front_end, args=self._args, name="jaxserve-front-end",
                                        daemon=True)
        process.start()
        logger.info("front end process %d started", process.pid)
        return process

    def _watch(self) -> None:
        """Start again every front end that has died (until `stop`)."""
        while not self._stopping.wait(RESTART_CHECK_S):
            for index, process in enumerate(self.processes):
                if not process.is_alive() and not self._stopping.is_set():
                    logger.error("front end process %d died (exit code %s); starting another", process.pid,
                                 process.exitcode)
                    self.processes[index] = self._spawn()

    def stop(self) -> None:
        """Stop every front end (SIGTERM: each finishes its responses), killing one still there after
        STOP_TIMEOUT_S; then drop the shared metrics folder."""
        self._stopping.set()
        self._watcher.join()
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
        shutil.rmtree(self._metrics_folder, ignore_errors=True)
