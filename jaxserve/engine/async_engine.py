"""AsyncLLMEngine: one background thread drives LLMEngine.step(); asyncio code adds, streams and aborts.

Threads: the engine thread owns the LLMEngine (scheduler, pages, detokenizers) and is the only one
that touches it after start-up, apart from `make_requests` (validation, which reads only constant
state). Commands reach it through one FIFO queue; outputs come back to the event loop with one
`call_soon_threadsafe` per step. A request's outputs are cumulative, so a consumer that falls
behind simply takes the latest one: slow clients never make the engine wait.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.output_processor import RequestState
from jaxserve.engine.request_maker import Prompt
from jaxserve.engine.served_model import ServedModel
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.pooling.params import PoolingParams
from jaxserve.request import Request
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.structured.params import StructuredOutputsParams
from jaxserve.tokenizer import load_tokenizer

logger = logging.getLogger("jaxserve")

_STOP = ("stop",)
# Engine counters whose move means an engine step did something: it dispatched a step or brought tokens.
STEP_MOVES = ("steps", "prompt_tokens", "generation_tokens")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can run."""


class EngineSleepingError(EngineDeadError):
    """The engine sleeps (sleep mode): no request can run until it wakes up."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting to start; the caller should retry later."""


class RequestStream:
    """The outputs of one request, as they arrive; `close()` aborts it unless it finished.

    Lives on the event loop. Each item is the request's RequestOutput; when several arrive between two
    reads, the reader gets only the latest, or with `deltas` (SamplingParams.output_kind DELTA) all of them
    joined into one. A front end may hand it the request's state instead (`moved`): the output is then built when
    the reader reads, once however many steps it missed. A `whole` stream (a reply sent whole) wakes its reader
    only for the final output.
    """

    def __init__(self, request_id: str, on_close: Callable[["RequestStream"], None], deltas: bool = False,
                 whole: bool = False):
        self.request_id = request_id
        self.started = False  # an output (or the request's move) has arrived
        self.finished = False  # the final output has been read
        self._deltas = deltas
        self._whole = whole
        self._latest: RequestOutput | None = None
        self._pending: RequestState | None = None  # a moved request whose output is built when read
        self._num_tokens = 0  # the request's tokens so far
        self._tokens_woken = 0  # tokens so far when the reader was last woken
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._on_close = on_close
        self._closed = False

    def put(self, output: RequestOutput, stream_interval: int = 1) -> None:
        """Hand a newer output to the reader (event loop only); the reader wakes for the first output,
        the last, and whenever `stream_interval` more tokens have arrived since it last woke."""
        num_tokens = sum(len(c.token_ids) for c in output.outputs) if isinstance(output, RequestOutput) else 0
        if self._deltas:
            num_tokens += self._num_tokens
            output = output if self._latest is None else self._latest.followed_by(output)
        self._latest, self._pending = output, None  # (a DELTA output holds what a pending state would have shown)
        self._arrived(num_tokens, output.finished, stream_interval)

    def moved(self, state: RequestState, stream_interval: int = 1) -> None:
        """The request moved and has not finished (event loop only): its output is built from `state` when the
        reader reads. Wakes the reader as `put` does."""
        if self._latest is not None and self._deltas:  # an unread delta: the state's next one joins it now
            output = state.output()
            if output is not None:
                self.put(output, stream_interval)
            return
        self._latest, self._pending = None, state  # (a cumulative output built before is older than the state's)
        self._arrived(state.num_output_tokens, False, stream_interval)

    def _arrived(self, num_tokens: int, finished: bool, stream_interval: int) -> None:
        self._num_tokens = num_tokens
        first, self.started = not self.started, True
        if finished or (not self._whole and (first or num_tokens - self._tokens_woken >= stream_interval)):
            self._tokens_woken = num_tokens
            self._ready.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with an error once the outputs already built are read (a moved request's unbuilt output
        is dropped: the request has ended)."""
        self._error, self._pending = error, None
        self._ready.set()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        output = None
        while output is None:
            await self._ready.wait()
            self._ready.clear()
            output, self._latest = self._latest, None
            if output is None and self._pending is not None:
                output, self._pending = self._pending.output(), None  # None: nothing to show yet
            if output is None and self._error is not None:
                self.close()
                raise self._error
        if self._error is not None:
            self._ready.set()  # the error follows this output
        self.finished = output.finished
        if self.finished:
            self.close()
        return output

    def close(self) -> None:
        """Stop reading; an unfinished request is aborted and its pages go back to the pool."""
        if not self._closed:
            self._closed = True
            self._on_close(self)


class AsyncEngineBase:
    """What every async engine the server drives shares (AsyncLLMEngine here, EngineCoreClient over a core process):
    the request streams on the event loop, back-pressure, failure and the front end's CPU clock. A subclass queues
    a submitted request (`_queue_add`) and an abort (`_queue_abort`) for its engine, and hands each batch of
    outputs to `_deliver` on the event loop."""

    def __init__(self, tokenizer, model: ServedModel, max_waiting_requests: int, stream_interval: int,
                 on_outputs: Callable[[list[RequestOutput]], None] | None, on_step: Callable[[dict, dict], None] | None,
                 stats: dict):
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.stream_interval = stream_interval
        self.tokenizer = tokenizer  # the event loop's own
        self.model = model  # what the front end may know of the model
        self.max_waiting_requests = max_waiting_requests
        self._streams: dict[str, RequestStream] = {}  # event loop only
        self._on_close: dict[str, Callable[[], None]] = {}  # request id -> submit's on_close (event loop only)
        self._num_unstarted = 0  # event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self._front_end_clock: int | None = None  # the event loop thread's CPU clock, from `start`
        self._front_end_cpu_at_start = 0.0  # its reading then
        self._on_outputs, self._on_step = on_outputs, on_step  # the metrics hooks
        self._on_moves: Callable[[list[tuple[str, int]]], None] | None = None
        self._stats = stats  # the engine counters as of the last step

    def set_hooks(self, on_outputs: Callable[[list[RequestOutput]], None] | None,
                  on_step: Callable[[dict, dict], None] | None,
                  on_moves: Callable[[list[tuple[str, int]]], None] | None = None) -> None:
        """Set the metrics hooks (before `start`): `on_outputs(outputs)` with every batch of outputs, the final
        output of every request among them, `on_step(before, after)` with the counters around every step, and
        `on_moves(moves)` with (request id, tokens of its longest sample so far) of the requests that moved in a
        step without an output being built (a front end that builds them when read: EngineCoreClient)."""
        self._on_outputs, self._on_step, self._on_moves = on_outputs, on_step, on_moves

    def _start_clock(self) -> None:
        """Note the event loop (call from it) and start the front end's CPU clock."""
        self._loop = asyncio.get_running_loop()
        self._front_end_clock = time.pthread_getcpuclockid(threading.get_ident())
        self._front_end_cpu_at_start = time.clock_gettime(self._front_end_clock)

    def front_end_cpu_s(self) -> float:
        """CPU seconds of the event loop's thread since `start` (0 before it)."""
        if self._front_end_clock is None:
            return 0.0
        return time.clock_gettime(self._front_end_clock) - self._front_end_cpu_at_start

    @property
    def is_running(self) -> bool:
        """True while the engine runs and has not failed."""
        raise NotImplementedError

    def is_sleeping(self) -> bool:
        """True between `sleep` and `wake_up`."""
        raise NotImplementedError

    def check_capacity(self, num_requests: int = 1) -> None:
        """EngineDeadError when the engine is down, EngineOverloadedError when `num_requests` more would
        exceed max_waiting_requests."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.error!r}" if self.error
                                  else "the engine is not running")
        if self.is_sleeping():
            raise EngineSleepingError("the engine is asleep (sleep mode): wake it up first (POST /wake_up)")
        if self._num_unstarted + num_requests > self.max_waiting_requests:
            raise EngineOverloadedError(
                f"{self._num_unstarted} requests are already waiting to start "
                f"(max_waiting_requests={self.max_waiting_requests}); retry later"
            )

    def submit(self, request_id: str, made: tuple[str | None, list[Request]],
               on_close: Callable[[], None] | None = None, whole: bool = False) -> RequestStream:
        """Queue a request validated by `make_requests`; returns the stream of its outputs (`whole`: a reply sent
        whole, whose reader wakes only for the final output). `on_close()` runs (on the event loop) when the stream
        closes: finished, aborted or failed."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        deltas = made[1][0].sampling_params.output_kind is RequestOutputKind.DELTA
        stream = RequestStream(request_id, self._close_stream, deltas, whole)
        if on_close is not None:
            self._on_close[request_id] = on_close
        self._streams[request_id] = stream
        self._num_unstarted += 1
        self._queue_add(request_id, made)
        return stream

    def _queue_add(self, request_id: str, made: tuple[str | None, list[Request]]) -> None:
        raise NotImplementedError

    def _queue_abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _close_stream(self, stream: RequestStream) -> None:
        self._streams.pop(stream.request_id, None)
        on_close = self._on_close.pop(stream.request_id, None)
        if on_close is not None:
            on_close()
        if not stream.started:
            stream.started = True
            self._num_unstarted -= 1
        if not stream.finished:
            self._queue_abort(stream.request_id)

    def _publish_stats(self, stats: dict) -> None:
        """Hand the step `stats` closes (if one ran) to on_step, then make `stats` the snapshot `stats()` reads
        (so a snapshot never runs ahead of the step metrics)."""
        if self._on_step is not None and any(stats[key] > self._stats[key] for key in STEP_MOVES):
            try:
                self._on_step(self._stats, stats)
            except Exception:  # a metrics hook must not take serving down
                logger.exception("the on_step hook failed")
        self._stats = stats

    def _observe(self, outputs: list[RequestOutput]) -> None:
        """Hand a batch of outputs to on_outputs."""
        if self._on_outputs is not None:
            try:
                self._on_outputs(outputs)
            except Exception:  # a metrics hook must not take serving down
                logger.exception("the on_outputs hook failed")

    def _observe_moves(self, states: list[RequestState]) -> None:
        """Hand the requests that moved without an output to on_moves."""
        if self._on_moves is not None:
            try:
                self._on_moves([(state.request_id, state.longest_output) for state in states])
            except Exception:  # a metrics hook must not take serving down
                logger.exception("the on_moves hook failed")

    def stats(self) -> dict:
        """The engine counters as of the last step (see EngineCore.stats), plus the waiting requests and the CPU
        seconds the front end (the event loop's thread: HTTP, tokenizing, SSE) has spent since the engine started."""
        return {**self._stats, "num_requests_unstarted": self._num_unstarted,
                "front_end_cpu_s": self.front_end_cpu_s()}

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._arriving(output.request_id)
            if stream is not None:
                stream.put(output, self.stream_interval)

    def _deliver_moves(self, states: list[RequestState]) -> None:
        """Hand running requests that moved to their streams, which build their outputs when read."""
        for state in states:
            stream = self._arriving(state.request_id)
            if stream is not None:
                stream.moved(state, self.stream_interval)

    def _arriving(self, request_id: str) -> RequestStream | None:
        """The stream of a request whose output (or move) has come, no longer counted as waiting to start; None
        once it has closed."""
        stream = self._streams.get(request_id)
        if stream is not None and not stream.started:
            self._num_unstarted -= 1
        return stream

    def _fail_stream(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.fail(error)

    def _fail_streams(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.fail(error)


class AsyncLLMEngine(AsyncEngineBase):
    """Serve an LLMEngine to asyncio code.

    `on_outputs(outputs)` is called on the engine thread with every batch of outputs it publishes,
    including the final output of every request whatever ended it, and `on_step(before, after)` after
    every engine step that dispatched a step or brought tokens (under asynchronous scheduling the last step
    of a busy spell only brings the tokens of the one before), with the engine counters (EngineCore.stats)
    before and after it: the
    metrics hooks; both run on the engine thread, so they must be cheap. `max_waiting_requests` bounds
    the requests accepted but not yet started; past it `submit` raises EngineOverloadedError. A reader
    wakes every `stream_interval` tokens (and for the first and the last output): vLLM's option, which
    trades streaming smoothness for less host work per token.
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int = 1024,
        on_outputs: Callable[[list[RequestOutput]], None] | None = None,
        stream_interval: int = 1,
        on_step: Callable[[dict, dict], None] | None = None,
    ):
        # The engine thread detokenizes with engine.tokenizer; the event loop gets its own copy, since a
        # Hugging Face tokenizer may not be used from two threads at once.
        super().__init__(load_tokenizer(engine.config.model_config.tokenizer or engine.model_path),
                         ServedModel.of(engine), max_waiting_requests, stream_interval, on_outputs, on_step,
                         engine.stats())
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # ---- life cycle (event loop) ---------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the outputs."""
        self._start_clock()
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the engine thread; requests still running end with EngineDeadError."""
        if self._thread is None:
            return
        self._commands.put(_STOP)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._thread = None
        self._fail_streams(EngineDeadError("the engine was shut down"))

    def fail(self, error: BaseException) -> None:
        """Mark the engine dead from any thread (a multi-host launch lost a process): `is_running` turns False
        and every request still streaming ends with `error`."""
        self.error = error
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_streams, error)

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- requests (event loop) -----------------------------------------------------------------

    def make_requests(
        self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0,
        cache_salt: str | None = None, lora_name: str | None = None,
    ) -> tuple[str | None, list[Request]]:
        """Validate one request (ValueError when invalid) without queueing it; text is tokenized here,
        with this thread's own tokenizer."""
        return self.engine.make_requests(request_id, prompt, params, priority, tokenizer=self.tokenizer,
                                         cache_salt=cache_salt, lora_name=lora_name)

    def make_pooling_requests(
        self, request_id: str, prompt: Prompt, params: PoolingParams, priority: int = 0,
        cache_salt: str | None = None, lora_name: str | None = None, task: str = "embed",
    ) -> tuple[str | None, list[Request]]:
        """Validate one pooling request of `task` (ValueError when invalid) without queueing it, with this thread's
        own tokenizer (LLMEngine.make_pooling_requests)."""
        return self.engine.make_pooling_requests(request_id, prompt, params, priority, tokenizer=self.tokenizer,
                                                 cache_salt=cache_salt, lora_name=lora_name, task=task)

    async def compile_grammar(self, constraint: StructuredOutputsParams) -> None:
        """Compile a request's output constraint on the grammar engine's threads (the engine then finds it in its
        cache); ValueError for one that cannot be compiled."""
        await asyncio.wrap_future(self.engine.grammars.submit(constraint))

    async def reset_prefix_cache(self) -> int:
        """Forget every cached page (on the engine thread, between steps); returns how many were forgotten."""
        return await self._between_steps(self.engine.reset_prefix_cache)

    async def kv_page_states(self) -> list[list[int]]:
        """The KV pool's map, run-length encoded (on the engine thread, between steps; EngineCore.kv_page_states)."""
        return await self._between_steps(self.engine.kv_page_states)

    async def update_weights(self, source: str | Mapping[str, object]) -> int:
        """Serve new weights (on the engine thread, between steps; LLMEngine.update_weights); the weights
        version."""
        return await self._between_steps(lambda: self.engine.update_weights(source))

    async def sleep(self, level: int = 1) -> None:
        """Free the devices' memory (on the engine thread, between steps; LLMEngine.sleep)."""
        await self._between_steps(lambda: self.engine.sleep(level))

    async def wake_up(self) -> None:
        """Take the devices back (on the engine thread, between steps; LLMEngine.wake_up)."""
        await self._between_steps(self.engine.wake_up)

    def is_sleeping(self) -> bool:
        """True between `sleep` and `wake_up`."""
        return self.engine.is_sleeping()

    async def add_lora(self, lora_request: LoRARequest) -> str:
        """Load a LoRA adapter into a free slot (on the engine thread, between steps; LLMEngine.add_lora)."""
        return await self._between_steps(lambda: self.engine.add_lora(lora_request))

    async def remove_lora(self, name: str) -> None:
        """Free an adapter's slot (on the engine thread, between steps; LLMEngine.remove_lora)."""
        return await self._between_steps(lambda: self.engine.remove_lora(name))

    async def _between_steps(self, function: Callable[[], object]) -> object:
        """`function()` run on the engine thread between two steps; its result, or its exception raised here.
        (Commands run in order, so a request submitted before it is in the engine when it runs.)"""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        done = self._loop.create_future()
        self._commands.put(("call", function, done))
        return await done

    def _queue_add(self, request_id: str, made: tuple[str | None, list[Request]]) -> None:
        self._commands.put(("add", request_id, made))

    def _queue_abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        """Apply commands, step while there is work, block on the queue when idle."""
        try:
            while self._apply_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._publish(self.engine.step())
                self._publish_stats(self.engine.stats())
        except BaseException as error:  # the loop must never die silently: fail every request
            logger.exception("the engine loop failed")
            self.error = error
            self._loop.call_soon_threadsafe(self._fail_streams, EngineDeadError(f"the engine failed: {error!r}"))

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); False on stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            if command[0] == "add":
                try:
                    self.engine.submit(command[1], command[2])
                except Exception as error:  # this request is bad; the engine is fine
                    self._loop.call_soon_threadsafe(self._fail_stream, command[1], error)
            elif command[0] == "call":
                try:
                    result, error = command[1](), None
                except Exception as failure:  # handed to the awaiting coroutine
                    result, error = None, failure
                self._loop.call_soon_threadsafe(_resolve, command[2], result, error)
            else:
                final = self.engine.abort_request(command[1])
                if final is not None:
                    self._publish([final])
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._observe(outputs)
            self._loop.call_soon_threadsafe(self._deliver, outputs)


def _resolve(future: asyncio.Future, value, error: BaseException | None = None) -> None:
    """Set a future's result (or `error`) unless its waiter has gone (event loop only)."""
    if future.done():
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)
