"""POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items, POST
/v1/responses/{id}/cancel: OpenAI's Responses API on the chat route's machinery.

The request becomes a chat request (server/responses_protocol.py) and runs as one
(`ChatServing.start_chat`, server/chat.py).
Its reply, split as a chat reply is (reasoning, content, tool calls), comes back as output items (`OutputItems`):
a `reasoning` item (its text in `content`), a `message` with one `output_text` part, a `function_call` item per
call. Streamed, the same items come as OpenAI's events, each with its `sequence_number`: `response.created`,
`response.in_progress`, per item `response.output_item.added`, its part's deltas and `.done` events,
`response.output_item.done`, and at the end `response.completed` (or `response.incomplete` for a reply cut at
`max_output_tokens`) carrying the whole response. A request the engine fails alone ends its stream with an
`error` event.

Responses are kept, for `previous_response_id` and GET, only when the server keeps some
(`ServerConfig.max_stored_responses`, `--max-stored-responses`; vLLM keeps none unless told): the newest that
many, each with the items of its whole conversation (its instructions are not carried on, as in OpenAI's API) and
its own input items as GET .../input_items lists them (a string input as one user message; each item with an id).
No response runs in the background (`background` is refused), so cancelling a kept one is a 400 that says so.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from jaxserve.engine.async_engine import EngineDeadError, RequestStream
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.chat import ChatServing, reply_delta
from jaxserve.server.errors import APIError
from jaxserve.server.protocol import ChatCompletionRequest
from jaxserve.server.request_streams import EngineStreamingResponse, RequestFailedError, read_outputs, request_failure
from jaxserve.server.responses_protocol import RESPONSES_PARAM, ResponsesRequest
from jaxserve.server.sse import ChoiceStream, chat_logprobs, named_sse
from jaxserve.server.tools import ToolCallExtractor, ToolCallStream


@dataclasses.dataclass
class StoredResponse:
    """A kept response: its body, the items of its conversation (earlier turns, its input, its output), and its
    input items as input_items lists them (each with an id)."""

    body: dict[str, Any]
    items: list[dict[str, Any]]
    inputs: list[dict[str, Any]]


class OutputItems:
    """The output items of one reply, built from its chat deltas (`reasoning`, `content`, `tool_calls`), one item
    open at a time: reasoning text goes to an open reasoning item, content to an open message, each new tool call
    opens a function call item. `add` and `finish` return the streaming events of what they did (without sequence
    numbers)."""

    def __init__(self, with_logprobs: bool):
        self.items: list[dict[str, Any]] = []
        self.with_logprobs = with_logprobs
        self.pending_logprobs: list[dict[str, Any]] = []  # of tokens whose text has not gone out yet
        self.calls: dict[int, int] = {}  # a chat delta's tool call index -> its item's output index

    def add(self, message: dict[str, Any], logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The events of one chat delta; `logprobs` (chat's entries of the delta's tokens) go with the next text."""
        self.pending_logprobs += logprobs or []
        events = []
        if message.get("reasoning"):
            events += self._open("reasoning")
            events.append(self._part_event("response.reasoning_text.delta", delta=message["reasoning"]))
            self._open_part()["text"] += message["reasoning"]
        if message.get("content"):
            events += self._open("message")
            text_logprobs, self.pending_logprobs = self.pending_logprobs, []
            events.append(self._part_event("response.output_text.delta", delta=message["content"],
                                           logprobs=text_logprobs))
            part = self._open_part()
            part["text"] += message["content"]
            part["logprobs"] = None if part["logprobs"] is None else part["logprobs"] + text_logprobs
        for call in message.get("tool_calls") or ():
            if call["index"] not in self.calls:
                events += self._open("function_call", call_id=call["id"], name=call["function"]["name"])
                self.calls[call["index"]] = len(self.items) - 1
            arguments = call["function"].get("arguments") or ""
            item = self.items[self.calls[call["index"]]]
            if arguments:
                item["arguments"] += arguments
                events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                               "output_index": self.calls[call["index"]], "delta": arguments})
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The events that end the reply: the open item closed (a reply with no item at all gets an empty
        message)."""
        events = [] if self.items else self._open("message")
        return events + self._close()

    def _close(self) -> list[dict[str, Any]]:
        """The events that close the open item, if any (tokens whose text never went out keep their logprobs in
        the message's part)."""
        if self.pending_logprobs and self.with_logprobs and self._is_open("message"):
            self._open_part()["logprobs"] += self.pending_logprobs
            self.pending_logprobs = []
        if not self.items or self.items[-1]["status"] != "in_progress":
            return []
        item, index = self.items[-1], len(self.items) - 1
        item["status"] = "completed"
        events = []
        if item["type"] == "function_call":
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            extra = {} if item["type"] == "reasoning" else {"logprobs": part["logprobs"] or []}
            events.append(self._part_event(f"response.{kind}.done", text=part["text"], **extra))
            events.append(self._part_event("response.content_part.done", part=dict(part)))
        events.append({"type": "response.output_item.done", "output_index": index, "item": _copy(item)})
        return events

    def _open(self, kind: str, **fields) -> list[dict[str, Any]]:
        """Events that close the open item and open a new one of `kind` (none when one of `kind` is open and takes
        more: a reasoning item or a message)."""
        if kind != "function_call" and self._is_open(kind):
            return []
        events = self._close()
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = {"id": f"{prefix}_{uuid.uuid4().hex}", "type": kind, "status": "in_progress"}
        if kind == "reasoning":
            item.update(summary=[], content=[])
        elif kind == "message":
            item.update(role="assistant", content=[])
        else:
            item.update(arguments="", **fields)
        self.items.append(item)
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": _copy(item)})
        if kind != "function_call":
            part = ({"type": "reasoning_text", "text": ""} if kind == "reasoning" else
                    {"type": "output_text", "text": "", "annotations": [], "logprobs": [] if self.with_logprobs
                     else None})
            item["content"].append(part)
            events.append(self._part_event("response.content_part.added", part=dict(part)))
        return events

    def _is_open(self, kind: str) -> bool:
        return bool(self.items) and self.items[-1]["type"] == kind and self.items[-1]["status"] == "in_progress"

    def _open_part(self) -> dict[str, Any]:
        return self.items[-1]["content"][0]

    def _part_event(self, kind: str, **fields) -> dict[str, Any]:
        """An event about the open item's one content part."""
        return {"type": kind, "item_id": self.items[-1]["id"], "output_index": len(self.items) - 1,
                "content_index": 0, **fields}


class EventEncoder:
    """Server-sent events of a streamed response, numbered in order (`sequence_number`), each named by its type."""

    def __init__(self):
        self.sequence_number = 0

    def __call__(self, event: dict[str, Any]) -> bytes:
        self.sequence_number += 1
        return named_sse({**event, "sequence_number": self.sequence_number - 1})


class ResponsesServing:
    """Handlers of /v1/responses on the chat route's machinery (ChatServing), and the responses kept."""

    def __init__(self, serving: ChatServing, max_stored: int):
        self.serving = serving
        self.max_stored = max_stored
        self.stored: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def get(self, response_id: str) -> dict:
        """GET /v1/responses/{id}: a kept response; 404 for one not kept."""
        return self._stored(response_id, "response_id").body

    def input_items(self, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None) -> dict:
        """GET /v1/responses/{id}/input_items: a kept response's input items, a page of at most `limit` (1 to 100)
        in `order` (desc: the last first), after the item `after` when given; 404 for a response not kept."""
        stored = self._stored(response_id, "response_id")
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit must be between 1 and 100, got {limit}", "limit")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be asc or desc, got {order!r:.40}", "order")
        items = stored.inputs if order == "asc" else stored.inputs[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(400, f"after {after!r:.80} is not an input item of response {response_id!r:.80}",
                               "after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    def cancel(self, response_id: str) -> dict:
        """POST /v1/responses/{id}/cancel: only a background response can be cancelled, and this server runs none
        (404 for a response not kept, else 400)."""
        self._stored(response_id, "response_id")
        raise APIError(400, f"response {response_id!r:.80} was not created with background true: only a background "
                            "response can be cancelled, and this server answers every response within its request",
                       "response_id")

    def delete(self, response_id: str) -> dict:
        """DELETE /v1/responses/{id}: forget a kept response; 404 for one not kept."""
        self._stored(response_id, "response_id")
        del self.stored[response_id]
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def create(self, body: ResponsesRequest, raw: Request) -> Response | dict:
        """POST /v1/responses."""
        self.serving.models.check_model(body.model)
        history = [] if body.previous_response_id is None else \
            self._stored(body.previous_response_id, "previous_response_id").items
        body.check()
        chat = body.to_chat(history)
        response_id = f"resp_{uuid.uuid4().hex}"
        try:
            params, tools, streams = await self.serving.start_chat(response_id, chat)
        except APIError as error:
            error.param = RESPONSES_PARAM.get(error.param, error.param)
            raise
        head = self._head(body, response_id, params.temperature, params.top_p, params.max_tokens)
        if body.stream:
            return EngineStreamingResponse(self._events(head, body, chat, params, streams[0], tools, history),
                                           streams)
        outputs = await self.serving.final_outputs(streams, chat, raw)
        if outputs is None:
            return Response(status_code=499)
        output = outputs[0]
        items = OutputItems(body.wants_logprobs())
        message, _ = self.serving.chat_message(output.outputs[0], output, chat, tools)
        message["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls") or ())]
        items.add(message, self._logprobs(chat, output.outputs[0], 0))
        items.finish()
        return self._finish(head, body, output, items, history)

    async def _events(self, head: dict, body: ResponsesRequest, chat: ChatCompletionRequest, params: SamplingParams,
                      stream: RequestStream, tools: ToolCallExtractor | None,
                      history: list[dict]) -> AsyncIterator[bytes]:
        """The events of a streamed response."""
        encode = EventEncoder()
        yield encode({"type": "response.created", "response": head})
        yield encode({"type": "response.in_progress", "response": head})
        state, calls = ChoiceStream(params), None if tools is None else ToolCallStream(tools)
        items, reasoning, final, started = OutputItems(body.wants_logprobs()), None, None, False
        try:
            async for final in read_outputs(stream):
                failure = request_failure(final)
                if failure is not None:
                    yield encode({"type": "error", "code": "400", "message": failure, "param": None})
                    return
                if not started:  # the first output tells whether the reply starts in the thinking
                    reasoning, started = self.serving.reasoning_stream(final), True
                c = final.outputs[0]
                delta = reply_delta(state, calls, reasoning, c)
                if delta is None:
                    continue
                message, first_token, _ = delta
                for event in items.add(message, self._logprobs(chat, c, first_token)):
                    yield encode(event)
        except EngineDeadError as error:
            yield encode({"type": "error", "code": "503", "message": str(error), "param": None})
            return
        except RequestFailedError as error:
            yield encode({"type": "error", "code": "400", "message": str(error),
                          "param": body.param_of(str(error.__cause__))})
            return
        for event in items.finish():
            yield encode(event)
        response = self._finish(head, body, final, items, history)
        done = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield encode({"type": done, "response": response})

    def _logprobs(self, chat: ChatCompletionRequest, c: CompletionOutput, first_token: int) -> list[dict] | None:
        """Chat's logprob entries of the reply's tokens from `first_token` on, when asked for."""
        if not chat.logprobs:
            return None
        return chat_logprobs(self.serving.token_text, c.token_ids[first_token:], c.logprobs[first_token:],
                             chat.top_logprobs or 0)["content"]

    def _head(self, body: ResponsesRequest, response_id: str, temperature: float, top_p: float,
              max_tokens: int | None) -> dict:
        """The response object before any output: what the request asked for, status in_progress."""
        text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text is not None else {}
        return {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
                "background": False, "error": None, "incomplete_details": None, "instructions": body.instructions,
                "max_output_tokens": max_tokens, "metadata": body.metadata or {},
                "model": self.serving.models.model_name(body), "output": [],
                "parallel_tool_calls": body.parallel_tool_calls,
                "previous_response_id": body.previous_response_id,
                "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
                "store": self._keeps(body), "temperature": temperature,
                "text": {"format": {"type": "text"}, **text}, "tool_choice": body.tool_choice or "auto",
                "tools": body.tools or [], "top_logprobs": body.top_logprobs or 0, "top_p": top_p,
                "truncation": "disabled", "usage": None, "user": body.user}

    def _finish(self, head: dict, body: ResponsesRequest, output: RequestOutput, items: OutputItems,
                history: list[dict]) -> dict:
        """The whole response (kept when asked and the server keeps responses)."""
        c = output.outputs[0]
        reasoning_tokens = self._reasoning_tokens(output, c)
        response = {**head, "status": "completed", "output": items.items, "usage": {
            "input_tokens": len(output.prompt_token_ids),
            "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
            "output_tokens": len(c.token_ids), "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": len(output.prompt_token_ids) + len(c.token_ids)}}
        if c.finish_reason == "length":
            response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        if self._keeps(body):
            inputs = [_listed_input(item) for item in body.input_items()]
            self.stored[response["id"]] = StoredResponse(response, history + body.input_items() + items.items, inputs)
            while len(self.stored) > self.max_stored:
                self.stored.popitem(last=False)
        return response

    def _reasoning_tokens(self, output: RequestOutput, c: CompletionOutput) -> int:
        """Tokens of the reply's thinking, its end marker included (0 without a reasoning parser)."""
        parser = self.serving.model.reasoning
        return 0 if parser is None else parser.reasoning_tokens(output.prompt_token_ids, c.token_ids)

    def _keeps(self, body: ResponsesRequest) -> bool:
        return body.store and self.max_stored > 0

    def _stored(self, response_id: str, param: str) -> StoredResponse:
        if self.max_stored == 0:
            raise APIError(404, f"response {response_id!r:.80} not found: this server keeps no responses (start it "
                                "with --max-stored-responses N to chain them with previous_response_id)", param)
        if response_id not in self.stored:
            raise APIError(404, f"response {response_id!r:.80} not found (this server keeps its newest "
                                f"{self.max_stored} responses)", param)
        return self.stored[response_id]


def _listed_input(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as input_items lists it: a message with its type, its text as content parts (input_text, or
    output_text for the assistant's) and a status; every item with an id (the client's, or a new one)."""
    if "role" in item and item.get("type", "message") == "message":
        content = item["content"]
        if isinstance(content, str):
            content = [{"type": "output_text" if item["role"] == "assistant" else "input_text", "text": content}]
        item = {**item, "type": "message", "content": content, "status": item.get("status", "completed")}
    prefix = "msg" if item.get("type") == "message" else "item"
    return {"id": item.get("id") or f"{prefix}_{uuid.uuid4().hex}", **item}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item as an event shows it (its content parts copied, as they grow later)."""
    return {**item, **({"content": [dict(part) for part in item["content"]]} if "content" in item else {})}
