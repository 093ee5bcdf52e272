"""The OpenAI-compatible endpoints: validate a request, submit it to the async engine, answer.

Every request ends by closing its streams, whatever happened (finished, bad input after some
prompts were queued, client gone, engine failed), and closing aborts whatever still runs, so its
pages go back to the pool at once. A request the engine fails alone (a ValueError or RuntimeError
from its stream, or an output with `error`) answers 400, or, streamed, one error event and the end of
the stream without `[DONE]`; a dead engine answers 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from jaxserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError, RequestStream
from jaxserve.engine.beam_search import (
    BeamSearch,
    BeamSearchParams,
    async_engine_step,
    request_output,
    run_beam_search_async,
)
from jaxserve.engine.harmony import HarmonyReasoning, HarmonyStream
from jaxserve.engine.reasoning import ReasoningStream
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.config import ServerConfig
from jaxserve.server.errors import APIError, error_body
from jaxserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    _SamplingFields,
)
from jaxserve.server.sse import (
    ChoiceStream,
    ChunkEncoder,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_field,
    sse,
    token_id_text,
    usage,
    usage_of,
)
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
from jaxserve.tokenizer import render_chat, render_chat_text

logger = logging.getLogger("jaxserve")


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
        config.check_reasoning(engine.engine.reasoning)
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.token_text = TokenText(engine.tokenizer)
        self.max_model_len = engine.engine.max_model_len
        self.scheduling_policy = engine.engine.config.scheduler_config.scheduling_policy
        self.generation_defaults = dict(engine.engine.generation_defaults)
        # LoRA adapter name -> folder, a request's `model` may name one; the event loop's copy of the engine's,
        # updated by the load and unload routes
        self.loras = engine.engine.list_loras()
        logger.info("sampling defaults from the model's generation config, for the fields a request leaves "
                    "unset: %s", self.generation_defaults or "none")

    # ---- /v1/models, /tokenize, /detokenize ------------------------------------------------------

    def models(self) -> dict:
        """The served model under each of its names, then its LoRA adapters (each with the model as its `parent`,
        as vLLM lists them)."""
        created = int(time.time())
        cards = [{"id": name, "object": "model", "created": created, "owned_by": "jaxserve",
                  "root": self.engine.engine.model_path, "parent": None, "max_model_len": self.max_model_len}
                 for name in self.served_names]
        cards += [{"id": name, "object": "model", "created": created, "owned_by": "jaxserve", "root": path,
                   "parent": self.config.served_model_name, "max_model_len": self.max_model_len}
                  for name, path in self.loras.items()]
        return {"object": "list", "data": cards}

    def tokenize(self, body: TokenizeRequest) -> dict:
        """Token ids of a prompt, or of chat messages rendered by the chat template to text and then
        encoded (as vLLM); `token_strs` holds each token's string when asked for."""
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        unsupported = body.unsupported_fields()
        if unsupported:
            raise APIError(400, f"{', '.join(unsupported)} is not supported by this server", unsupported[0])
        text = body.prompt if body.messages is None else self._chat_text(body)
        tokens = self.tokenizer.encode(text, add_special_tokens=body.special_tokens())
        token_strs = self.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {"tokens": tokens, "token_strs": token_strs, "count": len(tokens), "max_model_len": self.max_model_len}

    def _chat_text(self, body: TokenizeRequest) -> str:
        """The text the chat template makes of `body.messages` (400 when it cannot be rendered)."""
        try:
            return render_chat_text(self.tokenizer, [m.for_template() for m in body.messages],
                                    body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs,
                                    body.tools, self.config.chat_template)
        except (ValueError, TypeError) as error:
            raise APIError(400, f"the chat template cannot render these messages: {error}", "messages") from error

    def tokenizer_info(self) -> dict:
        """The tokenizer's configuration as vLLM's /tokenizer_info gives it: its init arguments without
        file paths, its class and its chat template."""
        config = {name: _json_value(value) for name, value in (self.tokenizer.init_kwargs or {}).items()
                  if name not in ("vocab_file", "merges_file")}
        config["tokenizer_class"] = type(self.tokenizer).__name__
        template = self.config.chat_template or getattr(self.tokenizer, "chat_template", None)
        if template:
            config["chat_template"] = template
        return config

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
        if body.use_beam_search:
            if self.check_model(body.model) is not None:
                raise APIError(400, "use_beam_search runs on the base model only, not with a LoRA adapter", "model")
            return await self._beam_search_completion(request_id, prompts, body, params, raw)
        await self._compile_constraint(body, params)
        streams = self._submit(request_id, prompts, body, params)
        created = int(time.time())
        if body.stream and params.num_samples == params.n:
            return EngineStreamingResponse(self._completion_chunks(request_id, created, streams, body, params), streams)
        outputs = await self.final_outputs(streams, body, raw)
        if outputs is None:
            return Response(status_code=499)
        choices = [self._completion_choice(prompt_index * params.n + c.index, output, c, body, params)
                   for prompt_index, output in enumerate(outputs) for c in output.outputs]
        response = {"id": request_id, "object": "text_completion", "created": created,
                    "model": self.model_name(body), "choices": choices, "usage": self._usage(outputs)}
        if body.stream:  # best_of > n is not streamed (vLLM's rule, after OpenAI's): the whole response, one event
            return StreamingResponse(_one_event(response), media_type="text/event-stream",
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
            if not await _unless_client_leaves(search, raw):
                return Response(status_code=499)
        except (EngineOverloadedError, EngineDeadError) as error:
            raise self._unavailable(error) from error
        except (ValueError, RuntimeError) as error:  # a step the engine refused or failed
            raise APIError(400, str(error)) from error
        outputs = [request_output(f"{request_id}-{i}", search.output(self.tokenizer), body.n, self.tokenizer,
                                  body.skip_special_tokens, body.include_stop_str_in_output)
                   for i, search in enumerate(searches)]
        choices = [self._completion_choice(prompt_index * body.n + c.index, output, c, body, params)
                   for prompt_index, output in enumerate(outputs) for c in output.outputs]
        return {"id": request_id, "object": "text_completion", "created": created,
                "model": self.model_name(body), "choices": choices, "usage": self._usage(outputs)}

    def _beam_search(self, request_id: str, prompt: str | list[int], body: CompletionRequest, params: SamplingParams,
                     beam_params: BeamSearchParams) -> BeamSearch:
        """The search of one prompt, validated (and truncated) as a plain request of this body would be."""
        text, children = self.engine.make_requests(request_id, prompt, params, body.priority, body.cache_salt)
        request = children[0]
        return BeamSearch(request.prompt_token_ids, beam_params, request.eos_token_ids, self.max_model_len,
                          prompt=text, cache_salt=body.cache_salt)

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
        choices = []
        for c in output.outputs:
            message, finish_reason = self.chat_message(c, output, body, tools)
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._chat_logprobs(body, params, c.token_ids, c.logprobs),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason,
                            "token_ids": c.token_ids if body.return_token_ids else None})
        return {"id": request_id, "object": "chat.completion", "created": created,
                "model": self.model_name(body), "choices": choices, "usage": self._usage(outputs),
                "prompt_logprobs": prompt_logprobs_field(self.token_text, output.prompt_logprobs),
                "prompt_token_ids": output.prompt_token_ids if body.return_token_ids else None}

    async def start_chat(self, request_id: str, body: ChatCompletionRequest
                         ) -> tuple[SamplingParams, ToolCallExtractor | None, list[RequestStream]]:
        """Check a chat request, render its prompt, compile its constraint and queue it: (its sampling parameters,
        how its replies are split into content and tool calls, its one stream). APIError (400 naming the field) for
        anything the request gets wrong, 503 for an engine that is full or down."""
        params = self._sampling_params(body)
        tools = self._tool_calls(body)
        formats = (tools, self.engine.engine.reasoning)  # a format whose markers are special tokens keeps them
        if any(part is not None and part.keeps_special_tokens for part in formats):
            params = dataclasses.replace(params, skip_special_tokens=False)
        prompt = self.chat_prompt(body)
        await self._compile_constraint(body, params)
        return params, tools, self._submit(request_id, [prompt], body, params)

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The token ids of a chat request's conversation (and tools) under the chat template, each message as the
        reasoning parser's models read it; 400 when the template cannot render it."""
        conversation, parser = body.conversation(), self.engine.engine.reasoning
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
        parser = self.engine.engine.reasoning
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
        parser = self.engine.engine.reasoning
        if parser is None:
            return None
        return parser.stream(parser.starts_thinking(output.prompt_token_ids))

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        """POST /v1/load_lora_adapter: the adapter into a free slot, between two steps; 400 for a name in use, a
        folder the engine cannot serve or no free slot."""
        if body.lora_name in self.loras or body.lora_name in self.served_names:
            raise APIError(400, f"The lora adapter {body.lora_name!r} has already been loaded.", "lora_name")
        request = LoRARequest(body.lora_name, len(self.loras) + 1, body.lora_path)
        try:
            await self.engine.add_lora(request)
        except EngineDeadError as error:
            raise APIError(503, str(error)) from error
        except ValueError as error:
            raise APIError(400, str(error), "lora_path") from error
        self.loras[body.lora_name] = body.lora_path
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        """POST /v1/unload_lora_adapter: free the adapter's slot; 404 for one not loaded, 400 while a request runs
        with it."""
        if body.lora_name not in self.loras:
            raise APIError(404, f"The lora adapter {body.lora_name!r} cannot be found.", "lora_name",
                           "model_not_found")
        try:
            await self.engine.remove_lora(body.lora_name)
        except EngineDeadError as error:
            raise APIError(503, str(error)) from error
        except ValueError as error:
            raise APIError(400, str(error), "lora_name") from error
        del self.loras[body.lora_name]
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names, or None for the served model (any of its names, or no `model`); 404 for
        anything else."""
        if model is None or model in self.served_names:
            return None
        if model in self.loras:
            return model
        served = ", ".join(repr(name) for name in [*self.served_names, *self.loras])
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served}", "model",
                       "model_not_found")

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name the served model answers to, the one responses give first."""
        return self.config.served_model_name, *self.config.served_model_aliases

    def model_name(self, body: _SamplingFields) -> str:
        """The `model` a response names: the request's LoRA adapter, else the served model."""
        return self.check_model(body.model) or self.config.served_model_name

    def _sampling_params(self, body: _SamplingFields) -> SamplingParams:
        """Checks shared by both generation endpoints, then the request's SamplingParams, with the
        model's generation defaults in the fields the request leaves unset."""
        self.check_model(body.model)
        body.check()
        if not 1 <= body.n <= self.config.max_n:
            raise APIError(400, f"n must be in [1, {self.config.max_n}], got {body.n}", "n")
        best_of = body.best_of if isinstance(body, CompletionRequest) else None  # below n: SamplingParams says so
        if best_of is not None and best_of > self.config.max_n:
            raise APIError(400, f"best_of must be in [n, {self.config.max_n}], got {best_of}", "best_of")
        if body.priority != 0 and self.scheduling_policy != "priority":
            raise APIError(400, "priority needs the server to run with --scheduling-policy priority", "priority")
        try:
            return body.to_sampling_params(self.generation_defaults, self.max_model_len)
        except ValueError as error:  # SamplingParams' messages start with the field they are about
            raise APIError(400, str(error), body.param_of(str(error))) from error

    def _tool_calls(self, body: ChatCompletionRequest) -> ToolCallExtractor | None:
        """How the request's replies are split into content and tool calls (None: no tools, or tool_choice
        "none"); a 400 for "auto" on a server without a tool call parser."""
        choice = body.tool_choice_name()
        if choice == "none":
            return None
        if choice in ("required", "function"):
            constrained = RequiredCalls() if choice == "required" else NamedCall(body.tool_choice.function.name)
            harmony = isinstance(self.engine.engine.reasoning, HarmonyReasoning)
            return HarmonyOrConstrained(constrained) if harmony else constrained
        if self.config.tool_call_parser is None:
            raise APIError(400, 'tool_choice "auto" (the default with tools) needs the server started with '
                                f"--tool-call-parser ({', '.join(TOOL_PARSERS)}); give tool_choice \"required\", a "
                                'named function or "none"', "tool_choice")
        return TOOL_PARSERS[self.config.tool_call_parser](body.tools)

    async def _compile_constraint(self, body: _SamplingFields, params: SamplingParams) -> None:
        """Compile the request's output constraint before anything is queued (on the grammar engine's threads; the
        engine then finds it in the cache): a 400 naming the field for one that cannot be compiled."""
        constraint = params.structured_outputs
        if constraint is None:
            return
        field = next(iter(body.constraints()), None)
        if not self.engine.engine.config.structured_outputs_config.enable_structured_outputs:
            raise APIError(400, "this server's engine runs with enable_structured_outputs off: it cannot constrain "
                                "outputs", field)
        try:
            await asyncio.wrap_future(self.engine.engine.grammars.submit(constraint))
        except ValueError as error:
            raise APIError(400, str(error), field) from error

    def _submit(self, request_id: str, prompts: list, body: _SamplingFields,
                params: SamplingParams) -> list[RequestStream]:
        """Validate every prompt, then queue them all (or none)."""
        lora_name = self.check_model(body.model)
        try:
            made = [self.engine.make_requests(f"{request_id}-{i}", prompt, params, body.priority, body.cache_salt,
                                              lora_name) for i, prompt in enumerate(prompts)]
        except ValueError as error:  # about the prompt, or a token id of another field
            prompt_field = "prompt" if isinstance(body, CompletionRequest) else "messages"
            raise APIError(400, str(error), body.param_of(str(error)) or prompt_field) from error
        return self.queue(request_id, made)

    def queue(self, request_id: str, made: list) -> list[RequestStream]:
        """Queue requests validated by the engine's make_requests or make_pooling_requests, as `request_id`-0, -1,
        ...: all, or none and a 503 when the engine is full or down."""
        try:
            self.engine.check_capacity(len(made))
        except (EngineOverloadedError, EngineDeadError) as error:
            raise self._unavailable(error) from error
        return [self.engine.submit(f"{request_id}-{i}", m) for i, m in enumerate(made)]

    def _unavailable(self, error: EngineOverloadedError | EngineDeadError) -> APIError:
        """503 for an engine that is full (retry after a while) or down."""
        headers = {"Retry-After": str(self.config.retry_after_s)} if isinstance(error, EngineOverloadedError) else None
        return APIError(503, str(error), headers=headers)

    async def final_outputs(self, streams: list[RequestStream], body: _SamplingFields,
                            raw: Request) -> list[RequestOutput] | None:
        """The final output of every stream, or None when the client disconnects first; a request the
        engine failed alone is a 400."""
        try:
            outputs = await last_outputs(streams, raw)
        except RequestFailedError as error:
            raise APIError(400, str(error), body.param_of(str(error.__cause__))) from error
        for output in outputs or ():
            if request_failure(output) is not None:
                raise APIError(400, request_failure(output))
        return outputs

    def _usage(self, outputs: list[RequestOutput]) -> dict:
        return usage_of(outputs, self.config.enable_prompt_tokens_details)

    def _stream_usage(self, body: _SamplingFields) -> tuple[bool, bool]:
        """(a usage chunk ends the stream, every chunk carries the counts so far), as vLLM decides them."""
        options = body.stream_options
        include = self.config.enable_force_include_usage or (options is not None and options.include_usage)
        return include, include and options is not None and options.continuous_usage_stats

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
            self._logprob_text(body), token_ids, entries, params.logprobs, 0)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "prompt_logprobs": prompt_logprobs_field(self.token_text, output.prompt_logprobs),
                "prompt_token_ids": output.prompt_token_ids if body.return_token_ids else None,
                "token_ids": c.token_ids if body.return_token_ids else None}

    def _chat_logprobs(self, body: ChatCompletionRequest, params: SamplingParams, token_ids: list[int],
                       logprobs) -> dict | None:
        if params.logprobs is None:
            return None
        return chat_logprobs(self._logprob_text(body), token_ids, logprobs, params.logprobs)

    def _logprob_text(self, body: _SamplingFields) -> Callable[[int], str]:
        """How logprobs name a token: its text, or "token_id:N" under return_tokens_as_token_ids (the request's,
        else the server's)."""
        as_ids = body.return_tokens_as_token_ids
        as_ids = self.config.return_tokens_as_token_ids if as_ids is None else as_ids
        return token_id_text if as_ids else self.token_text

    async def _completion_chunks(self, request_id: str, created: int, streams: list[RequestStream],
                                 body: CompletionRequest, params: SamplingParams) -> AsyncIterator[bytes]:
        """SSE chunks of a streamed completion; the last is `[DONE]`, or an error event when the engine
        fails the request."""
        head = {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name(body)}
        encoder = ChunkEncoder(head)
        states = [[ChoiceStream(params) for _ in range(params.n)] for _ in streams]
        finals: list[RequestOutput | None] = [None] * len(streams)
        include_usage, continuous = self._stream_usage(body)
        try:
            async for prompt_index, output in _merge(streams):
                finals[prompt_index] = output
                if request_failure(output) is not None:
                    yield sse(error_body(400, request_failure(output)))
                    return
                for c in output.outputs:
                    state = states[prompt_index][c.index]
                    choice = self._completion_delta(state, output, c, body, params)
                    if choice is not None:
                        yield encoder.choice({"index": prompt_index * params.n + c.index, **choice},
                                             usage=_chunk_usage(continuous, output, state))
            if include_usage:
                yield sse({**head, "choices": [], "usage": self._usage(finals)})
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
        logprobs = completion_logprobs(self._logprob_text(body), token_ids, entries, params.logprobs,
                                       state.token_chars)
        state.token_chars += sum(len(token) for token in logprobs["tokens"])
        return logprobs

    async def _chat_chunks(self, request_id: str, created: int, stream: RequestStream, body: ChatCompletionRequest,
                           params: SamplingParams, tools: ToolCallExtractor | None) -> AsyncIterator[bytes]:
        """SSE chunks of a streamed chat completion: once the first output is in, the role of every choice
        (and the echo), then content; the last is `[DONE]`, or an error event when the engine fails the
        request."""
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name(body)}
        encoder = ChunkEncoder(head)
        states = [ChoiceStream(params) for _ in range(params.n)]
        calls = [None if tools is None else ToolCallStream(tools) for _ in range(params.n)]
        reasonings = []  # each choice's ReasoningStream (or None), made with the first output
        include_usage, continuous = self._stream_usage(body)
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
                yield sse({**head, "choices": [], "usage": self._usage([final])})
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
        return encoder.choice(choice, usage=_chunk_usage(continuous, output, state))


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


def _json_value(value: object) -> object:
    """`value` in plain JSON types: special-token objects become their text, anything else unknown its str."""
    if isinstance(value, dict):
        return {str(key): _json_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    content = getattr(value, "content", None)  # a tokenizers AddedToken
    return content if isinstance(content, str) else str(value)


def _reasoning_fields(thought: str) -> dict:
    """A message's thinking, under vLLM's name `reasoning` and its former `reasoning_content` (null when none)."""
    return {"reasoning": thought or None, "reasoning_content": thought or None}


def _finish_reason(finish_reason: str | None, called: bool, tools: ToolCallExtractor) -> str | None:
    """A reply's finish reason with tools: "tool_calls" for a reply that stopped after calling tools on its own
    or as `required` asked; a named function's reply keeps "stop" (OpenAI's and vLLM's rule)."""
    if finish_reason == "stop" and called and not tools.named:
        return "tool_calls"
    return finish_reason


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
        finished = await _unless_client_leaves(asyncio.gather(*(last(s) for s in streams)), raw)
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


def _chunk_usage(continuous: bool, output: RequestOutput, state: ChoiceStream) -> dict | None:
    """The counts so far of one streamed sample (vLLM's continuous_usage_stats), or None when not asked."""
    return usage(len(output.prompt_token_ids), state.num_tokens) if continuous else None


async def _one_event(response: dict) -> AsyncIterator[bytes]:
    """A whole response as a stream: one event, then `[DONE]` (what a request gets that asked to stream
    a result that cannot be streamed)."""
    yield sse(response)
    yield sse("[DONE]")


async def _unless_client_leaves(work: Awaitable, raw: Request) -> tuple | None:
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


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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
