"""The request body of POST /v1/messages (Anthropic's Messages API, which vLLM serves too) and its translation to a
chat request.

A Messages request means a chat completion request, and the server answers it on the chat route's machinery
(`MessagesRequest.to_chat`): `system` (a string or text blocks) becomes a system message; each message's content
(a string or content blocks) becomes chat messages: `text` blocks the message's text, an assistant's `tool_use`
blocks its tool calls (their `input` as JSON arguments), a user's `tool_result` blocks tool messages (before the
user's own text, in order), an assistant's `thinking` blocks its `reasoning` (templates that keep a tool call's
thinking write it, gpt-oss's and Qwen3's), `redacted_thinking` blocks dropped. `tools` (name, description,
input_schema) become function tools; `tool_choice` auto / any / tool / none become auto / required / the named
function / none (`disable_parallel_tool_use` one call at most);
`stop_sequences` stop strings; `metadata.user_id` the user; `thinking: {"type": "disabled"}` closes a reasoning
template's thinking (`enable_thinking: false`, Qwen3's switch; enabled and adaptive leave the template's default);
enabled thinking's `budget_tokens` bounds a reasoning model's thinking (`thinking_token_budget`; adaptive thinking
is bounded by max_tokens alone); `output_config.format` (a JSON schema) constrains the reply as the
chat route's `response_format` does and `output_config.effort` goes to the template as `reasoning_effort`.
`cache_control` markers (top-level or on blocks) are accepted: the prefix cache finds shared prefixes by itself.
The sampling fields the current SDK no longer sends (`temperature`, `top_p`, `top_k`) are still read, as the API
reads them. Anything else (images, documents, server tools, other fields) is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.server.errors import APIError
from jaxserve.server.protocol import ChatCompletionRequest, JsonSchemaFormat, ResponseFormat, chat_request

# chat request field -> the Messages field an error about it names
MESSAGES_PARAM = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "user": "metadata",
                  "chat_template_kwargs": "thinking", "response_format": "output_config"}


class OutputConfig(BaseModel):
    """`output_config`: the reply's format (a JSON schema) and the effort the template is told of."""

    model_config = ConfigDict(extra="forbid")

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: dict[str, Any] | None = None


class _Conversation(BaseModel):
    """What a Messages request and a token count request share: the conversation and its tools."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None

    def chat_fields(self) -> dict[str, Any]:
        """The chat request's messages, tools, tool choice and template switches. APIError for what cannot be
        translated."""
        messages = [{"role": "system", "content": _text(self.system, "system")}] if self.system is not None else []
        for index, message in enumerate(self.messages):
            messages += _chat_messages(message, f"messages[{index}]")
        if not self.messages:
            raise APIError(400, "messages must hold at least one message", "messages")
        tools, choice = self._chat_tools(), self._chat_tool_choice()
        return {"messages": messages, "tools": tools, "tool_choice": choice,
                "parallel_tool_calls": not (self.tool_choice or {}).get("disable_parallel_tool_use", False),
                "chat_template_kwargs": self._template_switches(), "response_format": self._response_format()}

    def _response_format(self) -> ResponseFormat | None:
        """`output_config.format` as the chat API's response_format."""
        form = self.output_config.format if self.output_config is not None else None
        if form is None:
            return None
        if form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
            raise APIError(400, 'output_config.format must be {"type": "json_schema", "schema": {...}}',
                           "output_config")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="output", schema=form["schema"]))

    def _chat_tools(self) -> list[dict[str, Any]] | None:
        """The custom tools as the chat API's function tools; 400 for a server tool (web search, bash, ...)."""
        tools = []
        for index, tool in enumerate(self.tools or ()):
            where = f"tools[{index}]"
            if tool.get("type", "custom") != "custom" or "input_schema" not in tool:
                raise APIError(400, f"{where}: only custom tools with an input_schema are supported (the client runs "
                                    f"them); got type {tool.get('type')!r:.60}", "tools")
            if not isinstance(tool.get("name"), str) or not isinstance(tool["input_schema"], dict):
                raise APIError(400, f"{where} needs a string name and an object input_schema", "tools")
            unknown = set(tool) - {"type", "name", "description", "input_schema", "cache_control"}
            if unknown:
                raise APIError(400, f"{where}: fields {sorted(unknown)} are not supported", "tools")
            function = {"name": tool["name"], "parameters": tool["input_schema"]}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            tools.append({"type": "function", "function": function})
        return tools or None

    def _chat_tool_choice(self) -> str | dict[str, Any] | None:
        """`tool_choice` in the chat API's shape."""
        choice = self.tool_choice
        if choice is None:
            return None
        kind = choice.get("type")
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise APIError(400, 'tool_choice of type "tool" needs the tool\'s name', "tool_choice")
            return {"type": "function", "function": {"name": choice["name"]}}
        if kind not in ("auto", "any", "none"):
            raise APIError(400, f'tool_choice type must be "auto", "any", "tool" or "none"; got {kind!r:.40}',
                           "tool_choice")
        return {"auto": "auto", "any": "required", "none": "none"}[kind]

    def _template_switches(self) -> dict[str, Any] | None:
        """`thinking` and `output_config.effort` as the chat template's switches: disabled -> enable_thinking false;
        enabled or adaptive -> the template's default (enabled thinking's length: `thinking_budget()`)."""
        switches = {}
        if self.output_config is not None and self.output_config.effort is not None:
            switches["reasoning_effort"] = self.output_config.effort
        kind = None if self.thinking is None else self.thinking.get("type")
        if kind == "disabled":
            switches["enable_thinking"] = False
        elif kind not in (None, "enabled", "adaptive"):
            raise APIError(400, f'thinking type must be "enabled", "adaptive" or "disabled"; got {kind!r:.40}',
                           "thinking")
        self.thinking_budget()  # enabled thinking without its budget is a 400 on every route, count_tokens too
        return switches or None

    def thinking_budget(self) -> int | None:
        """`thinking.budget_tokens` of thinking of type enabled (the most tokens the thinking may take); None for
        the other types. APIError for enabled thinking without it."""
        if (self.thinking or {}).get("type") != "enabled":
            return None
        budget = self.thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise APIError(400, "thinking of type enabled needs budget_tokens, an int >= 1", "thinking")
        return budget

    def to_chat(self, **fields) -> ChatCompletionRequest:
        """The chat completion request this conversation means, with the chat request's `fields`; APIError (400
        naming the Messages field) for what cannot be translated."""
        return chat_request({**self.chat_fields(), "model": self.model, **fields},
                            lambda field: MESSAGES_PARAM.get(field, field))


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens."""


class MessagesRequest(_Conversation):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: either is served the same

    def to_chat(self, **fields) -> ChatCompletionRequest:
        """The chat completion request this request means (its sampling fields too)."""
        return super().to_chat(max_completion_tokens=self.max_tokens, stream=self.stream, temperature=self.temperature,
                               top_p=self.top_p, top_k=self.top_k, stop=self.stop_sequences,
                               user=(self.metadata or {}).get("user_id"), **fields)


def _chat_messages(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The chat messages of one Messages message (see the module docstring)."""
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise APIError(400, f"{where}.role must be user or assistant; got {role!r:.40}", "messages")
    unknown = set(message) - {"role", "content"}
    if unknown:
        raise APIError(400, f"{where}: fields {sorted(unknown)} are not supported", "messages")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content blocks", "messages")
    texts, thoughts, calls, results = [], [], [], []
    for index, block in enumerate(content):
        here = f"{where}.content[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                    and isinstance(block.get("input"), dict)):
                raise APIError(400, f"{here}: a tool_use block needs a string id and name and an object input",
                               "messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise APIError(400, f"{here}: a tool_result block needs its tool_use_id", "messages")
            output = _text(block.get("content", ""), f"{here}.content")
            if block.get("is_error"):
                output = f"Error: {output}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": output})
        elif kind == "thinking" and role == "assistant":
            if not isinstance(block.get("thinking"), str):
                raise APIError(400, f"{here}: a thinking block needs its thinking as a string", "messages")
            thoughts.append(block["thinking"])
        elif kind != "redacted_thinking" or role != "assistant":
            raise APIError(400, f"{here}: {kind!r:.40} blocks are not supported in a {role} message (text, an "
                                "assistant's tool_use and thinking, a user's tool_result are)", "messages")
    if role == "assistant":
        return [{"role": "assistant", "content": "".join(texts) or None,
                 **({"reasoning": "".join(thoughts)} if thoughts else {}), **({"tool_calls": calls} if calls else {})}]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _text(content: Any, where: str) -> str:
    """The text of a string or of a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(
            isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)
            for block in content):
        raise APIError(400, f"{where} must be a string or a list of text blocks", where.split(".")[0].split("[")[0])
    return "".join(block["text"] for block in content)
