"""The engine-core process: one engine's step loop and nothing else, its requests and results as messages over
ZeroMQ (engine/core_messages.py) from and to the front ends (engine/core_client.py), which tokenize, detokenize,
check stop strings and serve HTTP in processes of their own.

The loop, vLLM V1's busy loop: take every message waiting (blocking only while the engine is idle), run one step,
send each front end its samples' deltas in one message; never more than MAX_UNACKED_STEPS messages ahead of a
front end. A front end says `Hello` first; the core answers `Ready`
once the engine has started. The core stops on `Shutdown`, and on its own when the process that started it is
gone (no engine is left behind a front end that died). An exception in the loop ends the process with the
traceback in its log and a non-zero exit code; the front ends see the process end.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import time
from collections.abc import Callable

import msgspec
import zmq

from jaxserve.config import EngineConfig
from jaxserve.engine.core_messages import (
    ENCODER,
    TO_CORE,
    Abort,
    Ack,
    AddRequests,
    Call,
    CallResult,
    DeltaCursor,
    FinishSamples,
    Hello,
    NewRequest,
    Ready,
    RequestFailed,
    Shutdown,
    StepOutputs,
)
from jaxserve.engine.llm_engine import LLMEngine, model_facts
from jaxserve.engine.served_model import kv_cache_facts
from jaxserve.logs import configure_logging
from jaxserve.lora_request import LoRARequest
from jaxserve.request import Request, RequestStatus

logger = logging.getLogger("jaxserve")
IDLE_POLL_MS = 500  # how often an idle core looks for its parent
PARENT_CHECK_S = 0.5  # how often a busy core does
# StepOutputs a front end may have in hand unprocessed before the core waits for it: the core runs at most this far
# ahead of its slowest front end, so a front end that cannot keep up gets several tokens per step message instead of
# an ever longer queue (latency and memory without bound).
MAX_UNACKED_STEPS = 32
PR_SET_PDEATHSIG = 1  # prctl's option: the signal this process gets when its parent ends
# The engine methods a front end may call between steps, and how each call's message arguments become theirs.
CORE_CALLS: dict[str, Callable[..., tuple]] = {
    "reset_prefix_cache": lambda: (),
    "kv_page_states": lambda: (),
    "update_weights": lambda path: (str(path),),
    "sleep": lambda level: (int(level),),
    "wake_up": lambda: (),
    "add_lora": lambda lora: (LoRARequest(**lora),),
    "remove_lora": lambda name: (str(name),),
}


def run_engine_core(config: EngineConfig, address: str, log_level: int = logging.INFO,
                    make_engine: Callable[[EngineConfig], LLMEngine] | None = None, first_device: int = 0) -> None:
    """The core process's target: bind `address`, start the engine of `config` over the devices from `first_device`
    on (or `make_engine(config)`, a module-level function, e.g. a benchmark's fake runner), serve front ends until
    Shutdown."""
    configure_logging(log_level)
    # Ctrl-C is the front end's to answer (a terminal sends it to the whole process group); the core ends with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.bind(address)  # before the engine loads, so front ends that start meanwhile connect at once
    try:
        engine = (make_engine(config) if make_engine is not None
                  else LLMEngine(config, show_progress=False, first_device=first_device))
        EngineCoreLoop(engine, socket).run()
    finally:
        socket.close(linger=1000)  # a last message (a CallResult, the final outputs) still goes out
        context.term()


def die_with_parent() -> None:
    """Have Linux kill this process when the one that started it ends, even while the engine is still loading
    (elsewhere the loop's parent check does it, once the engine runs)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def front_end_identity(pid: int) -> bytes:
    """The ZeroMQ identity of the front end of process `pid` (the core reads the process back from it)."""
    return f"front-end-{pid}".encode()


def front_end_pid(identity: bytes) -> int:
    """The process id in a front end's identity."""
    return int(identity.decode().rpartition("-")[2])


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (a zombie, ended but not yet reaped, has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel (a zombie counts as alive here)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


class EngineCoreLoop:
    """Applies the front ends' messages to an engine and steps it, each front end getting its own samples' deltas."""

    def __init__(self, engine: LLMEngine, socket: zmq.Socket):
        self.engine, self.core, self.socket = engine, engine.core, socket
        self.cursor = DeltaCursor()
        self._owner: dict[str, bytes] = {}  # sample id -> the identity of the front end that sent its request
        self._front_ends: set[bytes] = set()
        self._unacked: dict[bytes, int] = {}  # front end -> StepOutputs sent that it has not processed yet
        self._counters_moved = False  # a message since the last StepOutputs may have moved the counters
        self._parent = os.getppid()
        self._parent_checked = time.monotonic()

    def ready(self) -> Ready:
        """The Ready message: the engine's facts for a front end."""
        engine = self.engine
        return Ready(engine.model_path, model_facts(self.core), kv_cache_facts(engine), engine.list_loras(),
                     self.engine.stats())

    def run(self) -> None:
        """Serve until Shutdown or until the parent process is gone."""
        while True:
            busy = self.core.has_unfinished_requests() and not self._waiting_for_front_end()
            if not self._receive(0 if busy else IDLE_POLL_MS) or self._orphaned():
                return
            if self._waiting_for_front_end():
                continue
            if self.core.has_unfinished_requests():
                changed = self.core.step()
                self._send_outputs(changed)
            elif self._counters_moved:
                self._send_outputs([])  # the counters the last messages moved (aborts, calls), to every front end

    def _waiting_for_front_end(self) -> bool:
        """True while a front end has MAX_UNACKED_STEPS step messages in hand unprocessed."""
        return any(count >= MAX_UNACKED_STEPS for count in self._unacked.values())

    def _orphaned(self) -> bool:
        """True once the process that started this one has gone; a front end that has gone has its requests
        aborted (checked every PARENT_CHECK_S)."""
        now = time.monotonic()
        if now - self._parent_checked < PARENT_CHECK_S:
            return False
        self._parent_checked = now
        if os.getppid() != self._parent:
            logger.error("the front end that started this engine core has gone; the core stops")
            return True
        for identity in [i for i in self._front_ends if not process_alive(front_end_pid(i))]:
            self._drop_front_end(identity)
        return False

    def _drop_front_end(self, identity: bytes) -> None:
        """A front end has gone: abort its requests (their pages come back) and forget it."""
        gone = [sample_id for sample_id, owner in self._owner.items() if owner == identity]
        logger.error("front end %s has gone; %d of its samples aborted", identity.decode(), len(gone))
        self._finish(gone, [RequestStatus.FINISHED_ABORTED] * len(gone))
        self._front_ends.discard(identity)
        self._unacked.pop(identity, None)

    def _receive(self, timeout_ms: int) -> bool:
        """Apply every waiting message (waiting up to `timeout_ms` for the first); False on Shutdown."""
        if not self.socket.poll(timeout_ms):
            return True
        while True:
            try:
                identity, payload = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            message = TO_CORE.decode(payload)
            if isinstance(message, Shutdown):
                return False
            self._apply(identity, message)

    def _apply(self, identity: bytes, message) -> None:
        self._counters_moved = self._counters_moved or not isinstance(message, Ack)
        if isinstance(message, AddRequests):
            for new in message.requests:
                self._add(identity, new)
        elif isinstance(message, Abort):
            self._finish(message.sample_ids, [RequestStatus.FINISHED_ABORTED] * len(message.sample_ids))
        elif isinstance(message, FinishSamples):
            self._finish(message.sample_ids, [RequestStatus(s) for s in message.statuses])
        elif isinstance(message, Call):
            self._send(identity, self._call(message))
        elif isinstance(message, Ack):
            self._unacked[identity] = self._unacked.get(identity, 0) - message.count
        elif isinstance(message, Hello):
            self._front_ends.add(identity)
            self._send(identity, self.ready())

    def _add(self, identity: bytes, new: NewRequest) -> None:
        """Build a request's samples as the in-process engine would, and queue them; RequestFailed when it cannot."""
        engine, queued = self.engine, []
        try:
            if new.pooling is not None:
                _, children = engine.make_pooling_requests(new.request_id, new.prompt_token_ids, new.pooling,
                                                           new.priority, cache_salt=new.cache_salt,
                                                           lora_name=new.lora_name, task=new.task)
            else:
                _, children = engine.make_requests(new.request_id, new.prompt_token_ids, new.params, new.priority,
                                                   cache_salt=new.cache_salt, lora_name=new.lora_name)
            for child in children:
                self.core.add_request(child)
                self._owner[child.request_id] = identity
                queued.append(child.request_id)
        except Exception as error:  # this request is bad; the engine is fine (nothing of it stays queued)
            self._finish(queued, [RequestStatus.FINISHED_ABORTED] * len(queued))
            self._send(identity, RequestFailed(new.request_id, f"{type(error).__name__}: {error}"))

    def _finish(self, sample_ids: list[str], statuses: list[RequestStatus]) -> None:
        for sample_id, status in zip(sample_ids, statuses):
            if self._owner.pop(sample_id, None) is not None:
                self.core.finish_requests([sample_id], status)
                self.cursor.forget(sample_id)

    def _call(self, call: Call) -> CallResult:
        """Run one of CORE_CALLS; its result, or its error by message and class name."""
        try:
            if call.method not in CORE_CALLS:
                raise ValueError(f"the engine core has no call {call.method!r}")
            result = getattr(self.engine, call.method)(*CORE_CALLS[call.method](*call.args))
            return CallResult(call.call_id, result, None, None)
        except Exception as error:  # handed to the front end that asked
            return CallResult(call.call_id, None, str(error), type(error).__name__)

    def _send_outputs(self, changed: list[Request]) -> None:
        """Each front end's deltas of the samples that moved, and the engine counters."""
        timing = self.core.timing
        with timing.measure("output"):
            by_front_end: dict[bytes, list] = {}
            for request in changed:
                identity = self._owner.get(request.request_id)
                if identity is None:
                    continue  # aborted or finished by its front end meanwhile
                by_front_end.setdefault(identity, []).append(self.cursor.delta(request))
                if request.is_finished:
                    del self._owner[request.request_id]
            stats = self.engine.stats()
            self._counters_moved = False
        with timing.measure("send"):
            for identity in self._front_ends:
                self._send(identity, StepOutputs(by_front_end.get(identity, []), stats))
                self._unacked[identity] = self._unacked.get(identity, 0) + 1

    def _send(self, identity: bytes, message: msgspec.Struct) -> None:
        self.socket.send_multipart((identity, ENCODER.encode(message)), copy=False)
