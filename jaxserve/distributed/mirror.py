"""The leader's device calls, made by every process: `Mirrored` sends each call to the followers before making it
here; `follow` is a follower's whole life after start-up, making the calls it receives on its own runners.

A follower builds the same engine core as the leader (weights, KV pool, executables: its share of each global
array) but its scheduler never sees a request: the leader's calls carry everything a step needs (the padded batch
and sampling inputs, the page copies), and the device state they change (the KV pool, the last step's samples)
changes alike on every process. Results stay where they are: the leader reads its copy of the replicated outputs.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from jaxserve.distributed.channel import STOP, FollowerChannel, LeaderChannel, PeerLost

logger = logging.getLogger("jaxserve")
# A process whose peer died ends this long after (with EXIT_PEER_LOST), time for the server to answer /health with
# 503 and fail its requests: its collectives would wait for the dead peer forever, and so would JAX's shutdown.
PEER_LOST_EXIT_S = 3.0
EXIT_PEER_LOST = 1
# The runner methods that touch the device after start-up, by runner: each is mirrored.
MIRRORED_METHODS = {
    "runner": ("dispatch", "dispatch_forward", "dispatch_sampler", "swap", "set_lora", "update_weights"),
    "draft": ("propose",),
}


class Mirrored:
    """A runner whose device calls (MIRRORED_METHODS[name]) every follower makes too; the rest is the runner's."""

    def __init__(self, runner, name: str, channel: LeaderChannel):
        self._runner, self._name, self._channel = runner, name, channel
        for method in MIRRORED_METHODS[name]:
            setattr(self, method, self._mirror(method))

    def _mirror(self, method: str):
        local = getattr(self._runner, method)

        def call(*args, **kwargs):
            sent = args[1:] if method == "dispatch_sampler" else args  # a follower samples its own forward
            self._channel.send((self._name, method, sent, kwargs))
            return local(*args, **kwargs)

        call.__doc__ = local.__doc__
        return call

    def __getattr__(self, attribute: str):
        return getattr(self._runner, attribute)


def follow(runners: dict, channel: FollowerChannel) -> None:
    """Make the leader's device calls on `runners` (by MIRRORED_METHODS name) until it says stop; PeerLost when
    the leader goes without saying it."""
    forward = None  # this process's half-dispatched step (dispatch_forward), for the dispatch_sampler after it
    while True:
        message = channel.receive()
        if tuple(message) == STOP:  # (a list once decoded)
            return
        name, method, args, kwargs = message
        if method == "dispatch_forward":
            forward = runners[name].dispatch_forward(*args, **kwargs)
        elif method == "dispatch_sampler":
            runners[name].dispatch_sampler(forward, *args, **kwargs)
        else:
            getattr(runners[name], method)(*args, **kwargs)


def _end_broken(reason: str) -> None:
    """End the process with EXIT_PEER_LOST now, whatever its threads wait for (a lost peer's collectives, and
    JAX's shutdown barrier, never return)."""
    print(f"jaxserve: error: the multi-host launch is broken ({reason}); exiting", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)


def exit_soon(reason: str) -> None:
    """End the process PEER_LOST_EXIT_S from now (the leader: time to answer /health with 503 and fail its
    requests)."""
    timer = threading.Timer(PEER_LOST_EXIT_S, _end_broken, args=(reason,))
    timer.daemon = True
    timer.start()


def serve_leader(runners: dict, channel: FollowerChannel) -> None:
    """A follower's life: follow the leader until it says stop (then the process leaves the distributed runtime
    at exit, runtime.py); when the leader is lost, exit non-zero at once (nothing would finish)."""
    try:
        follow(runners, channel)
    except PeerLost as error:
        logger.error("%s", error)
        _end_broken(str(error))
    channel.close()
