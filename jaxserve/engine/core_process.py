"""The engine-core process: one engine's step loop and nothing else, its requests and results as messages over
ZeroMQ (engine/core_messages.py) from and to the front ends (engine/core_client.py), which tokenize, detokenize,
check stop strings and serve HTTP in processes of their own.

The loop, vLLM V1's busy loop: take every message waiting (blocking only while the engine is idle), run one step,
send each front end its samples' deltas in one message. A front end says `Hello` first; the core answers `Ready`
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
from jaxserve.lora_request import LoRARequest
from jaxserve.request import Request, RequestStatus

logger = logging.getLogger("jaxserve")
IDLE_POLL_MS = 500  # how often an idle core looks for its parent
PARENT_CHECK_S = 0.5  # how often a busy core does
PR_SET_PDEATHSIG = 1  # prctl's option: the signal this process gets when its parent ends
# The engine methods a front end may call between steps, and how each call's message arguments become theirs.
CORE_CALLS: dict[str, Callable[..., tuple]] = {
    "reset_prefix_cache": lambda: (),
    "update_weights": lambda path: (str(path),),
    "sleep": lambda level: (int(level),),
    "wake_up": lambda: (),
    "add_lora": lambda lora: (LoRARequest(**lora),),
    "remove_lora": lambda name: (str(name),),
}


def run_engine_core(config: EngineConfig, address: str, log_level: int = logging.INFO,
                    make_engine: Callable[[EngineConfig], LLMEngine] | None = None) -> None:
    """The core process's target: bind `address`, start the engine of `config` (`make_engine(config)`, a
    module-level function, e.g. a benchmark's fake runner; default LLMEngine), serve front ends until Shutdown."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    # Ctrl-C is the front end's to answer (a terminal sends it to the whole process group); the core ends with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.bind(address)  # before the engine loads, so front ends that start meanwhile connect at once
    try:
        engine = make_engine(config) if make_engine is not None else LLMEngine(config, show_progress=False)
        EngineCoreLoop(engine, socket).run()
    finally:
        socket.close(linger=1000)  # a last message (a CallResult, the final outputs) still goes out
        context.term()


def _die_with_parent() -> None:
    """Have Linux kill this process when the one that started it ends, even while the engine is still loading
    (elsewhere the loop's parent check does it, once the engine runs)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class EngineCoreLoop:
    """Applies the front ends' messages to an engine and steps it, each front end getting its own samples' deltas."""

    def __init__(self, engine: LLMEngine, socket: zmq.Socket):
        self.engine, self.core, self.socket = engine, engine.core, socket
        self.cursor = DeltaCursor()
        self._owner: dict[str, bytes] = {}  # sample id -> the identity of the front end that sent its request
        self._front_ends: set[bytes] = set()
        self._last_stats: dict | None = None
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
            busy = self.core.has_unfinished_requests()
            if not self._receive(0 if busy else IDLE_POLL_MS) or self._orphaned():
                return
            if self.core.has_unfinished_requests():
                changed = self.core.step()
                self._send_outputs(changed)
            elif self._front_ends:
                self._send_outputs([])  # counters moved by the last messages (aborts, calls)

    def _orphaned(self) -> bool:
        """True once the process that started this one has gone (checked every PARENT_CHECK_S)."""
        now = time.monotonic()
        if now - self._parent_checked < PARENT_CHECK_S:
            return False
        self._parent_checked = now
        if os.getppid() != self._parent:
            logger.error("the front end that started this engine core has gone; the core stops")
            return True
        return False

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
        if isinstance(message, AddRequests):
            for new in message.requests:
                self._add(identity, new)
        elif isinstance(message, Abort):
            self._finish(message.sample_ids, [RequestStatus.FINISHED_ABORTED] * len(message.sample_ids))
        elif isinstance(message, FinishSamples):
            self._finish(message.sample_ids, [RequestStatus(s) for s in message.statuses])
        elif isinstance(message, Call):
            self._send(identity, self._call(message))
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
        """Each front end's deltas of the samples that moved, with the counters when they changed."""
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
            moved = stats != self._last_stats
            self._last_stats = stats
        with timing.measure("send"):
            for identity in self._front_ends:
                deltas = by_front_end.get(identity, [])
                if deltas or moved:
                    self._send(identity, StepOutputs(deltas, stats if moved else None))

    def _send(self, identity: bytes, message: msgspec.Struct) -> None:
        self.socket.send_multipart((identity, ENCODER.encode(message)), copy=False)
