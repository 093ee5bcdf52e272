"""EngineCoreClient: the async engine the server drives, over an engine-core process (engine/core_process.py).

The front end's half of serving, all on the event loop's thread: it checks and tokenizes requests (its own
RequestMaker), keeps each sample's copy as the core's deltas bring it up to date, detokenizes and checks stop
strings (OutputProcessor), and streams. The core process only schedules and steps. Messages go out batched: every
request submitted, aborted or stopped in one turn of the event loop leaves in one message of each kind.

When the core process ends without being asked to, a message to it cannot be sent or reading its messages fails,
`is_running` turns False at once (/health answers 503), every request still streaming ends with EngineDeadError,
pending calls fail, and `on_dead(error)` runs (the server stops on it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable

import zmq
import zmq.asyncio

from jaxserve.config import EngineConfig
from jaxserve.engine.async_engine import AsyncEngineBase, EngineDeadError
from jaxserve.engine.core_messages import (
    ENCODER,
    FROM_CORE,
    Abort,
    Ack,
    AddRequests,
    Call,
    CallResult,
    FinishSamples,
    Hello,
    NewRequest,
    Ready,
    RequestFailed,
    Shutdown,
    StepOutputs,
    apply_delta,
)
from jaxserve.engine.core_process import front_end_identity, process_alive, run_engine_core
from jaxserve.engine.host_gc import freeze_start_up_objects, tune_garbage_collector
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.request_maker import Prompt, RequestMaker
from jaxserve.engine.served_model import ServedModel
from jaxserve.lora_request import LoRARequest
from jaxserve.pooling.params import PoolingParams
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured.params import StructuredOutputsParams
from jaxserve.tokenizer import load_tokenizer

logger = logging.getLogger("jaxserve")
STOP_TIMEOUT_S = 30.0  # how long a stopping core may take to end before it is killed


# The arguments each made request was built from, by its first sample, until it is submitted (or dropped): any client
# of this process may submit it (data-parallel replicas' requests are all made by replica 0's).
_MADE: weakref.WeakKeyDictionary[Request, NewRequest] = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class CoreAddress:
    """Where an engine-core process listens, and its process id (what another front end needs to join it)."""

    address: str
    pid: int


@dataclasses.dataclass
class _Connection:
    """A front end's end of an engine-core process: the core, our socket, and the process and its socket's folder
    when this front end started it (their owner)."""

    core: CoreAddress
    context: zmq.Context
    socket: zmq.Socket
    process: multiprocessing.process.BaseProcess | None = None
    folder: str | None = None

    def core_alive(self) -> bool:
        return self.process.is_alive() if self.process is not None else process_alive(self.core.pid)

    def close(self) -> None:
        self.socket.close()
        self.context.term()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


class EngineCoreClient(AsyncEngineBase):
    """AsyncLLMEngine's methods over an engine-core process; `launch` starts one and waits until it is ready."""

    def __init__(self, config: EngineConfig, connection: _Connection, ready: Ready, max_waiting_requests: int,
                 stream_interval: int):
        tokenizer = load_tokenizer(config.model_config.tokenizer or ready.model_path)
        # Checked here, placed in the core: the core process builds the requests again under its own LoRA slots
        # and weights version.
        self.requests = RequestMaker(config, ready.model_path, tokenizer, ready.facts,
                                     placement=lambda cache_salt, lora_name: (cache_salt, -1))
        super().__init__(tokenizer, ServedModel.from_parts(config, ready.model_path, self.requests, ready.kv_cache,
                                                           ready.loras),
                         max_waiting_requests, stream_interval, None, None, ready.stats)
        self.config = config
        self.core = connection.core
        self.process = connection.process  # when this front end started the core (None when it joined one)
        self.on_dead: Callable[[BaseException], None] | None = None  # what to do when the core process dies
        self._connection = connection
        self._sync_socket = connection.socket
        # readable once the core's process has ended: its sentinel when we started it, else a pidfd (Linux)
        self._core_watch: int | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._output_processor = OutputProcessor(tokenizer)
        self._samples: dict[str, Request] = {}  # sample id -> the front end's copy
        self._children: dict[str, list[str]] = {}  # request id -> its sample ids
        self._new_requests: list[NewRequest] = []  # this turn of the event loop's messages
        self._aborts: list[str] = []
        self._outbox: list = []
        self._flush_scheduled = False
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._sleeping = False
        self._stopping = False
        self._reader: asyncio.Task | None = None
        tune_garbage_collector()  # outputs allocate as much per token as the engine's steps (engine/host_gc.py)
        freeze_start_up_objects()

    @classmethod
    def launch(cls, config: EngineConfig, max_waiting_requests: int = 1024, stream_interval: int = 1,
               make_engine: Callable[[EngineConfig], object] | None = None) -> EngineCoreClient:
        """Start an engine-core process for `config` (its engine made by `make_engine(config)`, a module-level
        function, when given) and wait until its engine has started; RuntimeError when the process ends first."""
        (client,) = cls.launch_replicas(config, 1, max_waiting_requests, stream_interval, make_engine)
        return client

    @classmethod
    def launch_replicas(cls, config: EngineConfig, count: int, max_waiting_requests: int = 1024,
                        stream_interval: int = 1, make_engine: Callable[[EngineConfig], object] | None = None
                        ) -> list[EngineCoreClient]:
        """Start `count` engine-core processes for `config` at once, replica i over the devices from
        i * tensor_parallel_size on (data parallelism), and wait until every one is ready (`launch`)."""
        tp = config.parallel_config.tensor_parallel_size
        started = [_start(config, replica * tp, make_engine) for replica in range(count)]
        try:
            return [cls(config, each, _wait_ready(each), max_waiting_requests, stream_interval) for each in started]
        except BaseException:
            for each in started:
                each.process.kill()
            raise

    @classmethod
    def join(cls, config: EngineConfig, core: CoreAddress, max_waiting_requests: int = 1024,
             stream_interval: int = 1) -> EngineCoreClient:
        """A client of an engine-core process another front end started (`--api-server-count`), once it is ready;
        RuntimeError when the process has ended."""
        return cls(config, *_connected(core), max_waiting_requests, stream_interval)

    # ---- life cycle (event loop) ---------------------------------------------------------------

    def start(self) -> None:
        """Start reading the core's messages on this event loop, and watching the core's process."""
        self._start_clock()
        self._socket = zmq.asyncio.Socket.shadow(self._sync_socket.underlying)
        self._reader = self._loop.create_task(self._read())
        self._reader.add_done_callback(self._read_ended)
        self._core_watch = self.process.sentinel if self.process is not None else os.pidfd_open(self.core.pid)
        self._loop.add_reader(self._core_watch, self._core_ended)

    async def stop(self) -> None:
        """Stop: the core process this front end started (killed after STOP_TIMEOUT_S), or this front end's requests
        in a core it joined; requests still running here end with EngineDeadError."""
        if self._socket is None or self._stopping:
            return
        self._unwatch()
        if self._connection.core_alive():
            self._flush()
            if self.process is None:
                await self._socket.send(ENCODER.encode(Abort(list(self._samples))))
            else:
                await self._socket.send(ENCODER.encode(Shutdown()))
        self._stopping = True
        if self.process is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.process.join, STOP_TIMEOUT_S)
            if self.process.is_alive():
                logger.error("the engine core process did not stop in %.0f s; killing it", STOP_TIMEOUT_S)
                self.process.kill()
                self.process.join()
        self._reader.cancel()
        self._end_everything(EngineDeadError("the engine was shut down"))
        self._connection.close()

    def _unwatch(self) -> None:
        if self._core_watch is not None:
            self._loop.remove_reader(self._core_watch)
            if self.process is None:  # our pidfd (the sentinel is the process object's)
                os.close(self._core_watch)
            self._core_watch = None

    def fail(self, error: BaseException) -> None:
        """Mark the engine dead (event loop only): every request still streaming ends with `error`."""
        self.error = error
        self._end_everything(error)

    @property
    def is_running(self) -> bool:
        """True while the core process runs and has not failed."""
        return self._reader is not None and self.error is None and not self._stopping

    def _core_ended(self) -> None:
        """The core process has ended unasked: fail everything, then `on_dead`."""
        self._unwatch()
        if self.process is not None:
            self.process.join(1.0)
            how = f"exit code {self.process.exitcode}"
        else:
            how = f"process {self.core.pid}"
        self._broken(f"the engine core process died ({how})")

    def _end_everything(self, error: BaseException) -> None:
        self._fail_streams(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()

    # ---- requests (event loop) -----------------------------------------------------------------

    def make_requests(
        self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0,
        cache_salt: str | None = None, lora_name: str | None = None,
    ) -> tuple[str | None, list[Request]]:
        """Validate one request (ValueError when invalid) without queueing it (RequestMaker.make_requests)."""
        text, children = self.requests.make_requests(request_id, prompt, params, priority, cache_salt=cache_salt,
                                                     lora_name=lora_name)
        _MADE[children[0]] = NewRequest(request_id, children[0].prompt_token_ids, params, None, "", priority,
                                        cache_salt, lora_name)
        return text, children

    def make_pooling_requests(
        self, request_id: str, prompt: Prompt, params: PoolingParams, priority: int = 0,
        cache_salt: str | None = None, lora_name: str | None = None, task: str = "embed",
    ) -> tuple[str | None, list[Request]]:
        """Validate one pooling request of `task` (ValueError when invalid) without queueing it
        (RequestMaker.make_pooling_requests)."""
        params = params or PoolingParams()
        text, children = self.requests.make_pooling_requests(request_id, prompt, params, priority,
                                                             cache_salt=cache_salt, lora_name=lora_name, task=task)
        _MADE[children[0]] = NewRequest(request_id, children[0].prompt_token_ids, None, params, task, priority,
                                        cache_salt, lora_name)
        return text, children

    async def compile_grammar(self, constraint: StructuredOutputsParams) -> None:
        """Check that a request's output constraint compiles (ValueError when not), on this process's grammar
        threads; the core compiles it again for the requests it runs."""
        await asyncio.wrap_future(self.requests.grammars.submit(constraint))

    def _queue_add(self, request_id: str, made: tuple[str | None, list[Request]]) -> None:
        text, children = made
        new = _MADE.pop(children[0])
        if new.request_id != request_id:
            raise ValueError(f"request {request_id!r} was made as {new.request_id!r}: submit it under that id")
        self._output_processor.add_request(request_id, text, children)
        self._children[request_id] = [child.request_id for child in children]
        for child in children:
            self._samples[child.request_id] = child
        self._send(new)

    def _queue_abort(self, request_id: str) -> None:
        sample_ids = self._forget(request_id)
        final = self._output_processor.abort(request_id)
        if final is not None:
            self._observe([final])
        if sample_ids:
            self._send(Abort(sample_ids))

    def _forget(self, request_id: str) -> list[str]:
        """Drop a request's samples; their ids."""
        sample_ids = self._children.pop(request_id, [])
        for sample_id in sample_ids:
            self._samples.pop(sample_id, None)
        return sample_ids

    # ---- commands between steps ----------------------------------------------------------------

    async def reset_prefix_cache(self) -> int:
        """Forget every cached page (between two steps); returns how many were forgotten."""
        return await self._call("reset_prefix_cache")

    async def kv_page_states(self) -> list[list[int]]:
        """The KV pool's map, run-length encoded (between two steps; EngineCore.kv_page_states)."""
        return await self._call("kv_page_states")

    async def update_weights(self, source: str) -> int:
        """Serve new weights from a folder (between two steps; LLMEngine.update_weights); the weights version."""
        if not isinstance(source, str):
            raise ValueError("an engine core process reloads weights from a folder: give its path")
        return await self._call("update_weights", source)

    async def sleep(self, level: int = 1) -> None:
        """Free the devices' memory (between two steps; LLMEngine.sleep)."""
        await self._call("sleep", level)
        self._sleeping = True

    async def wake_up(self) -> None:
        """Take the devices back (between two steps; LLMEngine.wake_up)."""
        await self._call("wake_up")
        self._sleeping = False

    def is_sleeping(self) -> bool:
        """True between `sleep` and `wake_up`."""
        return self._sleeping

    async def add_lora(self, lora_request: LoRARequest) -> str:
        """Load a LoRA adapter into a free slot (between two steps; LLMEngine.add_lora)."""
        return await self._call("add_lora", {"lora_name": lora_request.lora_name,
                                             "lora_int_id": lora_request.lora_int_id,
                                             "lora_path": lora_request.lora_path})

    async def remove_lora(self, name: str) -> None:
        """Free an adapter's slot (between two steps; LLMEngine.remove_lora)."""
        await self._call("remove_lora", name)

    async def _call(self, method: str, *args) -> object:
        """`method(*args)` of the core's engine, between two steps (after the requests submitted before it)."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        call_id = next(self._call_ids)
        done = self._calls[call_id] = self._loop.create_future()
        self._send(Call(call_id, method, list(args)))
        return await done

    # ---- messages ------------------------------------------------------------------------------

    def _send(self, message) -> None:
        """Queue a message; the messages of one turn of the event loop leave together once it has run what is
        ready, new requests and aborts each batched into one (AddRequests, Abort, then the rest in order)."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)
        if isinstance(message, NewRequest):
            self._new_requests.append(message)
        elif isinstance(message, Abort):
            self._aborts.extend(message.sample_ids)
        else:
            self._outbox.append(message)

    def _flush(self) -> None:
        self._flush_scheduled = False
        messages = [AddRequests(self._new_requests)] if self._new_requests else []
        messages += [Abort(self._aborts)] if self._aborts else []
        messages += self._outbox
        self._new_requests, self._aborts, self._outbox = [], [], []
        if not self._stopping and self._connection.core_alive():
            for message in messages:
                self._socket.send(ENCODER.encode(message), copy=False).add_done_callback(self._sent)

    def _sent(self, sending: asyncio.Future) -> None:
        """A message's send has ended. One that failed (the process out of file descriptors, say) leaves the core
        and this front end disagreeing on what runs, with requests that would wait forever."""
        if not sending.cancelled() and sending.exception() is not None:
            self._broken(f"a message to the engine core could not be sent ({sending.exception()!r})")

    def _read_ended(self, reader: asyncio.Task) -> None:
        """The reader has stopped. Only `stop` cancels it: an error in it (applying a step's outputs, say) would
        leave every request waiting for outputs no one reads."""
        if not reader.cancelled() and reader.exception() is not None:
            self._broken(f"reading the engine core's messages failed ({reader.exception()!r})", reader.exception())

    def _broken(self, what: str, cause: BaseException | None = None) -> None:
        """The core has died, or this front end can no longer keep up its side with it: log `what` (with `cause`'s
        traceback), fail everything, then `on_dead` (once)."""
        if self.error is not None:
            return
        error = EngineDeadError(f"{what}; no request can run: restart the server")
        logger.error("%s", error, exc_info=cause)
        self.fail(error)
        if self.on_dead is not None:
            self.on_dead(error)

    async def _read(self) -> None:
        """Apply the core's messages as they come: every message waiting at once, then the event loop's other tasks
        (the responses writing what they brought) get their turn (a receive that finds a message waiting does not
        yield). A front end that falls behind the core so streams several tokens per chunk rather than stalling."""
        while True:
            payloads = [await self._socket.recv(copy=False)]
            while True:
                try:
                    payloads.append(self._sync_socket.recv(zmq.NOBLOCK, copy=False))
                except zmq.Again:
                    break
            steps = 0
            for payload in payloads:
                message = FROM_CORE.decode(payload)
                if isinstance(message, StepOutputs):
                    self._step_outputs(message)
                    steps += 1
                elif isinstance(message, RequestFailed):
                    self._request_failed(message)
                elif isinstance(message, CallResult):
                    self._call_result(message)
            if steps:
                self._send(Ack(steps))
            await asyncio.sleep(0)

    def _step_outputs(self, message: StepOutputs) -> None:
        """Bring the moved samples' copies up to date and their text (stop strings); stream each finished request's
        final output, and hand each running request that moved to its stream, which builds its output when read."""
        changed = []
        for delta in message.deltas:
            request = self._samples.get(delta.sample_id)
            if request is not None:
                apply_delta(request, delta)
                changed.append(request)
        moved, to_finish = self._output_processor.advance(changed)
        if to_finish:
            self._send(FinishSamples([sample_id for sample_id, _ in to_finish], [int(s) for _, s in to_finish]))
        finals, running = [], []
        for state in moved:
            if state.finished:
                finals.append(self._output_processor.output_of(state))
                self._forget(state.request_id)
            else:
                running.append(state)
        if running:
            self._observe_moves(running)
            self._deliver_moves(running)
        if finals:
            self._observe(finals)
            self._deliver(finals)
        self._publish_stats(message.stats)

    def _request_failed(self, message: RequestFailed) -> None:
        self._forget(message.request_id)
        self._output_processor.abort(message.request_id)
        self._fail_stream(message.request_id, ValueError(message.error))

    def _call_result(self, message: CallResult) -> None:
        future = self._calls.pop(message.call_id, None)
        if future is None or future.done():
            return
        if message.error is None:
            future.set_result(message.result)
        else:
            future.set_exception((ValueError if message.error_type == "ValueError" else RuntimeError)(message.error))


def _start(config: EngineConfig, first_device: int, make_engine) -> _Connection:
    """Spawn an engine-core process over the devices from `first_device` on, and connect to it."""
    folder = tempfile.mkdtemp(prefix="jaxserve-core-")
    address = f"ipc://{folder}/engine.sock"
    process = multiprocessing.get_context("spawn").Process(
        target=run_engine_core, args=(config, address, logging.getLogger("jaxserve").getEffectiveLevel(),
                                      make_engine, first_device), name="jaxserve-engine-core", daemon=True)
    process.start()
    logger.info("engine core process %d started (devices from %d on)", process.pid, first_device)
    connection = _connect(CoreAddress(address, process.pid))
    connection.process, connection.folder = process, folder
    return connection


def _connect(core: CoreAddress) -> _Connection:
    """Our socket to the core at `core`, its Hello sent."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, front_end_identity(os.getpid()))
    for option in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
        socket.setsockopt(option, 0)
    socket.connect(core.address)
    socket.send(ENCODER.encode(Hello()))
    return _Connection(core, context, socket)


def _connected(core: CoreAddress) -> tuple[_Connection, Ready]:
    """A connection to a running core and its Ready."""
    connection = _connect(core)
    return connection, _wait_ready(connection)


def _wait_ready(connection: _Connection) -> Ready:
    """The core's Ready, once its engine has started; RuntimeError when its process ends first."""
    while not connection.socket.poll(100):
        if not connection.core_alive():
            connection.close()
            code = "" if connection.process is None else f" (exit code {connection.process.exitcode})"
            raise RuntimeError(f"the engine core process ended while starting{code}; its log above says why")
    return FROM_CORE.decode(connection.socket.recv())
