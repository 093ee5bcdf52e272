"""The messages between a front end and an engine-core process (engine/core_process.py, engine/core_client.py):
msgspec structs in MessagePack over ZeroMQ, one message per step each way at most, never a pickle.

A front end sends `Hello`, then `AddRequests` (what `make_requests` was given, so the core builds the same samples with
its own LoRA slots and weights version), `Abort`, `FinishSamples` (stop strings, found where the text is), `Call` (a
method of the engine run between two steps), `Ack` (the StepOutputs it has processed: the core waits for a front end
that falls MAX_UNACKED_STEPS behind) and `Shutdown`. The core answers `Ready` once, then `StepOutputs` (each moved
sample's new tokens and state, and the engine counters when a step ran), `RequestFailed` and `CallResult`.
"""

from __future__ import annotations

import msgspec
import numpy as np

from jaxserve.engine.request_maker import ModelFacts
from jaxserve.engine.served_model import KVCacheFacts
from jaxserve.pooling.params import PoolingParams
from jaxserve.pooling.pooled import PooledPrompt
from jaxserve.request import Logprob, Request, RequestStatus
from jaxserve.sampling_params import SamplingParams

# ---- front end -> core -------------------------------------------------------------------------------------------


class NewRequest(msgspec.Struct, array_like=True):
    """One user request, as the front end checked it: its prompt's token ids and options."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | None  # a generation request's
    pooling: PoolingParams | None  # a pooling request's (with its task)
    task: str
    priority: int
    cache_salt: str | None
    lora_name: str | None


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    requests: list[NewRequest]


class Abort(msgspec.Struct, tag=True, array_like=True):
    """End these samples (engine request ids) as aborted; their pages go back to the pool."""

    sample_ids: list[str]


class FinishSamples(msgspec.Struct, tag=True, array_like=True):
    """End samples the front end finished (a stop string: FINISHED_STOPPED; an error in its text: FINISHED_ERROR)."""

    sample_ids: list[str]
    statuses: list[int]


class Call(msgspec.Struct, tag=True, array_like=True):
    """Run `method(*args)` of the core's engine between two steps (CORE_CALLS); answered by a CallResult."""

    call_id: int
    method: str
    args: list


class Ack(msgspec.Struct, tag=True, array_like=True):
    """The front end has processed this many StepOutputs (the core runs at most MAX_UNACKED_STEPS ahead of it)."""

    count: int


class Hello(msgspec.Struct, tag=True, array_like=True):
    """A front end has connected; the core answers Ready once its engine has started."""


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Stop the core (the last front end is closing)."""


ToCore = Hello | AddRequests | Abort | FinishSamples | Ack | Call | Shutdown

# ---- core -> front end -------------------------------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, array_like=True):
    """The engine has started: what a front end needs to check requests and describe the model."""

    model_path: str
    facts: ModelFacts
    kv_cache: KVCacheFacts
    loras: dict[str, str]  # adapters loaded at start-up: name -> folder
    stats: dict


class PooledResult(msgspec.Struct, array_like=True):
    """A finished pooling request's pool (PooledPrompt's sums, as float32 bytes)."""

    total: bytes | None
    tokens: bytes | None  # a token-wise task's (num_pooled, H) states
    num_pooled: int


class SampleDelta(msgspec.Struct, array_like=True):
    """What changed in one sample (an engine request) since the last delta sent for it."""

    sample_id: str
    new_token_ids: list[int]
    new_logprobs: list[list[tuple[int, float, int | None]]]  # per new token: (token id, logprob, rank) entries
    new_prompt_logprobs: list[list[tuple[int, float, int | None]] | None]
    status: int
    stop_reason: int | str | None
    error: str | None
    num_cached_tokens: int
    num_preemptions: int
    first_scheduled_time: float | None
    first_token_time: float | None
    pooled: PooledResult | None  # once a pooling request has finished


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    """One engine step's moved samples for one front end (or none: the counters after a command moved them), and
    the engine counters."""

    deltas: list[SampleDelta]
    stats: dict


class RequestFailed(msgspec.Struct, tag=True, array_like=True):
    """The core could not queue a request (ValueError from building it, e.g. a LoRA adapter unloaded since)."""

    request_id: str
    error: str


class CallResult(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    result: object
    error: str | None
    error_type: str | None  # the exception's class name: ValueError stays a ValueError in the front end


FromCore = Ready | StepOutputs | RequestFailed | CallResult

# ---- the Request's side of a delta -------------------------------------------------------------------------------


class DeltaCursor:
    """How much of each sample a front end has been sent (the core's side)."""

    def __init__(self):
        self._sent: dict[str, tuple[int, int]] = {}  # sample id -> (output tokens, prompt logprobs) sent

    def delta(self, request: Request) -> SampleDelta:
        """The sample's change since its last delta; the sample is forgotten once it has finished."""
        # (both copies of a sample that reports prompt logprobs start with the first prompt token's None)
        unsent = (0, 0 if request.prompt_logprobs is None else 1)
        num_tokens, num_prompt = self._sent.pop(request.request_id, unsent)
        prompt_logprobs = request.prompt_logprobs or []
        wants_logprobs = request.sampling_params.logprobs is not None
        new_logprobs = [_entries(lp) for lp in request.output_logprobs[num_tokens:]] if wants_logprobs else []
        finished = request.is_finished
        if not finished:
            self._sent[request.request_id] = (len(request.output_token_ids), len(prompt_logprobs))
        pooled = request.pooled
        return SampleDelta(
            request.request_id, request.output_token_ids[num_tokens:], new_logprobs,
            [None if lp is None else _entries(lp) for lp in prompt_logprobs[num_prompt:]],
            int(request.status), request.stop_reason, request.error, request.num_cached_tokens,
            request.num_preemptions, request.first_scheduled_time, request.first_token_time,
            None if pooled is None or not finished else _pooled_result(pooled))

    def forget(self, sample_id: str) -> None:
        """Drop a sample that ended without a final delta (aborted)."""
        self._sent.pop(sample_id, None)


def apply_delta(request: Request, delta: SampleDelta) -> None:
    """Bring the front end's copy of a sample up to date with `delta` (the front end's side)."""
    request.output_token_ids.extend(delta.new_token_ids)
    request.output_logprobs.extend(_logprob_dict(entries) for entries in delta.new_logprobs)
    if request.prompt_logprobs is not None:
        request.prompt_logprobs.extend(None if e is None else _logprob_dict(e) for e in delta.new_prompt_logprobs)
    request.status = RequestStatus(delta.status)
    request.stop_reason, request.error = delta.stop_reason, delta.error
    request.num_cached_tokens, request.num_preemptions = delta.num_cached_tokens, delta.num_preemptions
    request.first_scheduled_time, request.first_token_time = delta.first_scheduled_time, delta.first_token_time
    if delta.pooled is not None:
        pooled: PooledPrompt = request.pooled
        pooled.num_pooled = delta.pooled.num_pooled
        if delta.pooled.total is not None:
            pooled.total = np.frombuffer(delta.pooled.total, np.float32)
        if delta.pooled.tokens is not None:
            pooled.tokens = [np.frombuffer(delta.pooled.tokens, np.float32).reshape(pooled.num_pooled, -1)]


def _entries(logprobs: dict[int, Logprob]) -> list[tuple[int, float, int | None]]:
    """A token's logprobs as (token id, logprob, rank) entries."""
    return [(token_id, lp.logprob, lp.rank) for token_id, lp in logprobs.items()]


def _logprob_dict(entries: list) -> dict[int, Logprob]:
    """The dict of (token id, logprob, rank) entries."""
    return {token_id: Logprob(logprob, rank) for token_id, logprob, rank in entries}


def _pooled_result(pooled: PooledPrompt) -> PooledResult:
    """A finished pool's sums as bytes."""
    total = None if pooled.total is None else np.asarray(pooled.total, np.float32).tobytes()
    tokens = np.concatenate(pooled.tokens).astype(np.float32).tobytes() if pooled.tokens else None
    return PooledResult(total, tokens, pooled.num_pooled)


ENCODER = msgspec.msgpack.Encoder()
TO_CORE = msgspec.msgpack.Decoder(ToCore)
FROM_CORE = msgspec.msgpack.Decoder(FromCore)
