"""What every route that runs requests shares: its checks and sampling parameters, queueing all of a request's prompts
or none, its final outputs, usage and logprob naming. The routes themselves are completions.py, chat.py,
tokenization.py, embeddings.py, responses_api.py and messages_api.py; models.py owns the model's names.

A request the engine fails alone (a ValueError or RuntimeError from its stream, or an output with `error`) answers
400, or, streamed, one error event and the end of the stream without `[DONE]`; a dead engine answers 503.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import Request

from jaxserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError, RequestStream
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.config import ServerConfig
from jaxserve.server.errors import APIError
from jaxserve.server.models import ServedModels
from jaxserve.server.protocol import CompletionRequest, _SamplingFields
from jaxserve.server.request_streams import RequestFailedError, last_outputs, request_failure
from jaxserve.server.sse import TokenText, token_id_text, usage_of

logger = logging.getLogger("jaxserve")


class OpenAIServing:
    """The engine facade every route works through: the async engine (requests and commands), the model's facts
    (`engine.model`), the server's options and the served names."""

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig, models: ServedModels):
        self.engine = engine
        self.config = config
        self.models = models
        self.model = engine.model  # the served model's facts (engine/served_model.py)
        self.tokenizer = engine.tokenizer
        self.token_text = TokenText(engine.tokenizer)

    def sampling_params(self, body: _SamplingFields) -> SamplingParams:
        """Checks shared by both generation endpoints, then the request's SamplingParams, with the
        model's generation defaults in the fields the request leaves unset."""
        self.models.check_model(body.model)
        body.check()
        unknown = body.unknown_fields()
        if unknown:  # vLLM's behaviour: said in the log; OpenAI's (--reject-unknown-fields): a 400
            if self.config.reject_unknown_fields:
                raise APIError(400, f"unknown request fields: {', '.join(unknown)}", unknown[0].split(" ")[0])
            logger.warning("request fields ignored (this server does not know them): %s", ", ".join(unknown))
        if not 1 <= body.n <= self.config.max_n:
            raise APIError(400, f"n must be in [1, {self.config.max_n}], got {body.n}", "n")
        best_of = body.best_of if isinstance(body, CompletionRequest) else None  # below n: SamplingParams says so
        if best_of is not None and best_of > self.config.max_n:
            raise APIError(400, f"best_of must be in [n, {self.config.max_n}], got {best_of}", "best_of")
        if body.priority != 0 and self.model.scheduling_policy != "priority":
            raise APIError(400, "priority needs the server to run with --scheduling-policy priority", "priority")
        try:
            return body.to_sampling_params(self.model.generation_defaults, self.model.max_model_len)
        except ValueError as error:  # SamplingParams' messages start with the field they are about
            raise APIError(400, str(error), body.param_of(str(error))) from error

    async def compile_constraint(self, body: _SamplingFields, params: SamplingParams) -> None:
        """Compile the request's output constraint before anything is queued (on the grammar engine's threads; the
        engine then finds it in the cache): a 400 naming the field for one that cannot be compiled."""
        constraint = params.structured_outputs
        if constraint is None:
            return
        field = next(iter(body.constraints()), None)
        if not self.model.structured_outputs:
            raise APIError(400, "this server's engine runs with enable_structured_outputs off: it cannot constrain "
                                "outputs", field)
        try:
            await self.engine.compile_grammar(constraint)
        except ValueError as error:
            raise APIError(400, str(error), field) from error

    def submit(self, request_id: str, prompts: list, body: _SamplingFields,
                params: SamplingParams) -> list[RequestStream]:
        """Validate every prompt, then queue them all (or none)."""
        lora_name = self.models.check_model(body.model)
        try:
            made = [self.engine.make_requests(f"{request_id}-{i}", prompt, params, body.priority, body.cache_salt,
                                              lora_name) for i, prompt in enumerate(prompts)]
        except ValueError as error:  # about the prompt, or a token id of another field
            prompt_field = "prompt" if isinstance(body, CompletionRequest) else "messages"
            raise APIError(400, str(error), body.param_of(str(error)) or prompt_field) from error
        return self.queue(request_id, made, whole=not body.stream)

    def queue(self, request_id: str, made: list, whole: bool = True) -> list[RequestStream]:
        """Queue requests validated by the engine's make_requests or make_pooling_requests, as `request_id`-0, -1,
        ...: all, or none and a 503 when the engine is full or down. `whole`: their replies are sent whole (their
        readers wake only for the final outputs), not streamed."""
        try:
            self.engine.check_capacity(len(made))
        except (EngineOverloadedError, EngineDeadError) as error:
            raise self.unavailable(error) from error
        return [self.engine.submit(f"{request_id}-{i}", m, whole=whole) for i, m in enumerate(made)]

    def unavailable(self, error: EngineOverloadedError | EngineDeadError) -> APIError:
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

    def response_usage(self, outputs: list[RequestOutput]) -> dict:
        return usage_of(outputs, self.config.enable_prompt_tokens_details)

    def stream_usage(self, body: _SamplingFields) -> tuple[bool, bool]:
        """(a usage chunk ends the stream, every chunk carries the counts so far), as vLLM decides them: both under
        --enable-force-include-usage, else as `stream_options` asks (the counts so far only with include_usage)."""
        if self.config.enable_force_include_usage:
            return True, True
        options = body.stream_options
        include = options is not None and options.include_usage
        return include, include and options.continuous_usage_stats

    def logprob_text(self, body: _SamplingFields) -> Callable[[int], str]:
        """How logprobs name a token: its text, or "token_id:N" under return_tokens_as_token_ids (the request's,
        else the server's)."""
        as_ids = body.return_tokens_as_token_ids
        as_ids = self.config.return_tokens_as_token_ids if as_ids is None else as_ids
        return token_id_text if as_ids else self.token_text
