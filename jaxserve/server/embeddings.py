"""The pooling routes of an engine started with runner pooling (jaxserve/pooling/): POST /v1/embeddings (OpenAI's
Embeddings API, with vLLM's extras), vLLM's /classify (a sequence classifier's classes) and /pooling (either), and
vLLM's score and rerank routes: for an embedding model the cosine similarity of the texts' embeddings, for a
cross-encoder (a classifier of one label) its score of the two texts encoded together."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from jaxserve.engine.async_engine import RequestStream
from jaxserve.outputs import PoolingRequestOutput
from jaxserve.pooling.params import PoolingParams
from jaxserve.pooling.score import cosine_scores, score_pairs
from jaxserve.server.errors import APIError
from jaxserve.server.protocol import ChatMessage
from jaxserve.server.request_streams import RequestFailedError, last_outputs
from jaxserve.server.serving import OpenAIServing
from jaxserve.tokenizer import encode_text_pair, render_chat


class _PoolingFields(BaseModel):
    """What every pooling route's body has: OpenAI's `model` and `user`, vLLM's `truncate_prompt_tokens` and
    `priority`. Unknown fields are ignored, as on the other routes."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # keep each text's last that many tokens; -1: max_model_len
    priority: int = 0


class _InputFields(_PoolingFields):
    """What the routes that pool each of their inputs have: OpenAI's `input` and vLLM's `add_special_tokens`, or
    vLLM's chat-shaped request: `messages` (one input, the conversation under the chat template: a reward model's
    scored exchange) with the template's options."""

    input: str | list[str] | list[int] | list[list[int]] | None = None
    add_special_tokens: bool = True  # text inputs are tokenized with the tokenizer's special tokens (BOS, ...)
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False  # vLLM's default for pooling: the conversation as it is
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text or token ids."""
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        return list(value)


class EmbeddingRequest(_InputFields):
    """POST /v1/embeddings: OpenAI's fields and vLLM's extras (`add_special_tokens`, `normalize`)."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None  # None: the server's pooler decides


class ClassificationRequest(_InputFields):
    """POST /classify (vLLM's): each input's classes; `use_activation` false gives the raw logits. An embedding's
    `dimensions` and `normalize` are read only to be refused by name."""

    use_activation: bool | None = None
    dimensions: int | None = None
    normalize: bool | None = None


class PoolingRequest(EmbeddingRequest):
    """POST /pooling (vLLM's): each input's pooled output, an embedding or a classifier's classes, as the model
    gives, or for `task` token_embed or token_classify every input token's."""

    use_activation: bool | None = None
    task: Literal["embed", "classify", "token_embed", "token_classify"] | None = None  # None: the model's own


class ScoreRequest(_PoolingFields):
    """POST /score, /v1/score (vLLM's): `text_1` (one text, or as many as `text_2`) scored against `text_2`."""

    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_PoolingFields):
    """POST /rerank, /v1/rerank, /v2/rerank (vLLM's, after Jina's and Cohere's): `documents` ranked by their score
    against `query`, the best `top_n` (0: all)."""

    query: str
    documents: list[str]
    top_n: int = 0


class EmbeddingsServing:
    """The pooling routes (embeddings, score, rerank), on the OpenAI server's engine and checks."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.engine = serving.engine
        self.classifier = serving.model.classifier  # a sequence classifier's head, or None

    async def create(self, body: EmbeddingRequest, raw: Request) -> Response | dict:
        """POST /v1/embeddings: every input's embedding, in input order (OpenAI's `list` of `embedding`s), with the
        prompt tokens they took; a 400 naming the field for what the engine cannot serve."""
        request_id = f"embd-{uuid.uuid4().hex}"
        outputs = await self._pool(request_id, self._input_prompts(body), body, raw, "embed",
                                   dimensions=body.dimensions, normalize=body.normalize)
        if outputs is None:
            return Response(status_code=499)
        data = [{"object": "embedding", "index": index, "embedding": _encoded(output.outputs.embedding,
                                                                              body.encoding_format)}
                for index, output in enumerate(outputs)]
        return self._listed(request_id, body, data, _usage(outputs))

    async def classify(self, body: ClassificationRequest, raw: Request) -> Response | dict:
        """POST /classify: every input's class probabilities (a sequence classifier's), in input order, with the
        most probable class's label (vLLM's response)."""
        request_id = f"classify-{uuid.uuid4().hex}"
        outputs = await self._pool(request_id, self._input_prompts(body), body, raw, "classify",
                                   use_activation=body.use_activation, dimensions=body.dimensions,
                                   normalize=body.normalize)
        if outputs is None:
            return Response(status_code=499)
        labels = self.classifier.labels
        data = [{"index": index, "label": labels[int(np.argmax(output.outputs.probs))], "probs": output.outputs.probs,
                 "num_classes": output.outputs.num_classes} for index, output in enumerate(outputs)]
        return self._listed(request_id, body, data, _usage(outputs))

    async def pooling(self, body: PoolingRequest, raw: Request) -> Response | dict:
        """POST /pooling: every input's pooled output as the model gives it (an embedding model's embedding, a
        sequence classifier's class probabilities), in input order; with `task` token_embed or token_classify (a
        token classifier's default), a list per input of every token's."""
        request_id = f"pool-{uuid.uuid4().hex}"
        task = body.task or ("embed" if self.classifier is None else "token_classify" if self.classifier.per_token
                             else "classify")
        outputs = await self._pool(request_id, self._input_prompts(body), body, raw, task, dimensions=body.dimensions,
                                   normalize=body.normalize, use_activation=body.use_activation)
        if outputs is None:
            return Response(status_code=499)
        vectors = [output.outputs.data if task.startswith("token_") else output.outputs.probs if self.classifier
                   else output.outputs.embedding for output in outputs]
        data = [{"index": index, "object": "pooling", "data": _encoded(vector, body.encoding_format)}
                for index, vector in enumerate(vectors)]
        return self._listed(request_id, body, data, _usage(outputs))

    async def score(self, body: ScoreRequest, raw: Request) -> Response | dict:
        """POST /score, /v1/score: each pair's score, in pair order: the cosine similarity of the texts'
        embeddings (an embedding model), or a cross-encoder's score of the pair (vLLM's two kinds)."""
        first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        second = self._counted([body.text_2] if isinstance(body.text_2, str) else body.text_2, "text_2")
        try:
            pairs = score_pairs(len(first), len(second))
        except ValueError as error:
            raise APIError(400, str(error), "text_1") from error
        request_id = f"score-{uuid.uuid4().hex}"
        scored = await self._scored(request_id, first, second, pairs, body, raw)
        if scored is None:
            return Response(status_code=499)
        scores, usage = scored
        data = [{"index": index, "object": "score", "score": score} for index, score in enumerate(scores)]
        return self._listed(request_id, body, data, usage)

    async def rerank(self, body: RerankRequest, raw: Request) -> Response | dict:
        """POST /rerank, /v1/rerank, /v2/rerank: the documents by their score against the query, best first."""
        documents = self._counted(body.documents, "documents")
        if body.top_n < 0:
            raise APIError(400, f"top_n must be >= 0 (0: every document), got {body.top_n}", "top_n")
        request_id = f"rerank-{uuid.uuid4().hex}"
        scored = await self._scored(request_id, [body.query], documents, score_pairs(1, len(documents)), body, raw)
        if scored is None:
            return Response(status_code=499)
        scores, usage = scored
        ranked = sorted(range(len(documents)), key=lambda index: -scores[index])[: body.top_n or None]
        results = [{"index": index, "document": {"text": documents[index]}, "relevance_score": scores[index]}
                   for index in ranked]
        return {"id": request_id, "model": self.serving.models.model_name(body),
                "usage": {"total_tokens": usage["total_tokens"]}, "results": results}

    def _listed(self, request_id: str, body: _PoolingFields, data: list[dict], usage: dict) -> dict:
        """A pooling route's response: vLLM's (and OpenAI's) `list` object of `data`, with the `usage`."""
        return {"id": request_id, "object": "list", "created": int(time.time()),
                "model": self.serving.models.model_name(body), "data": data, "usage": usage}

    def _counted(self, texts: list, field: str) -> list:
        """`texts`, or a 400 naming `field` unless there are 1 to max_prompts of them."""
        limit = self.serving.config.max_prompts
        if not 1 <= len(texts) <= limit:
            raise APIError(400, f"{field} must hold 1 to {limit} items, got {len(texts)}", field)
        return texts

    async def _scored(self, request_id: str, first: list[str], second: list[str], pairs: list[tuple[int, int]],
                      body: _PoolingFields, raw: Request) -> tuple[list[float], dict] | None:
        """(each pair's score, the usage): a cross-encoder's of the pair's texts encoded together, else the cosine
        similarity of the texts' normalized embeddings; None when the client leaves first."""
        if self.classifier is not None:
            try:
                prompts = [encode_text_pair(self.serving.tokenizer, first[i], second[j]) for i, j in pairs]
            except ValueError as error:
                raise APIError(400, str(error), "text_1") from error
            outputs = await self._pool(request_id, prompts, body, raw, "score")
            return None if outputs is None else ([output.outputs.probs[0] for output in outputs], _usage(outputs))
        outputs = await self._pool(request_id, first + second, body, raw, "embed", normalize=True)
        if outputs is None:
            return None
        vectors = [output.outputs.embedding for output in outputs]
        return cosine_scores(vectors[: len(first)], vectors[len(first):], pairs), _usage(outputs)

    def _input_prompts(self, body: _InputFields) -> list[str | list[int]]:
        """The inputs of a route that pools each (1 to max_prompts of them) as the engine takes them: its `input`s,
        or its `messages` rendered by the chat template; a 400 naming the field for neither or both."""
        if body.messages is None:
            if body.input is None:
                raise APIError(400, "give input (texts or token ids), or messages (a conversation)", "input")
            return [self._prompt(text_or_ids, body) for text_or_ids in self._counted(body.inputs(), "input")]
        if body.input is not None:
            raise APIError(400, "give input or messages, not both", "messages")
        serving = self.serving
        try:
            return [render_chat(serving.tokenizer, [message.for_template() for message in body.messages],
                                body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs,
                                None, serving.config.chat_template)]
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error), "messages") from error

    async def _pool(self, request_id: str, prompts: list, body: _PoolingFields, raw: Request, task: str,
                    **options) -> list[PoolingRequestOutput] | None:
        """Pool every prompt for `task` (pooling/params.POOLING_TASKS) as one request each, with the PoolingParams
        `options` (all queued, or none), and wait for them: their outputs in order, or None when the client leaves
        first; a 400 naming the field for what the engine refuses."""
        serving = self.serving
        lora_name = serving.models.check_model(body.model)
        if body.priority != 0 and serving.model.scheduling_policy != "priority":
            raise APIError(400, "priority needs the server to run with --scheduling-policy priority", "priority")
        truncate = serving.model.max_model_len if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
        try:
            params = PoolingParams(truncate_prompt_tokens=truncate, **options)
        except ValueError as error:  # PoolingParams' messages start with the field they are about
            raise APIError(400, str(error), str(error).split()[0]) from error
        streams = self._submit(request_id, prompts, params, body.priority, lora_name, task)
        return await self._final_outputs(streams, raw)

    def _prompt(self, text_or_ids: str | list[int], body: _InputFields) -> str | list[int]:
        """An input as the engine takes it: token ids as they are; text as it is, or tokenized here without the
        special tokens when `add_special_tokens` is false."""
        if isinstance(text_or_ids, str) and not body.add_special_tokens and text_or_ids:
            return self.serving.tokenizer.encode(text_or_ids, add_special_tokens=False)
        return text_or_ids

    def _submit(self, request_id: str, prompts: list, params: PoolingParams, priority: int,
                lora_name: str | None, task: str) -> list[RequestStream]:
        """Validate every input, then queue them all (or none)."""
        try:
            made = [self.engine.make_pooling_requests(f"{request_id}-{i}", prompt, params, priority,
                                                      lora_name=lora_name, task=task)
                    for i, prompt in enumerate(prompts)]
        except ValueError as error:  # the engine's runner or model, the input, or a field PoolingParams names
            message = str(error)
            field = message.split()[0].rstrip(":")
            mismatch = "runner" in message or "classifier" in message  # the engine or model does not do the task
            param = (field if field in ("dimensions", "normalize", "use_activation")
                     else ("task" if task.startswith("token_") else "model") if mismatch else "input")
            raise APIError(400, message, param) from error
        return self.serving.queue(request_id, made)

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


def _usage(outputs: list[PoolingRequestOutput]) -> dict:
    """The prompt tokens the requests took (a pooling request generates none)."""
    num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0,
            "prompt_tokens_details": None}


def _encoded(embedding: list, encoding_format: str) -> list | str:
    """An embedding (or a token-wise task's list of them) as OpenAI sends it: the floats, or (base64) their
    little-endian float32 bytes in base64, row after row."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, "<f4").tobytes()).decode("ascii")
