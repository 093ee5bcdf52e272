"""The OpenAI-compatible endpoints: validate a request, submit it to the async engine, answer.

Every request ends by closing its streams, whatever happened (finished, bad input after some
prompts were queued, client gone, engine failed), and closing aborts whatever still runs, so its
pages go back to the pool at once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from jaxserve.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError, RequestStream
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.config import ServerConfig
from jaxserve.server.errors import APIError, error_body
from jaxserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _SamplingFields,
)
from jaxserve.server.responses import (
    ChoiceStream,
    ChunkEncoder,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    sse,
    usage_of,
)
from jaxserve.tokenizer import render_chat


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


class OpenAIServing:
    """Handlers of /v1/completions, /v1/chat/completions, /v1/models, /tokenize and /detokenize."""

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.token_text = TokenText(engine.tokenizer)
        self.max_model_len = engine.engine.max_model_len
        self.scheduling_policy = engine.engine.config.scheduling_policy

    # ---- /v1/models, /tokenize, /detokenize ------------------------------------------------------

    def models(self) -> dict:
        """The one served model."""
        card = {"id": self.config.served_model_name, "object": "model", "created": int(time.time()),
                "owned_by": "jaxserve", "root": self.engine.engine.model_path, "max_model_len": self.max_model_len}
        return {"object": "list", "data": [card]}

    def tokenize(self, body: TokenizeRequest) -> dict:
        """Token ids of a prompt, or of chat messages under the chat template."""
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        try:
            if body.messages is not None:
                tokens = render_chat(self.tokenizer, [m.for_template() for m in body.messages], body.add_generation_prompt)
            else:
                tokens = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except ValueError as error:
            raise APIError(400, str(error), "messages") from error
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        """Text of token ids."""
        self.check_model(body.model)
        vocab_size = self.engine.engine.core.spec.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"token ids {bad[:8]} are outside the vocabulary [0, {vocab_size})", "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    # ---- generation --------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, raw: Request) -> Response | dict:
        """POST /v1/completions."""
        params = self._sampling_params(body)
        prompts = body.prompts()
        if not 1 <= len(prompts) <= self.config.max_prompts:
            raise APIError(400, f"prompt must hold 1 to {self.config.max_prompts} prompts, got {len(prompts)}", "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = self._submit(request_id, prompts, params, body.priority)
        created = int(time.time())
        if body.stream:
            chunks = self._completion_chunks(request_id, created, streams, params, body.include_usage)
            return EngineStreamingResponse(chunks, streams)
        outputs = await self._final_outputs(streams, raw)
        if outputs is None:
            return Response(status_code=499)
        choices = []
        for prompt_index, output in enumerate(outputs):
            for c in output.outputs:
                logprobs = None if params.logprobs is None else completion_logprobs(
                    self.token_text, c.token_ids, c.logprobs, 0)
                choices.append({"index": prompt_index * params.n + c.index, "text": c.text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": request_id, "object": "text_completion", "created": created,
                "model": self.config.served_model_name, "choices": choices, "usage": usage_of(outputs)}

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response | dict:
        """POST /v1/chat/completions."""
        params = self._sampling_params(body)
        try:
            prompt = render_chat(self.tokenizer, body.conversation(), body.add_generation_prompt,
                                 body.continue_final_message, body.chat_template_kwargs)
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error), "messages") from error
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = self._submit(request_id, [prompt], params, body.priority)
        created = int(time.time())
        if body.stream:
            chunks = self._chat_chunks(request_id, created, streams[0], params, body.include_usage)
            return EngineStreamingResponse(chunks, streams)
        outputs = await self._final_outputs(streams, raw)
        if outputs is None:
            return Response(status_code=499)
        choices = [
            {"index": c.index, "message": {"role": "assistant", "content": c.text},
             "logprobs": self._chat_logprobs(params, c.token_ids, c.logprobs),
             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            for c in outputs[0].outputs
        ]
        return {"id": request_id, "object": "chat.completion", "created": created,
                "model": self.config.served_model_name, "choices": choices, "usage": usage_of(outputs)}

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is absent or the served model's name."""
        if model is not None and model != self.config.served_model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.config.served_model_name!r}", "model", "model_not_found")

    def _sampling_params(self, body: _SamplingFields) -> SamplingParams:
        """Checks shared by both generation endpoints, then the request's SamplingParams."""
        self.check_model(body.model)
        unsupported = body.unsupported_fields()
        if unsupported:
            raise APIError(400, f"{', '.join(unsupported)} is not supported by this server", unsupported[0])
        if not 1 <= body.n <= self.config.max_n:
            raise APIError(400, f"n must be in [1, {self.config.max_n}], got {body.n}", "n")
        if body.priority != 0 and self.scheduling_policy != "priority":
            raise APIError(400, "priority needs the server to run with --scheduling-policy priority", "priority")
        try:
            return body.to_sampling_params()
        except ValueError as error:  # SamplingParams' messages start with the field they are about
            field = str(error).split(" ", 1)[0]
            raise APIError(400, str(error), field if field in type(body).model_fields else None) from error

    def _submit(self, request_id: str, prompts: list, params: SamplingParams, priority: int) -> list[RequestStream]:
        """Validate every prompt, then queue them all (or none)."""
        try:
            made = [self.engine.make_requests(f"{request_id}-{i}", prompt, params, priority)
                    for i, prompt in enumerate(prompts)]
        except ValueError as error:
            raise APIError(400, str(error), "prompt") from error
        try:
            self.engine.check_capacity(len(made))
        except EngineOverloadedError as error:
            raise APIError(503, str(error), headers={"Retry-After": str(self.config.retry_after_s)}) from error
        except EngineDeadError as error:
            raise APIError(503, str(error)) from error
        return [self.engine.submit(f"{request_id}-{i}", m) for i, m in enumerate(made)]

    async def _final_outputs(self, streams: list[RequestStream], raw: Request) -> list[RequestOutput] | None:
        """The final output of every stream, or None when the client disconnects first."""

        async def last(stream: RequestStream) -> RequestOutput:
            output = None
            async for output in stream:
                pass
            return output

        work = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
        gone = asyncio.ensure_future(_client_disconnected(raw))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                return None
            return work.result()
        except EngineDeadError as error:
            raise APIError(503, str(error)) from error
        finally:
            work.cancel()
            gone.cancel()
            for stream in streams:
                stream.close()

    def _chat_logprobs(self, params: SamplingParams, token_ids: list[int], logprobs) -> dict | None:
        if params.logprobs is None:
            return None
        return chat_logprobs(self.token_text, token_ids, logprobs, params.logprobs)

    async def _completion_chunks(self, request_id: str, created: int, streams: list[RequestStream],
                                 params: SamplingParams, include_usage: bool) -> AsyncIterator[bytes]:
        """SSE chunks of a streamed completion; the last is `[DONE]`."""
        head = {"id": request_id, "object": "text_completion", "created": created, "model": self.config.served_model_name}
        encoder = ChunkEncoder(head)
        choices = [[ChoiceStream(params) for _ in range(params.n)] for _ in streams]
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for prompt_index, output in _merge(streams):
                finals[prompt_index] = output
                for c in output.outputs:
                    delta = choices[prompt_index][c.index].advance(c)
                    if delta is None:
                        continue
                    text, first_token = delta
                    logprobs = None
                    if params.logprobs is not None:
                        offset = choices[prompt_index][c.index].num_chars - len(text)
                        logprobs = completion_logprobs(self.token_text, c.token_ids[first_token:],
                                                       c.logprobs[first_token:], offset)
                    yield encoder.choice({"index": prompt_index * params.n + c.index, "text": text,
                                          "logprobs": logprobs, "finish_reason": c.finish_reason,
                                          "stop_reason": c.stop_reason})
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage_of(finals)})
        except EngineDeadError as error:
            yield sse(error_body(503, str(error)))
        yield sse("[DONE]")

    async def _chat_chunks(self, request_id: str, created: int, stream: RequestStream, params: SamplingParams,
                           include_usage: bool) -> AsyncIterator[bytes]:
        """SSE chunks of a streamed chat completion: the role first, then content; the last is `[DONE]`."""
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.config.served_model_name}
        encoder = ChunkEncoder(head)
        choices = [ChoiceStream(params) for _ in range(params.n)]
        for index in range(params.n):
            yield encoder.choice({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None})
        final = None
        try:
            async for final in stream:
                for c in final.outputs:
                    delta = choices[c.index].advance(c)
                    if delta is None:
                        continue
                    text, first_token = delta
                    choice = {"index": c.index, "delta": {"content": text} if text else {},
                              "logprobs": self._chat_logprobs(params, c.token_ids[first_token:],
                                                              c.logprobs and c.logprobs[first_token:]),
                              "finish_reason": c.finish_reason}
                    if c.finish_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    yield encoder.choice(choice)
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage_of([final])})
        except EngineDeadError as error:
            yield sse(error_body(503, str(error)))
        yield sse("[DONE]")


async def _client_disconnected(raw: Request) -> None:
    """Return once the client has gone (the body has already been read)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams as they arrive."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
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
