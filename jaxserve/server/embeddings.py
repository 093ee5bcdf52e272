"""POST /v1/embeddings (OpenAI's Embeddings API, with vLLM's extras): each input's embedding from an engine
started with runner pooling (jaxserve/pooling/)."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from jaxserve.engine.async_engine import EngineDeadError, EngineOverloadedError, RequestStream
from jaxserve.outputs import PoolingRequestOutput
from jaxserve.pooling.params import PoolingParams
from jaxserve.server.errors import APIError
from jaxserve.server.serving import OpenAIServing, RequestFailedError, last_outputs


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: OpenAI's fields and vLLM's extras (`truncate_prompt_tokens`, `add_special_tokens`,
    `normalize`, `priority`). Unknown fields are ignored, as on the other routes."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # keep each input's last that many tokens; -1: max_model_len
    add_special_tokens: bool = True  # text inputs are tokenized with the tokenizer's special tokens (BOS, ...)
    normalize: bool | None = None  # None: the server's pooler decides
    priority: int = 0
    messages: Any = None  # vLLM's chat-shaped embedding request: refused

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text or token ids."""
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        return list(value)


class EmbeddingsServing:
    """The handler of /v1/embeddings, on the OpenAI server's engine and checks."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.engine = serving.engine

    async def create(self, body: EmbeddingRequest, raw: Request) -> Response | dict:
        """POST /v1/embeddings: every input's embedding, in input order (OpenAI's `list` of `embedding`s), with the
        prompt tokens they took; a 400 naming the field for what the engine cannot serve."""
        serving = self.serving
        lora_name = serving.check_model(body.model)
        if body.messages is not None:
            raise APIError(400, "messages: chat-shaped embedding requests are not supported; render the chat to "
                                "text (POST /tokenize with messages) and send it as input", "messages")
        inputs = body.inputs()
        if not 1 <= len(inputs) <= serving.config.max_prompts:
            raise APIError(400, f"input must hold 1 to {serving.config.max_prompts} inputs, got {len(inputs)}",
                           "input")
        if body.priority != 0 and serving.scheduling_policy != "priority":
            raise APIError(400, "priority needs the server to run with --scheduling-policy priority", "priority")
        truncate = serving.max_model_len if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
        try:
            params = PoolingParams(body.dimensions, body.normalize, truncate)
        except ValueError as error:  # PoolingParams' messages start with the field they are about
            raise APIError(400, str(error), str(error).split()[0]) from error
        request_id = f"embd-{uuid.uuid4().hex}"
        streams = self._submit(request_id, [self._prompt(text_or_ids, body) for text_or_ids in inputs], params,
                               body.priority, lora_name)
        outputs = await self._final_outputs(streams, raw)
        if outputs is None:
            return Response(status_code=499)
        num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        data = [{"object": "embedding", "index": index, "embedding": _encoded(output.outputs.embedding,
                                                                              body.encoding_format)}
                for index, output in enumerate(outputs)]
        return {"id": request_id, "object": "list", "created": int(time.time()), "model": serving.model_name(body),
                "data": data, "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens,
                                        "completion_tokens": 0, "prompt_tokens_details": None}}

    def _prompt(self, text_or_ids: str | list[int], body: EmbeddingRequest) -> str | list[int]:
        """An input as the engine takes it: token ids as they are; text as it is, or tokenized here without the
        special tokens when `add_special_tokens` is false."""
        if isinstance(text_or_ids, str) and not body.add_special_tokens and text_or_ids:
            return self.serving.tokenizer.encode(text_or_ids, add_special_tokens=False)
        return text_or_ids

    def _submit(self, request_id: str, prompts: list, params: PoolingParams, priority: int,
                lora_name: str | None) -> list[RequestStream]:
        """Validate every input, then queue them all (or none)."""
        try:
            made = [self.engine.make_pooling_requests(f"{request_id}-{i}", prompt, params, priority,
                                                      lora_name=lora_name) for i, prompt in enumerate(prompts)]
        except ValueError as error:  # the engine's runner, the input, or the dimensions
            message = str(error)
            param = "dimensions" if message.startswith("dimensions") else ("model" if "runner" in message else "input")
            raise APIError(400, message, param) from error
        try:
            self.engine.check_capacity(len(made))
        except (EngineOverloadedError, EngineDeadError) as error:
            raise self.serving.unavailable(error) from error
        return [self.engine.submit(f"{request_id}-{i}", m) for i, m in enumerate(made)]

    async def _final_outputs(self, streams: list[RequestStream], raw: Request) -> list[PoolingRequestOutput] | None:
        """Every stream's final output, or None when the client disconnects first; 400 for a request the engine
        failed alone, 503 when the engine is down."""
        try:
            outputs = await last_outputs(streams, raw)
        except RequestFailedError as error:
            raise APIError(400, str(error)) from error
        for output in outputs or ():
            if output.outputs is None:
                raise APIError(400, str(RequestFailedError(output.error or "no embedding came back")))
        return outputs


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    """An embedding as OpenAI sends it: the floats, or (base64) their little-endian float32 bytes in base64."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, "<f4").tobytes()).decode("ascii")
