"""Reading an engine request's streams from a route: the final outputs or the merged stream of several, a request
the engine failed alone, a client that leaves.

Every request ends by closing its streams, whatever happened (finished, bad input after some prompts were queued,
client gone, engine failed), and closing aborts whatever still runs, so its pages go back to the pool at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import StreamingResponse

from jaxserve.engine.async_engine import EngineDeadError, RequestStream
from jaxserve.outputs import RequestOutput
from jaxserve.server.errors import APIError
from jaxserve.server.sse import ChoiceStream, sse, usage


class EngineStreamingResponse(StreamingResponse):
    """A streamed response that closes (and so aborts) its requests however the response ends,
    even when the client leaves before the first byte."""

    def __init__(self, content: AsyncIterator[bytes], streams: list[RequestStream]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self.streams:
                stream.close()


class RequestFailedError(Exception):
    """The engine failed one request alone (the engine goes on); the cause is the engine's exception."""

    def __init__(self, reason: object):
        super().__init__(f"the engine failed this request: {reason}")


def request_failure(output: RequestOutput) -> str | None:
    """Why the engine failed this request alone (an error output), or None."""
    if output.error is None and all(c.finish_reason != "error" for c in output.outputs):
        return None
    return str(RequestFailedError(output.error or "no reason given"))


async def last_outputs(streams: list[RequestStream], raw: Request) -> list | None:
    """The final output of every stream, or None when the client disconnects first; 503 when the engine is down,
    RequestFailedError for a request it failed alone. Every stream is closed however this ends."""

    async def last(stream: RequestStream):
        output = None
        async for output in read_outputs(stream):
            pass
        return output

    try:
        finished = await unless_client_leaves(asyncio.gather(*(last(s) for s in streams)), raw)
    except EngineDeadError as error:
        raise APIError(503, str(error)) from error
    finally:
        for stream in streams:
            stream.close()
    return finished[0] if finished else None


async def read_outputs(stream: RequestStream) -> AsyncIterator[RequestOutput]:
    """The outputs of `stream`; an exception it ends with becomes RequestFailedError, unless the whole
    engine is down (EngineDeadError)."""
    try:
        async for output in stream:
            yield output
    except EngineDeadError:
        raise
    except Exception as error:  # whatever the engine raised for this request alone
        raise RequestFailedError(error) from error


def chunk_usage(continuous: bool, output: RequestOutput, state: ChoiceStream) -> dict | None:
    """The counts so far of one streamed sample (vLLM's continuous_usage_stats), or None when not asked."""
    return usage(len(output.prompt_token_ids), state.num_tokens) if continuous else None


async def one_event(response: dict) -> AsyncIterator[bytes]:
    """A whole response as a stream: one event, then `[DONE]` (what a request gets that asked to stream
    a result that cannot be streamed)."""
    yield sse(response)
    yield sse("[DONE]")


async def unless_client_leaves(work: Awaitable, raw: Request) -> tuple | None:
    """`(result,)` of `work`, or None when the client disconnects first (`work` is then cancelled)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_disconnected(raw))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        return (task.result(),) if task in done else None
    finally:
        task.cancel()
        gone.cancel()


async def _client_disconnected(raw: Request) -> None:
    """Return once the client has gone (the body has already been read)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams as they arrive."""
    if len(streams) == 1:
        async for output in read_outputs(streams[0]):
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in read_outputs(stream):
                queue.put_nowait((index, output, None))
        except Exception as error:  # handed to the reader, which raises it
            queue.put_nowait((index, None, error))
            return
        queue.put_nowait((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, output, error = await queue.get()
            if error is not None:
                raise error
            if output is None:
                remaining -= 1
                continue
            yield index, output
    finally:
        for task in tasks:
            task.cancel()
