"""POST /v1/chat/completions: a conversation through the chat template, its reply whole or streamed, split into
reasoning, content and tool calls. The Responses and Messages APIs (responses_api.py, messages_api.py) start and
split their replies here too."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from jaxserve.engine.async_engine import EngineDeadError, RequestStream
from jaxserve.engine.harmony import HarmonyReasoning, HarmonyStream
from jaxserve.engine.reasoning import ReasoningStream
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.errors import APIError, error_body
from jaxserve.server.protocol import BatchChatCompletionRequest, ChatCompletionRequest
from jaxserve.server.request_streams import (
    EngineStreamingResponse,
    RequestFailedError,
    chunk_usage,
    read_outputs,
    request_failure,
)
from jaxserve.server.serving import OpenAIServing
from jaxserve.server.sse import ChoiceStream, ChunkEncoder, chat_logprobs, prompt_logprobs_field, sse, usage
from jaxserve.server.tools import (
    TOOL_PARSERS,
    HarmonyOrConstrained,
    NamedCall,
    RequiredCalls,
    ToolCallExtractor,
    ToolCallStream,
    call_id,
    tool_call_field,
)
from jaxserve.tokenizer import render_chat


class ChatServing(OpenAIServing):
    """The chat completions route, and the chat machinery the Responses and Messages APIs share."""

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response | dict:
        """POST /v1/chat/completions."""
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        params, tools, streams = await self.start_chat(request_id, body)
        created = int(time.time())
        if body.stream:
            return EngineStreamingResponse(self._chat_chunks(request_id, created, streams[0], body, params, tools),
                                           streams)
        outputs = await self.final_outputs(streams, body, raw)
        if outputs is None:
            return Response(status_code=499)
        output = outputs[0]
        choices = [self._chat_choice(c.index, c, output, body, params, tools) for c in output.outputs]
        return {"id": request_id, "object": "chat.completion", "created": created,
                "model": self.models.model_name(body), "choices": choices, "usage": self.response_usage(outputs),
                "prompt_logprobs": prompt_logprobs_field(self.token_text, output.prompt_logprobs),
                "prompt_token_ids": output.prompt_token_ids if body.return_token_ids else None}

    async def batch(self, body: BatchChatCompletionRequest, raw: Request) -> Response | dict:
        """POST /v1/chat/completions/batch (vLLM's): every conversation checked and queued, or none; the choices
        are the conversations' replies, indexed in their order, the usage their sum."""
        body.check()
        requests = body.conversations()
        if len(requests) > self.config.max_prompts:
            raise APIError(400, f"messages must hold 1 to {self.config.max_prompts} conversations, got "
                                f"{len(requests)}", "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        first = requests[0]  # the conversations share every other field, so their checks and parameters
        params, tools = self._chat_params(first)
        prompts = [self.chat_prompt(request) for request in requests]
        await self.compile_constraint(first, params)
        created = int(time.time())
        outputs = await self.final_outputs(self.submit(request_id, prompts, first, params), first, raw)
        if outputs is None:
            return Response(status_code=499)
        choices = [self._chat_choice(index, output.outputs[0], output, request, params, tools)
                   for index, (request, output) in enumerate(zip(requests, outputs))]
        return {"id": request_id, "object": "chat.completion", "created": created,
                "model": self.models.model_name(body), "choices": choices, "usage": self.response_usage(outputs),
                "prompt_logprobs": None, "prompt_token_ids": None}

    async def start_chat(self, request_id: str, body: ChatCompletionRequest
                         ) -> tuple[SamplingParams, ToolCallExtractor | None, list[RequestStream]]:
        """Check a chat request, render its prompt, compile its constraint and queue it: (its sampling parameters,
        how its replies are split into content and tool calls, its one stream). APIError (400 naming the field) for
        anything the request gets wrong, 503 for an engine that is full or down."""
        params, tools = self._chat_params(body)
        prompt = self.chat_prompt(body)
        await self.compile_constraint(body, params)
        return params, tools, self.submit(request_id, [prompt], body, params)

    def _chat_params(self, body: ChatCompletionRequest) -> tuple[SamplingParams, ToolCallExtractor | None]:
        """(the sampling parameters, how replies are split into content and tool calls) of a checked chat request."""
        params = self.sampling_params(body)
        tools = self._tool_calls(body)
        formats = (tools, self.model.reasoning)  # a format whose markers are special tokens keeps them
        if any(part is not None and part.keeps_special_tokens for part in formats):
            params = dataclasses.replace(params, skip_special_tokens=False)
        return params, tools

    def _chat_choice(self, index: int, c: CompletionOutput, output: RequestOutput, body: ChatCompletionRequest,
                     params: SamplingParams, tools: ToolCallExtractor | None) -> dict:
        """One choice of a whole chat response: reply `c` as a message, its logprobs and finish."""
        message, finish_reason = self.chat_message(c, output, body, tools)
        return {"index": index, "message": message,
                "logprobs": self._chat_logprobs(body, params, c.token_ids, c.logprobs),
                "finish_reason": finish_reason, "stop_reason": c.stop_reason,
                "token_ids": c.token_ids if body.return_token_ids else None}

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The token ids of a chat request's conversation (and tools) under the chat template, each message as the
        reasoning parser's models read it; 400 when the template cannot render it."""
        conversation, parser = body.conversation(), self.model.reasoning
        if parser is not None:
            conversation = [parser.template_message(message) for message in conversation]
        try:
            return render_chat(self.tokenizer, conversation, body.add_generation_prompt,
                               body.continue_final_message, body.template_kwargs(), body.template_tools(),
                               self.config.chat_template)
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error), "messages") from error

    def chat_message(self, c: CompletionOutput, output: RequestOutput, body: ChatCompletionRequest,
                      tools: ToolCallExtractor | None) -> tuple[dict, str | None]:
        """(the message, the finish reason) of one whole chat reply: with a reasoning parser its thinking apart
        from its content; with tools the calls found in its content."""
        message, text = {"role": body.reply_role()}, c.text
        echo = body.echo_text()
        parser = self.model.reasoning
        if parser is not None:
            thought, text = parser.split(text, parser.starts_thinking(output.prompt_token_ids), final=True)
            message.update(_reasoning_fields(thought if body.include_reasoning else ""))
        if tools is None:
            # (with a reasoning parser, an answer the reply never reached is null, as in vLLM)
            message["content"] = (echo + text) or (None if parser is not None else "")
            return message, c.finish_reason
        content, calls = tools.extract(text, final=True)
        message["content"] = (echo + content) or None
        message["tool_calls"] = [tool_call_field(call, call_id()) for call in calls]
        return message, _finish_reason(c.finish_reason, bool(calls), tools)

    def reasoning_stream(self, output: RequestOutput) -> ReasoningStream | HarmonyStream | None:
        """The split of a reply into reasoning and content (engine/reasoning.py), None without a reasoning parser;
        the reply starts in the thinking unless its prompt has closed it."""
        parser = self.model.reasoning
        if parser is None:
            return None
        return parser.stream(parser.starts_thinking(output.prompt_token_ids))

    def _tool_calls(self, body: ChatCompletionRequest) -> ToolCallExtractor | None:
        """How the request's replies are split into content and tool calls (None: no tools, or tool_choice
        "none"); a 400 for "auto" on a server without a tool call parser."""
        choice = body.tool_choice_name()
        if choice == "none":
            return None
        if choice in ("required", "function"):
            constrained = RequiredCalls() if choice == "required" else NamedCall(body.tool_choice.function.name)
            harmony = isinstance(self.model.reasoning, HarmonyReasoning)
            return HarmonyOrConstrained(constrained) if harmony else constrained
        if self.config.tool_call_parser is None:
            raise APIError(400, 'tool_choice "auto" (the default with tools) needs the server started with '
                                f"--tool-call-parser ({', '.join(TOOL_PARSERS)}); give tool_choice \"required\", a "
                                'named function or "none"', "tool_choice")
        return TOOL_PARSERS[self.config.tool_call_parser](body.tools)

    def _chat_logprobs(self, body: ChatCompletionRequest, params: SamplingParams, token_ids: list[int],
                       logprobs) -> dict | None:
        if params.logprobs is None:
            return None
        return chat_logprobs(self.logprob_text(body), token_ids, logprobs, params.logprobs)

    async def _chat_chunks(self, request_id: str, created: int, stream: RequestStream, body: ChatCompletionRequest,
                           params: SamplingParams, tools: ToolCallExtractor | None) -> AsyncIterator[bytes]:
        """SSE chunks of a streamed chat completion: once the first output is in, the role of every choice
        (and the echo), then content; the last is `[DONE]`, or an error event when the engine fails the
        request."""
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.models.model_name(body)}
        encoder = ChunkEncoder(head)
        states = [ChoiceStream(params) for _ in range(params.n)]
        calls = [None if tools is None else ToolCallStream(tools) for _ in range(params.n)]
        reasonings = []  # each choice's ReasoningStream (or None), made with the first output
        include_usage, continuous = self.stream_usage(body)
        final, opened = None, False
        try:
            async for final in read_outputs(stream):
                if request_failure(final) is not None:
                    yield sse(error_body(400, request_failure(final)))
                    return
                if not opened:
                    for chunk in self._chat_opening(encoder, final, body, params.n, continuous):
                        yield chunk
                    reasonings = [self.reasoning_stream(final) for _ in range(params.n)]
                    opened = True
                for c in final.outputs:
                    chunk = self._chat_delta(encoder, states[c.index], calls[c.index], reasonings[c.index], final, c,
                                             body, params, continuous)
                    if chunk is not None:
                        yield chunk
            if include_usage:
                yield sse({**head, "choices": [], "usage": self.response_usage([final])})
        except EngineDeadError as error:
            yield sse(error_body(503, str(error)))
        except RequestFailedError as error:
            yield sse(error_body(400, str(error), body.param_of(str(error.__cause__))))
            return
        yield sse("[DONE]")

    def _chat_opening(self, encoder: ChunkEncoder, output: RequestOutput, body: ChatCompletionRequest, n: int,
                      continuous: bool) -> list[bytes]:
        """The first chunks of a streamed chat: each of the `n` choices' role (the first with the prompt's
        ids when asked), then, with echo, each choice's echoed last message."""
        role, echo = body.reply_role(), body.echo_text()
        counts = usage(len(output.prompt_token_ids), 0) if continuous else None
        prompt_ids = output.prompt_token_ids if body.return_token_ids else None
        chunks = [encoder.choice({"index": i, "delta": {"role": role, "content": ""}, "logprobs": None,
                                  "finish_reason": None}, usage=counts, prompt_token_ids=None if i else prompt_ids)
                  for i in range(n)]
        if echo:
            chunks += [encoder.choice({"index": i, "delta": {"content": echo}, "logprobs": None,
                                       "finish_reason": None}, usage=counts) for i in range(n)]
        return chunks

    def _chat_delta(self, encoder: ChunkEncoder, state: ChoiceStream, calls: ToolCallStream | None,
                    reasoning: ReasoningStream | HarmonyStream | None, output: RequestOutput, c: CompletionOutput,
                    body: ChatCompletionRequest, params: SamplingParams, continuous: bool) -> bytes | None:
        """The next chunk of sample `c` of a streamed chat (its text; with a reasoning parser its reasoning and
        content; with tools its content and tool call deltas), or None when there is nothing to send."""
        delta = reply_delta(state, calls, reasoning, c, body.include_reasoning)
        if delta is None:
            return None
        message, first_token, finish_reason = delta
        if not message and c.finish_reason is None and params.logprobs is None:
            return None  # (held back: it may be a marker or a tool call's start)
        choice = {"index": c.index, "delta": message,
                  "logprobs": self._chat_logprobs(body, params, c.token_ids[first_token:],
                                                  c.logprobs and c.logprobs[first_token:]),
                  "finish_reason": finish_reason}
        if c.finish_reason is not None:
            choice["stop_reason"] = c.stop_reason
        if body.return_token_ids:
            choice["token_ids"] = c.token_ids[first_token:]
        return encoder.choice(choice, usage=chunk_usage(continuous, output, state))


def reply_delta(state: ChoiceStream, calls: ToolCallStream | None, reasoning: ReasoningStream | HarmonyStream | None,
                c: CompletionOutput, include_reasoning: bool = True) -> tuple[dict, int, str | None] | None:
    """The next delta of a streamed chat reply `c`: (its message: `reasoning` / `reasoning_content` with a
    reasoning parser, `content`, `tool_calls` deltas with tools, each only when it has something; the index of
    its first token; the finish reason, "tool_calls" for a reply that called tools), or None when no text or end
    came. The message is empty while text is held back (a stop string, a marker or a tool call in the making)."""
    delta = state.advance(c)
    if delta is None:
        return None
    text, first_token = delta
    finish_reason, final = c.finish_reason, c.finish_reason is not None
    message = {}
    if reasoning is not None:
        thought, text = reasoning.advance(text, final)
        if thought and include_reasoning:
            message.update(_reasoning_fields(thought))
    if calls is None:
        message.update({"content": text} if text else {})
    else:
        message.update(calls.advance(text, final))
        finish_reason = _finish_reason(finish_reason, calls.called, calls.extractor)
    return message, first_token, finish_reason


def _reasoning_fields(thought: str) -> dict:
    """A message's thinking, under vLLM's name `reasoning` and its former `reasoning_content` (null when none)."""
    return {"reasoning": thought or None, "reasoning_content": thought or None}


def _finish_reason(finish_reason: str | None, called: bool, tools: ToolCallExtractor) -> str | None:
    """A reply's finish reason with tools: "tool_calls" for a reply that stopped after calling tools on its own
    or as `required` asked; a named function's reply keeps "stop" (OpenAI's and vLLM's rule)."""
    if finish_reason == "stop" and called and not tools.named:
        return "tool_calls"
    return finish_reason
