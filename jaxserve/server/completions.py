"""POST /v1/completions: prompts in, completions out, whole or streamed; beam search (vLLM's use_beam_search)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from jaxserve.engine.async_engine import EngineDeadError, EngineOverloadedError, RequestStream
from jaxserve.engine.beam_search import (
    BeamSearch,
    BeamSearchParams,
    async_engine_step,
    request_output,
    run_beam_search_async,
)
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.errors import APIError, error_body
from jaxserve.server.protocol import CompletionRequest
from jaxserve.server.request_streams import (
    EngineStreamingResponse,
    RequestFailedError,
    chunk_usage,
    merge_streams,
    one_event,
    request_failure,
    unless_client_leaves,
)
from jaxserve.server.serving import OpenAIServing
from jaxserve.server.sse import ChoiceStream, ChunkEncoder, completion_logprobs, prompt_logprobs_field, sse


class CompletionServing(OpenAIServing):
    """The completions route."""

    async def completions(self, body: CompletionRequest, raw: Request) -> Response | dict:
        """POST /v1/completions."""
        params = self.sampling_params(body)
        prompts = body.prompts()
        if not 1 <= len(prompts) <= self.config.max_prompts:
            raise APIError(400, f"prompt must hold 1 to {self.config.max_prompts} prompts, got {len(prompts)}",
                           "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if body.use_beam_search:
            if self.models.check_model(body.model) is not None:
                raise APIError(400, "use_beam_search runs on the base model only, not with a LoRA adapter", "model")
            return await self._beam_search_completion(request_id, prompts, body, params, raw)
        await self.compile_constraint(body, params)
        streams = self.submit(request_id, prompts, body, params)
        created = int(time.time())
        if body.stream and params.num_samples == params.n:
            return EngineStreamingResponse(self._completion_chunks(request_id, created, streams, body, params), streams)
        outputs = await self.final_outputs(streams, body, raw)
        if outputs is None:
            return Response(status_code=499)
        choices = [self._completion_choice(prompt_index * params.n + c.index, output, c, body, params)
                   for prompt_index, output in enumerate(outputs) for c in output.outputs]
        response = {"id": request_id, "object": "text_completion", "created": created,
                    "model": self.models.model_name(body), "choices": choices, "usage": self.response_usage(outputs)}
        if body.stream:  # best_of > n is not streamed (vLLM's rule, after OpenAI's): the whole response, one event
            return StreamingResponse(one_event(response), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return response

    async def _beam_search_completion(self, request_id: str, prompts: list, body: CompletionRequest,
                                      params: SamplingParams, raw: Request) -> Response | dict:
        """use_beam_search (vLLM's extra field): the n best beams of each prompt are its choices. Every step
        runs each live beam as a one-token request through the async engine (jaxserve/engine/beam_search.py); a
        client that leaves cancels the search, which aborts the step in flight."""
        created = int(time.time())
        try:
            beam_params = body.to_beam_search_params()
            searches = [self._beam_search(f"{request_id}-{i}", prompt, body, params, beam_params)
                        for i, prompt in enumerate(prompts)]
        except ValueError as error:
            raise APIError(400, str(error), body.param_of(str(error)) or "prompt") from error
        search = run_beam_search_async(searches, async_engine_step(self.engine, request_id, beam_params, body.priority))
        try:
            if not await unless_client_leaves(search, raw):
                return Response(status_code=499)
        except (EngineOverloadedError, EngineDeadError) as error:
            raise self.unavailable(error) from error
        except (ValueError, RuntimeError) as error:  # a step the engine refused or failed
            raise APIError(400, str(error)) from error
        outputs = [request_output(f"{request_id}-{i}", search.output(self.tokenizer), body.n, self.tokenizer,
                                  body.skip_special_tokens, body.include_stop_str_in_output)
                   for i, search in enumerate(searches)]
        choices = [self._completion_choice(prompt_index * body.n + c.index, output, c, body, params)
                   for prompt_index, output in enumerate(outputs) for c in output.outputs]
        return {"id": request_id, "object": "text_completion", "created": created,
                "model": self.models.model_name(body), "choices": choices, "usage": self.response_usage(outputs)}

    def _beam_search(self, request_id: str, prompt: str | list[int], body: CompletionRequest, params: SamplingParams,
                     beam_params: BeamSearchParams) -> BeamSearch:
        """The search of one prompt, validated (and truncated) as a plain request of this body would be."""
        text, children = self.engine.make_requests(request_id, prompt, params, body.priority, body.cache_salt)
        request = children[0]
        return BeamSearch(request.prompt_token_ids, beam_params, request.eos_token_ids, self.model.max_model_len,
                          prompt=text, cache_salt=body.cache_salt)

    def _prompt_text(self, output: RequestOutput, params: SamplingParams) -> str:
        """The prompt as echo repeats it: its text, or its ids decoded when it was given as ids or truncated."""
        if output.prompt is not None and params.truncate_prompt_tokens is None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids)

    def _completion_choice(self, index: int, output: RequestOutput, c: CompletionOutput, body: CompletionRequest,
                           params: SamplingParams) -> dict:
        """One choice of a completion; with echo, its text and logprobs start with the prompt's."""
        text, token_ids, entries = c.text, c.token_ids, c.logprobs
        if body.echo:
            text = self._prompt_text(output, params) + text
            token_ids = output.prompt_token_ids + token_ids
            entries = None if params.logprobs is None else output.prompt_logprobs + entries
        logprobs = None if params.logprobs is None else completion_logprobs(
            self.logprob_text(body), token_ids, entries, params.logprobs, 0)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "prompt_logprobs": prompt_logprobs_field(self.token_text, output.prompt_logprobs),
                "prompt_token_ids": output.prompt_token_ids if body.return_token_ids else None,
                "token_ids": c.token_ids if body.return_token_ids else None}

    async def _completion_chunks(self, request_id: str, created: int, streams: list[RequestStream],
                                 body: CompletionRequest, params: SamplingParams) -> AsyncIterator[bytes]:
        """SSE chunks of a streamed completion; the last is `[DONE]`, or an error event when the engine
        fails the request."""
        head = {"id": request_id, "object": "text_completion", "created": created,
                "model": self.models.model_name(body)}
        encoder = ChunkEncoder(head, nulls=("usage",))
        states = [[ChoiceStream(params) for _ in range(params.n)] for _ in streams]
        finals: list[RequestOutput | None] = [None] * len(streams)
        include_usage, continuous = self.stream_usage(body)
        try:
            async for prompt_index, output in merge_streams(streams):
                finals[prompt_index] = output
                if request_failure(output) is not None:
                    yield sse(error_body(400, request_failure(output)))
                    return
                for c in output.outputs:
                    state = states[prompt_index][c.index]
                    choice = self._completion_delta(state, output, c, body, params)
                    if choice is not None:
                        yield encoder.choice({"index": prompt_index * params.n + c.index, **choice},
                                             usage=chunk_usage(continuous, output, state))
            if include_usage:
                yield sse({**head, "choices": [], "usage": self.response_usage(finals)})
        except EngineDeadError as error:
            yield sse(error_body(503, str(error)))
        except RequestFailedError as error:
            yield sse(error_body(400, str(error), body.param_of(str(error.__cause__))))
            return
        yield sse("[DONE]")

    def _completion_delta(self, state: ChoiceStream, output: RequestOutput, c: CompletionOutput,
                          body: CompletionRequest, params: SamplingParams) -> dict | None:
        """The next streamed choice of sample `c` (None when there is nothing to send): its new text and
        tokens, and in its first chunk the echoed prompt (text, logprobs) and the prompt's ids."""
        echo = body.echo and not state.started
        delta = state.advance(c)
        if delta is None and not echo:
            return None
        text, first_token = delta or ("", state.num_tokens)
        token_ids = c.token_ids[first_token:state.num_tokens]
        logprob_ids, entries = token_ids, None
        if params.logprobs is not None:
            entries = c.logprobs[first_token:state.num_tokens]
        if echo:
            text = self._prompt_text(output, params) + text
            logprob_ids = output.prompt_token_ids + token_ids
            entries = None if entries is None else output.prompt_logprobs + entries
        choice = {"text": text, "logprobs": self._streamed_logprobs(state, logprob_ids, entries, body, params),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if body.return_token_ids:
            if not state.started:
                choice["prompt_token_ids"] = output.prompt_token_ids
            choice["token_ids"] = token_ids
        state.started = True
        return choice

    def _streamed_logprobs(self, state: ChoiceStream, token_ids: list[int], entries: list | None,
                           body: CompletionRequest, params: SamplingParams) -> dict | None:
        """The logprobs of a chunk; text offsets go on from the token texts already sent, so they equal
        the offsets of the whole response however the text was held back."""
        if params.logprobs is None:
            return None
        logprobs = completion_logprobs(self.logprob_text(body), token_ids, entries, params.logprobs,
                                       state.token_chars)
        state.token_chars += sum(len(token) for token in logprobs["tokens"])
        return logprobs
