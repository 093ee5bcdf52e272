"""The online benchmark's HTTP client: streamed POSTs over raw asyncio connections, parsed after the run.

While a request streams, the client only keeps the bytes the socket delivers and when each piece came
(time.perf_counter, in an asyncio.Protocol callback: no task wakes up per chunk), so it takes as little
CPU as it can from a server on the same machine and its clock sees the chunks as they arrive. HTTP
(status line, chunked transfer encoding) and the server-sent events are parsed afterwards from the saved
pieces: each event gets the time of the piece that completed it. One connection per request
(`Connection: close`: the response ends when the server closes it)."""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import itertools
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request

from jaxserve.bench.stats import RequestTrace

EVENT_END = re.compile(rb"\r?\n\r?\n")  # the blank line that ends a server-sent event


@dataclasses.dataclass(frozen=True)
class Target:
    """Where requests go: host, port, TLS, and the path the base URL puts before /v1/... ("" mostly)."""

    host: str
    port: int
    tls: bool
    prefix: str

    @classmethod
    def from_url(cls, base_url: str) -> Target:
        """Parse `http[s]://host[:port][/prefix]`; ValueError names --base-url when it is not one."""
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--base-url {base_url!r} is not an http:// or https:// URL")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.hostname, port, parts.scheme == "https", parts.path.rstrip("/"))

    def url(self, path: str) -> str:
        """The full URL of `path` (e.g. "/v1/models")."""
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{self.host}:{self.port}{self.prefix}{path}"


def request_bytes(target: Target, path: str, body: bytes, api_key: str | None) -> bytes:
    """The whole HTTP/1.1 request that POSTs the JSON `body` to `path` and asks for the connection to close."""
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (f"POST {target.prefix}{path} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n{auth}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode("latin-1") + body


@dataclasses.dataclass
class RawResponse:
    """What the socket gave for one request, unparsed."""

    start: float  # perf_counter before connecting (s)
    end: float  # when the last bytes arrived, or when the request failed (s)
    reads: list[bytes]  # every piece of data the socket delivered, in order
    read_times: list[float]  # perf_counter when each piece came (s), one per read
    busy_s: float  # client time spent keeping the pieces, from their arrival to being ready for more (s)
    error: str | None = None  # connection failure or timeout


class _Collector(asyncio.Protocol):
    """Keeps each piece of data the socket delivers with the time it came; `done` resolves when the
    connection ends (with the error that ended it, or None). No task wakes up per chunk."""

    def __init__(self, done: asyncio.Future):
        self.done = done
        self.reads: list[bytes] = []
        self.read_times: list[float] = []  # s
        self.busy_s = 0.0

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.reads.append(data)
        self.read_times.append(now)
        self.busy_s += time.perf_counter() - now

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(exc)


async def post_streaming(target: Target, request: bytes, timeout_s: float) -> RawResponse:
    """Send `request` (from request_bytes) on a new connection and collect the response's bytes until the
    server closes it.

    Never raises for network trouble: a refused connection, a reset or `timeout_s` passing sets `error`."""
    loop = asyncio.get_running_loop()
    collector = _Collector(loop.create_future())
    start = time.perf_counter()
    error = None
    transport = None
    try:
        async with asyncio.timeout(timeout_s):
            transport, _ = await loop.create_connection(lambda: collector, target.host, target.port,
                                                        ssl=True if target.tls else None)
            transport.write(request)
            lost = await collector.done
        if lost is not None:
            raise lost
    except TimeoutError:
        error = f"no complete response within {timeout_s:g} s"
    except OSError as exc:
        error = f"{type(exc).__name__} talking to {target.host}:{target.port}: {exc}"
    finally:
        if transport is not None:
            transport.close()
    read_times = collector.read_times
    end = read_times[-1] if read_times and error is None else time.perf_counter()
    return RawResponse(start=start, end=end, reads=collector.reads, read_times=read_times, busy_s=collector.busy_s,
                       error=error)


def parse_http(reads: list[bytes], read_times: list[float]) -> tuple[int, bytes, list[tuple[float, str]]]:
    """(status, body, events) of a saved response: the body de-chunked when the transfer is chunked, and
    each server-sent event's data with the time (s) of the read that brought its last byte.

    ValueError when the bytes hold no complete status line and headers."""
    raw = b"".join(reads)
    read_ends = list(itertools.accumulate(len(r) for r in reads))  # raw offset after each read
    head_end = raw.find(b"\r\n\r\n")
    if head_end < 0:
        raise ValueError(f"incomplete HTTP response ({len(raw)} bytes)")
    status_line, *header_lines = raw[:head_end].decode("latin-1").split("\r\n")
    fields = status_line.split(" ", 2)
    if len(fields) < 2 or not fields[1].isdigit():
        raise ValueError(f"bad HTTP status line {status_line!r}")
    headers = dict((k.strip().lower(), v.strip().lower()) for k, _, v in (h.partition(":") for h in header_lines))
    body_start = head_end + 4
    if "chunked" in headers.get("transfer-encoding", ""):
        segments = dechunk_segments(raw, body_start)
    else:
        segments = [(body_start, len(raw))]
    body = b"".join(raw[a:b] for a, b in segments)
    segment_body_starts = list(itertools.accumulate((b - a for a, b in segments[:-1]), initial=0))
    events = []
    event_start = 0
    for match in EVENT_END.finditer(body):
        last = match.end() - 1  # body offset of the event's last byte
        k = bisect.bisect_right(segment_body_starts, last) - 1
        raw_offset = segments[k][0] + last - segment_body_starts[k]
        arrival = read_times[bisect.bisect_right(read_ends, raw_offset)]
        data = sse_data(body[event_start:match.start()].decode("utf-8", errors="replace"))
        if data is not None:
            events.append((arrival, data))
        event_start = match.end()
    return int(fields[1]), body, events


def dechunk_segments(raw: bytes, pos: int) -> list[tuple[int, int]]:
    """The (start, end) offsets in `raw` of each chunk's data, for a chunked body starting at `pos`;
    stops at the last-chunk marker or where the bytes end (a cut-off response)."""
    segments = []
    while True:
        line_end = raw.find(b"\r\n", pos)
        if line_end < 0:
            return segments
        size = int(raw[pos:line_end].split(b";")[0], 16)
        if size == 0:
            return segments
        start = line_end + 2
        segments.append((start, min(start + size, len(raw))))
        if start + size >= len(raw):
            return segments
        pos = start + size + 2


def sse_data(event: str) -> str | None:
    """The data of one server-sent event (its `data:` lines joined), None for an event without data."""
    lines = [line[5:].removeprefix(" ") for line in event.splitlines() if line.startswith("data:")]
    return "\n".join(lines) if lines else None


def error_message(body: bytes) -> str:
    """The message of an OpenAI-shaped error body, else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", errors="replace")


def chunk_text(chunk: dict) -> str:
    """The text a completion or chat chunk adds, over all its choices."""
    parts = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        parts.append((delta.get("content") if delta else choice.get("text")) or "")
    return "".join(parts)


def trace_of(response: RawResponse, prompt_tokens: int) -> RequestTrace:
    """The RequestTrace of one streamed completion or chat completion.

    A chunk with text counts one token, or, when it carries usage (vLLM's continuous_usage_stats),
    the completion tokens added since the previous usage. Output and prompt tokens come from the
    final usage chunk when there is one (else the chunk count and `prompt_tokens`). `error` is set for
    a network failure, a status other than 200, an error event, a stream that ends before
    `data: [DONE]`, and one without any text."""
    trace = RequestTrace(start=response.start, chunk_times=[], chunk_tokens=[], end=response.end,
                         prompt_tokens=prompt_tokens, output_tokens=0, error=response.error)
    if trace.error:
        return trace
    try:
        status, body, events = parse_http(response.reads, response.read_times)
    except ValueError as exc:
        trace.error = str(exc)
        return trace
    if status != 200:
        trace.error = f"HTTP {status}: {error_message(body)}"
        return trace
    usage = None
    usage_tokens = 0  # completion tokens by the latest usage seen
    done = False
    for arrival, data in events:
        if data == "[DONE]":
            done = True
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            trace.error = f"an event that is not JSON: {data[:200]!r}"
            return trace
        if "error" in chunk:
            trace.error = f"error event: {error_message(data.encode())}"
            return trace
        if chunk_text(chunk):
            trace.chunk_times.append(arrival)
            trace.chunk_tokens.append(chunk["usage"]["completion_tokens"] - usage_tokens if chunk.get("usage") else 1)
        if chunk.get("usage"):
            usage = chunk["usage"]
            usage_tokens = usage["completion_tokens"]
    if not done:
        trace.error = "the stream ended before data: [DONE]"
    elif not trace.chunk_times:
        trace.error = "the stream held no text"
    trace.output_tokens = usage["completion_tokens"] if usage else sum(trace.chunk_tokens)
    if usage:
        trace.prompt_tokens = usage["prompt_tokens"]
    return trace


def request_json(method: str, url: str, api_key: str | None, timeout_s: float = 10.0) -> tuple[int, object]:
    """(status, parsed JSON body or None) of a small untimed request (no proxies); OSError when the
    server cannot be reached."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, method=method, headers=headers, data=b"" if method == "POST" else None)
    try:
        with opener.open(request, timeout=timeout_s) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None
