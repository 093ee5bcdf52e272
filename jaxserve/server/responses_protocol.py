"""The request body of POST /v1/responses (OpenAI's Responses API) and its translation to a chat request.

A Responses request means a chat completion request, and the server answers it on the chat route's machinery
(`ResponsesRequest.to_chat`): `instructions` becomes a system message; `input` (a string, or a list of items)
becomes messages: message items (roles user, assistant, system, developer, the last read as system; text parts
only), `function_call` items the assistant's tool calls, `function_call_output` items tool messages, `reasoning`
items dropped (chat templates drop earlier thinking too). Flat function tools become the chat API's nested ones,
`text.format` becomes `response_format`, `max_output_tokens` `max_completion_tokens`, and
`include: ["message.output_text.logprobs"]` with `top_logprobs` asks for logprobs. vLLM's sampling extras
(`top_k`, `min_p`, `repetition_penalty`, `structured_outputs`, ...) are taken as on the chat route.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxserve.server.errors import APIError
from jaxserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    JsonSchemaFormat,
    ReasoningEffort,
    ResponseFormat,
    _false,
    _one_of,
    _SamplingFields,
    _unset,
    chat_request,
)
from jaxserve.server.tools import FunctionDefinition, NamedFunction, NamedToolChoice, Tool

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# `include` values this server answers: logprobs, and encrypted reasoning, which it leaves null (a reasoning item
# carries its text in `content`, and reasoning items given back in `input` are dropped anyway)
SUPPORTED_INCLUDES = (LOGPROBS_INCLUDE, "reasoning.encrypted_content")
TEXT_PART_TYPES = ("input_text", "output_text", "text", "refusal")

# chat request field -> the Responses field an error about it names
RESPONSES_PARAM = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                   "response_format": "text", "logprobs": "top_logprobs"}


class TextFormat(BaseModel):
    """`text.format`: free text, any JSON object, or JSON following a named schema."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    """`text`: the reply's format (`verbosity` only at its neutral value)."""

    model_config = ConfigDict(extra="allow")

    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ReasoningConfig(BaseModel):
    """`reasoning`: `effort` goes to the chat template as `reasoning_effort` (templates that read it, as vLLM's
    chat route does); summaries are not made (a reasoning item's text is in its `content`)."""

    model_config = ConfigDict(extra="allow")

    effort: ReasoningEffort | None = None
    summary: None = None
    generate_summary: None = None


class ResponsesRequest(_SamplingFields):
    """POST /v1/responses."""

    route_unsupported: ClassVar = {
        **ChatCompletionRequest.route_unsupported,
        "background": (_false, "responses are answered within the request, not in the background"),
        "conversation": (_unset, "conversations are not kept; chain responses with previous_response_id"),
        "prompt": (_unset, "stored prompt templates are not supported"),
        "max_tool_calls": (_unset, "the server runs no tools; the client runs the function calls"),
        "truncation": (_one_of("disabled"), "a conversation longer than the model's context is refused, not cut"),
    }
    param_names: ClassVar = {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.n != 1:
            raise APIError(400, f"n is not a field of the Responses API (one reply per response); got {self.n}", "n")
        if self.echo:
            raise APIError(400, "echo is not a field of the Responses API", "echo")
        if self.return_tokens_as_token_ids:
            raise APIError(400, "return_tokens_as_token_ids is not supported by the Responses API: output_text "
                                "logprobs name their tokens by text", "return_tokens_as_token_ids")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise APIError(400, f"max_output_tokens must be at least 1, got {self.max_output_tokens}",
                           "max_output_tokens")
        unknown = [name for name in self.include or () if name not in SUPPORTED_INCLUDES]
        if unknown:
            raise APIError(400, f"include {unknown[0]!r} is not supported; this server includes "
                                f"{', '.join(SUPPORTED_INCLUDES)}", "include")
        if self.top_logprobs and not self.wants_logprobs():
            raise APIError(400, f"top_logprobs needs include {LOGPROBS_INCLUDE!r}", "top_logprobs")

    def wants_logprobs(self) -> bool:
        """The output text's logprobs are asked for."""
        return LOGPROBS_INCLUDE in (self.include or ())

    def input_items(self) -> list[dict[str, Any]]:
        """`input` as a list of items (a string is one user message)."""
        return [{"role": "user", "content": self.input}] if isinstance(self.input, str) else list(self.input)

    def to_chat(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion request this request means, after the items of `history` (the conversation of its
        previous response). APIError (400 naming the Responses field) for what cannot be translated."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages += conversation(history + self.input_items())
        if not messages:
            raise APIError(400, "input holds no message", "input")
        fields = {**(self.model_extra or {}),
                  **{name: getattr(self, name) for name in _SamplingFields.model_fields}}
        fields.update(messages=messages, max_completion_tokens=self.max_output_tokens,
                      logprobs=self.wants_logprobs(), top_logprobs=self.top_logprobs if self.wants_logprobs() else None,
                      tools=self._chat_tools(), tool_choice=self._chat_tool_choice(),
                      parallel_tool_calls=self.parallel_tool_calls, chat_template_kwargs=self.chat_template_kwargs,
                      reasoning_effort=self.reasoning.effort if self.reasoning is not None else None)
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type != "text":
            if self.response_format is not None:
                raise APIError(400, "give text.format or response_format, not both", "text")
            schema = None if text_format.type == "json_object" else JsonSchemaFormat(
                name=text_format.name, description=text_format.description, schema=text_format.json_schema,
                strict=text_format.strict)
            fields["response_format"] = ResponseFormat(type=text_format.type, json_schema=schema)
        return chat_request(fields, RESPONSES_PARAM.get)

    def _chat_tools(self) -> list[Tool] | None:
        """The function tools in the chat API's shape; 400 for any other kind of tool."""
        if not self.tools:
            return None
        tools = []
        for index, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise APIError(400, f"tools[{index}]: only function tools are supported (the client runs them); got "
                                    f"type {tool.get('type')!r:.40}", "tools")
            try:
                tools.append(Tool(function=FunctionDefinition(**{k: v for k, v in tool.items() if k != "type"})))
            except (ValidationError, TypeError) as error:
                raise APIError(400, f"tools[{index}]: {error}", "tools") from error
        return tools

    def _chat_tool_choice(self) -> str | NamedToolChoice | None:
        """`tool_choice` in the chat API's shape: a string as it is, `{"type": "function", "name": ...}` named."""
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}; '
                                f"got {choice!r:.80}", "tool_choice")
        return NamedToolChoice(function=NamedFunction(name=choice["name"]))


def conversation(items: list[dict[str, Any]]) -> list[ChatMessage]:
    """Chat messages of input items: messages, the assistant's function calls (joined to the assistant message
    before them) and their outputs (tool messages); a reasoning item's text is the `reasoning` of the assistant
    message or calls after it (templates that keep a tool call's thinking, as gpt-oss's, write it), and is dropped
    with nothing after it. 400 naming the item otherwise."""
    messages: list[ChatMessage] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object (a message or a function call item)", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer; got {role!r:.40}",
                               "input")
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant" and messages and _thought_only(messages[-1]):
                messages[-1].content = text  # the reply the reasoning item before it thought
            else:
                messages.append(ChatMessage(role="system" if role == "developer" else role, content=text))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is None or last.role != "assistant":
                last = ChatMessage(role="assistant", content=None)
                messages.append(last)
            last.tool_calls = [*(getattr(last, "tool_calls", None) or []), call]
        elif kind == "function_call_output":
            messages.append(ChatMessage(role="tool", tool_call_id=_string(item, "call_id", where),
                                        content=_text(item.get("output"), f"{where}.output")))
        elif kind == "reasoning":
            thought = "".join(part.get("text", "") for part in item.get("content") or []
                              if isinstance(part, dict) and isinstance(part.get("text"), str))
            if thought:
                messages.append(ChatMessage(role="assistant", content=None, reasoning=thought))
        else:
            raise APIError(400, f"{where}: items of type {kind!r:.40} are not supported (messages, function_call, "
                                "function_call_output and reasoning items are)", "input")
    return [message for message in messages if not _thought_only(message)]


def _thought_only(message: ChatMessage) -> bool:
    """An assistant message made of a reasoning item alone so far (no reply, no calls)."""
    return message.role == "assistant" and message.content is None and not getattr(message, "tool_calls", None) \
        and getattr(message, "reasoning", None) is not None


def _text(content: Any, where: str) -> str:
    """The text of a message's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", "input")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PART_TYPES or not isinstance(part.get("text", part.get("refusal")), str):
            raise APIError(400, f"{where}[{index}]: only text parts are supported; got {kind!r:.40}", "input")
        texts.append(part.get("text", part.get("refusal")))
    return "".join(texts)


def _string(item: dict[str, Any], name: str, where: str) -> str:
    """A string field of an input item; 400 when missing."""
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{name} must be a string", "input")
    return value
