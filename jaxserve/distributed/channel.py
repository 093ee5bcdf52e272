"""The step channel: how the leader of a multi-host launch hands each device call to the followers.

Every process must run the same executables with the same inputs in the same order; only the leader plans them.
Before each device call it sends the call (which runner, which method, its numpy arguments: the step's padded
batch and sampling inputs) to every follower over one TCP connection each, and the followers make the same call
on their own runner. The leader listens on a free port of its host and publishes the address in JAX's distributed
key-value store, so the launch needs no port besides the coordinator's. Messages are length-prefixed MessagePack
(distributed/wire.py: numpy arrays and jaxserve's dataclasses as extension types), never pickles: whatever connects
to a follower's channel can at worst send it a bad step, never make it run code. (A raw TCP connection rather than
ZeroMQ, which the engine-core process uses: a peer that dies closes it, and both sides know at once.)

A process that dies closes its connections, so the other side knows at once (a collective with a dead peer would
wait forever): the leader's watcher thread reports a lost follower, a follower's `receive` a lost leader.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import threading
from collections.abc import Callable

from jax._src import distributed as jax_distributed

from jaxserve.distributed.runtime import ProcessGroup

logger = logging.getLogger("jaxserve")
ADDRESS_KEY = "jaxserve/step_channel"  # the leader's channel address in the distributed key-value store
STOP = ("stop",)  # the leader's last message: followers return from their loop
_HEADER = struct.Struct("!Q")  # each message's byte length


class PeerLost(RuntimeError):
    """A process of the launch has gone: the engine cannot step any more."""


class LeaderChannel:
    """The leader's end: one connection to each follower, accepted at start-up."""

    def __init__(self, group: ProcessGroup, timeout_s: float):
        from jaxserve.distributed import wire  # msgspec: imported by multi-host launches only

        self._wire = wire
        self.lost: str | None = None  # why the launch broke, once it has
        self._on_lost: list[Callable[[str], None]] = []
        self._closing = False
        server = socket.create_server(("", 0))
        server.settimeout(timeout_s)
        port = server.getsockname()[1]
        jax_distributed.global_state.client.key_value_set(ADDRESS_KEY, f"{group.coordinator_host}:{port}")
        self._followers: dict[int, socket.socket] = {}  # process id -> connection
        try:
            while len(self._followers) < group.num_processes - 1:
                try:
                    connection, _ = server.accept()
                except TimeoutError as error:
                    missing = sorted(set(range(1, group.num_processes)) - set(self._followers))
                    raise PeerLost(f"followers {missing} did not connect to the step channel within "
                                   f"{timeout_s:g} s") from error
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                connection.settimeout(None)
                (process_id,) = _HEADER.unpack(_receive_exactly(connection, _HEADER.size))
                self._followers[process_id] = connection
        finally:
            server.close()
        self._watcher = threading.Thread(target=self._watch, name="jaxserve-followers", daemon=True)
        self._watcher.start()

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` (on the watcher thread) when a follower goes."""
        self._on_lost.append(callback)

    def send(self, message: tuple) -> None:
        """Hand one message to every follower; PeerLost once one has gone."""
        if self.lost is not None:
            raise PeerLost(self.lost)
        payload = self._wire.encode(message)
        frame = _HEADER.pack(len(payload)) + payload
        for process_id, connection in self._followers.items():
            try:
                connection.sendall(frame)
            except OSError as error:
                self._report(f"follower {process_id} is gone ({error})")
                raise PeerLost(self.lost) from error

    def close(self) -> None:
        """Tell the followers to stop (they return from their loop) and close the connections."""
        if self._closing:
            return
        self._closing = True
        if self.lost is None:
            try:
                self.send(STOP)
            except PeerLost:
                pass
        for connection in self._followers.values():
            connection.close()

    def _watch(self) -> None:
        """Followers send nothing after their handshake: a readable connection is one that closed."""
        connections = {connection: process_id for process_id, connection in self._followers.items()}
        while not self._closing:
            try:
                readable, _, _ = select.select(list(connections), [], [], 0.5)
            except (OSError, ValueError):  # closed by close()
                return
            for connection in readable:
                if self._closing:
                    return
                try:
                    data = connection.recv(1)
                except OSError:
                    data = b""
                if not data:
                    self._report(f"follower {connections[connection]} is gone (its connection closed)")
                    return

    def _report(self, reason: str) -> None:
        if self.lost is not None or self._closing:
            return
        self.lost = reason
        logger.error("multi-host launch broken: %s", reason)
        for callback in self._on_lost:
            try:
                callback(reason)
            except Exception:
                logger.exception("a lost-follower callback failed")


class FollowerChannel:
    """A follower's end: the connection to the leader."""

    def __init__(self, group: ProcessGroup, timeout_s: float):
        from jaxserve.distributed import wire  # msgspec: imported by multi-host launches only

        self._wire = wire
        client = jax_distributed.global_state.client
        address = client.blocking_key_value_get(ADDRESS_KEY, int(timeout_s * 1000))
        host, _, port = address.rpartition(":")
        self._connection = socket.create_connection((host, int(port)), timeout=timeout_s)
        self._connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._connection.settimeout(None)
        self._connection.sendall(_HEADER.pack(group.process_id))

    def receive(self) -> tuple:
        """The leader's next message; PeerLost when the leader has gone without saying stop."""
        try:
            (size,) = _HEADER.unpack(_receive_exactly(self._connection, _HEADER.size))
            return self._wire.decode(_receive_exactly(self._connection, size))
        except (OSError, EOFError) as error:
            raise PeerLost(f"the leader is gone ({error or 'its connection closed'})") from error

    def close(self) -> None:
        self._connection.close()


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    """`size` bytes from `connection`; EOFError if it closes first."""
    buffer = bytearray(size)
    view, received = memoryview(buffer), 0
    while received < size:
        count = connection.recv_into(view[received:])
        if count == 0:
            raise EOFError("the connection closed")
        received += count
    return bytes(buffer)
