"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat route's machinery.

The request becomes a chat request (server/messages_protocol.py) and runs as one
(`ChatServing.start_chat`, server/chat.py).
Its reply, split as a chat reply is (reasoning, content, tool calls), comes back as content blocks
(`ContentBlocks`): a `thinking` block (with a reasoning parser; its `signature` empty: nothing here signs it),
a `text` block, a `tool_use` block per call (its arguments parsed into `input`). `stop_reason` is `end_turn`,
`max_tokens`, `stop_sequence` (with the `stop_sequence` that matched) or `tool_use` (any reply that calls a tool,
a forced one too). `usage` counts the prompt
tokens read from the prefix cache apart, as Anthropic's API counts cache reads: `input_tokens` +
`cache_read_input_tokens` is the whole prompt. Streamed, the same blocks come as Anthropic's events:
`message_start`, per block `content_block_start`, its `content_block_delta`s (`text_delta`, `thinking_delta`,
`input_json_delta`) and `content_block_stop`, then `message_delta` (stop reason, output tokens) and
`message_stop`; a request the engine fails alone ends its stream with an `error` event.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from jaxserve.engine.async_engine import EngineDeadError, RequestStream
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.chat import ChatServing, reply_delta
from jaxserve.server.errors import APIError, anthropic_error_body
from jaxserve.server.messages_protocol import MESSAGES_PARAM, CountTokensRequest, MessagesRequest
from jaxserve.server.request_streams import EngineStreamingResponse, RequestFailedError, read_outputs, request_failure
from jaxserve.server.sse import ChoiceStream, named_sse
from jaxserve.server.tools import ToolCallExtractor, ToolCallStream

BLOCK_DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}  # kind -> (delta, field)


class ContentBlocks:
    """The content blocks of one reply, built from its chat deltas (`reasoning`, `content`, `tool_calls`), one block
    open at a time: reasoning text goes to an open thinking block, content to an open text block, each new tool call
    opens a tool_use block. `add` and `finish` return the streaming events of what they did."""

    def __init__(self):
        self.blocks: list[dict[str, Any]] = []
        self.arguments: list[str] = []  # each block's tool call arguments so far ("" for other kinds)
        self.calls: dict[int, int] = {}  # a chat delta's tool call index -> its block's index
        self.open = False

    def add(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat delta."""
        events = []
        reasoning = message.get("reasoning")
        if reasoning:
            events += self._text("thinking", reasoning)
        if message.get("content"):
            events += self._text("text", message["content"])
        for call in message.get("tool_calls") or ():
            if call["index"] not in self.calls:
                events += self._start({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                       "input": {}})
                self.calls[call["index"]] = len(self.blocks) - 1
            arguments = call["function"].get("arguments") or ""
            index = self.calls[call["index"]]
            if arguments:
                self.arguments[index] += arguments
                events.append({"type": "content_block_delta", "index": index,
                               "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The events that close the open block (a reply with no block at all gets an empty text block)."""
        events = [] if self.blocks else self._start({"type": "text", "text": ""})
        return events + self._stop()

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        """Events adding `text` to an open block of `kind` (thinking or text), opening one when needed."""
        events = [] if self.open and self.blocks[-1]["type"] == kind else self._start(
            {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})})
        delta, field = BLOCK_DELTAS[kind]
        self.blocks[-1][field] += text
        return events + [{"type": "content_block_delta", "index": len(self.blocks) - 1,
                          "delta": {"type": delta, field: text}}]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        """Events closing the open block and starting `block`."""
        events = self._stop()
        self.blocks.append(block)
        self.arguments.append("")
        self.open = True
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _stop(self) -> list[dict[str, Any]]:
        """The event closing the open block (none when no block is open); a tool_use block gets its input."""
        if not self.open:
            return []
        self.open = False
        index = len(self.blocks) - 1
        if self.blocks[index]["type"] == "tool_use":
            self.blocks[index]["input"] = tool_input(self.arguments[index])
        return [{"type": "content_block_stop", "index": index}]


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments (JSON text) as the object a tool_use block's input is."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {"arguments": arguments}  # (the extractor only emits parsed objects; kept, never dropped)
    return value if isinstance(value, dict) else {"arguments": value}


class MessagesServing:
    """Handlers of /v1/messages on the chat route's machinery (ChatServing)."""

    def __init__(self, serving: ChatServing):
        self.serving = serving

    async def count_tokens(self, body: CountTokensRequest) -> dict:
        """POST /v1/messages/count_tokens: the prompt's tokens under the chat template, nothing generated."""
        self.serving.models.check_model(body.model)
        return {"input_tokens": len(self.serving.chat_prompt(body.to_chat()))}

    async def create(self, body: MessagesRequest, raw: Request) -> Response | dict:
        """POST /v1/messages."""
        self.serving.models.check_model(body.model)
        # a reasoning model's thinking is bounded by budget_tokens, as Anthropic's is; a model that does not think
        # (no reasoning parser) has no thinking to bound
        thinking = self.serving.model.reasoning is not None
        chat = body.to_chat(thinking_token_budget=body.thinking_budget() if thinking else None)
        message_id = f"msg_{uuid.uuid4().hex}"
        try:
            params, tools, streams = await self.serving.start_chat(message_id, chat)
        except APIError as error:
            error.param = MESSAGES_PARAM.get(error.param, error.param)
            raise
        head = {"id": message_id, "type": "message", "role": "assistant", "model": self.serving.models.model_name(chat),
                "content": [], "stop_reason": None, "stop_sequence": None}
        if body.stream:
            return EngineStreamingResponse(self._events(head, params, streams[0], tools), streams)
        outputs = await self.serving.final_outputs(streams, chat, raw)
        if outputs is None:
            return Response(status_code=499)
        output = outputs[0]
        message, finish_reason = self.serving.chat_message(output.outputs[0], output, chat, tools)
        message["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls") or ())]
        blocks = ContentBlocks()
        blocks.add(message)
        blocks.finish()
        return {**head, "content": blocks.blocks, **_stop(output.outputs[0], finish_reason, bool(blocks.calls)),
                "usage": _usage(output, output.outputs[0])}

    async def _events(self, head: dict, params: SamplingParams, stream: RequestStream,
                      tools: ToolCallExtractor | None) -> AsyncIterator[bytes]:
        """The events of a streamed message."""
        state, calls = ChoiceStream(params), None if tools is None else ToolCallStream(tools)
        blocks, reasoning, final, finish_reason, started = ContentBlocks(), None, None, None, False
        try:
            async for final in read_outputs(stream):
                failure = request_failure(final)
                if failure is not None:
                    yield named_sse(anthropic_error_body(400, failure))
                    return
                if not started:  # the first output tells whether the reply starts in the thinking
                    yield named_sse({"type": "message_start", "message": {**head, "usage": _usage(final, None)}})
                    reasoning, started = self.serving.reasoning_stream(final), True
                delta = reply_delta(state, calls, reasoning, final.outputs[0])
                if delta is None:
                    continue
                message, _, finish_reason = delta
                for data in blocks.add(message):
                    yield named_sse(data)
        except EngineDeadError as error:
            yield named_sse(anthropic_error_body(503, str(error)))
            return
        except RequestFailedError as error:
            yield named_sse(anthropic_error_body(400, str(error)))
            return
        if final is None:
            return
        for data in blocks.finish():
            yield named_sse(data)
        c = final.outputs[0]
        yield named_sse({"type": "message_delta", "delta": _stop(c, finish_reason, bool(blocks.calls)),
                     "usage": {"output_tokens": len(c.token_ids)}})
        yield named_sse({"type": "message_stop"})


def _stop(c: CompletionOutput, finish_reason: str | None, called: bool) -> dict[str, Any]:
    """Anthropic's stop_reason and stop_sequence of a finished reply (its chat finish reason given; `called`: it
    called a tool, which a named tool choice ends with too)."""
    if called:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if isinstance(c.stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": c.stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(output: RequestOutput, c: CompletionOutput | None) -> dict[str, int]:
    """Anthropic's usage (of reply `c`, none yet without it): the prompt tokens the prefix cache held counted
    apart, as its cache reads are."""
    cached = output.num_cached_tokens
    return {"input_tokens": len(output.prompt_token_ids) - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": 0 if c is None else len(c.token_ids)}
