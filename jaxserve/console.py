"""The `jaxserve` console script: Ctrl-C first, then the command line (jaxserve/cli.py).

Ctrl-C ends a command at once, wherever it is: importing, loading weights, compiling (XLA compiles on worker
threads the interpreter would otherwise wait for at exit), generating or serving. Python runs a signal handler
only when the main thread is back in the interpreter, which a long C call (an XLA compile, a device wait) can
delay for tens of seconds, so the handler that acts is a thread woken by the signal's byte on a pipe
(`signal.set_wakeup_fd`, written by Python's C-level handler the moment the signal arrives): it prints one line
and ends the process with status 130, the shell's code for SIGINT, without a traceback. The engine starts no
child process, so nothing is left running. SIGTERM keeps its own behaviour (the server's graceful shutdown).

This module imports nothing of jaxserve's before the handler is in place (the package's own imports are lazy),
so even the seconds spent importing jax are covered.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # 130
MESSAGE = b"\njaxserve: interrupted\n"


def exit_on_interrupt() -> None:
    """From now on, SIGINT ends the process within milliseconds: one line on stderr, exit status 130."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # the C-level handler must never block on it
    signal.signal(signal.SIGINT, lambda signum, frame: _exit())  # (a Python handler: the C one then writes the fd)
    signal.set_wakeup_fd(write_fd)
    threading.Thread(target=_watch, args=(read_fd,), name="jaxserve-interrupt", daemon=True).start()


def _watch(read_fd: int) -> None:
    """Wait for a SIGINT's byte on the wakeup pipe (each signal writes its number), then exit."""
    while True:
        if signal.SIGINT in os.read(read_fd, 64):
            _exit()


def _exit() -> None:
    """One line on stderr, then end the process at once (no atexit handlers: they would wait for compiles)."""
    os.write(sys.stderr.fileno(), MESSAGE)
    os._exit(INTERRUPTED_EXIT_CODE)


def main() -> int:
    """Entry point of the `jaxserve` console script."""
    exit_on_interrupt()
    from jaxserve.cli import main as run_command

    return run_command()


if __name__ == "__main__":
    sys.exit(main())
