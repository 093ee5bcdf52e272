"""Tool calling on /v1/chat/completions: the request's `tools` and `tool_choice`, the constraint that enforces
`required` and named functions, and the parsers that find tool calls in a model's free text (`auto`).

Every way of calling tools is a `ToolCallExtractor`: `extract(text, final)` splits the output so far into
content and tool calls, so that a non-final split's content and calls are prefixes of the final split's (text
that may still turn into a call is held back). The final split answers a request; the differences between
successive splits are the streamed deltas (`ToolCallStream`).

- `required`: the output is constrained to a JSON array of `{"name": ..., "parameters": {...}}` objects, one
  schema per tool (vLLM's format); each complete element is a call.
- a named function: the output is constrained to the function's parameters schema; the whole output is the
  call's arguments, streamed as it grows.
- `auto`: the model decides; `--tool-call-parser` names the format its chat template taught it (vLLM's names):
  - `hermes` (Hermes, Qwen 2.5 / 3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among the
    text);
  - `llama3_json` (Llama 3.1 / 3.2: the reply is `{"name": ..., "parameters": {...}}` objects separated by `;`);
  - `qwen3_coder` (Qwen3-Coder: `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
    </tool_call>` blocks, each value typed by the tool's parameter schema);
  - `mistral` (Mistral's `[TOOL_CALLS]` then a JSON array of calls, or `NAME[ARGS]{...}` per call in later
    tokenizers; special tokens, so the reply is decoded with them);
  - `pythonic` (Llama 3.2 / 4 and others: the reply is a Python list of calls, `[f(a=1), g(b="x")]`, literal
    arguments only; the calls come with the final split, since text after the list would make it content);
  - `granite` (Granite 3.x: the reply is `<|tool_call|>` or `<tool_call>` then a JSON array of calls; decoded with
    special tokens) and `phi4_mini_json` (Phi-4-mini: `functools` then a JSON array of calls);
  - `openai` (gpt-oss: harmony messages `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`;
    special tokens; with the `openai_gptoss` reasoning parser, which it needs).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.engine.harmony import CHANNEL, START, HarmonyMessage, parse_reply
from jaxserve.engine.reasoning import partial_suffix

_DECODER = json.JSONDecoder()


class FunctionDefinition(BaseModel):
    """A function the model may call: its name and its parameters' JSON schema."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def parameters_schema(self) -> dict[str, Any]:
        """The schema of the call's arguments (an object of any keys when the tool gives none)."""
        return self.parameters if self.parameters is not None else {"type": "object"}


class Tool(BaseModel):
    """One entry of `tools`."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming one function: the model must call it."""

    type: Literal["function"] = "function"
    function: NamedFunction


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call found in the output: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCallExtractor:
    """Splits a model's output into (content, tool calls); see the module docstring. `tools`: the request's."""

    keeps_special_tokens = False  # the format's markers are special tokens: decode the reply with them
    named = False  # the request named the function: a reply that calls it still finishes "stop"

    def __init__(self, tools: list[Tool] | None = None):
        self.tools = tools or []

    def extract(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


def _call(value: Any) -> ToolCall | None:
    """A ToolCall of a decoded `{"name": ..., "parameters" or "arguments": {...}}`, or None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("parameters", value.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _leading_calls(text: str, start: int, separator: str) -> tuple[list[ToolCall], int]:
    """The calls that JSON objects of `text` from `start` on make, separated by `separator` (and whitespace),
    up to the first value that does not decode or is not a call; (the calls, where the text after them starts)."""
    calls, position, end = [], start, start
    while True:
        position = len(text) - len(text[position:].lstrip())
        try:
            value, value_end = _DECODER.raw_decode(text, position)
        except json.JSONDecodeError:
            return calls, end
        call = _call(value)
        if call is None:
            return calls, end
        calls.append(call)
        end = value_end
        rest = text[end:].lstrip()
        if not rest.startswith(separator):
            return calls, end
        position = len(text) - len(rest) + len(separator)


class RequiredCalls(ToolCallExtractor):
    """`tool_choice: "required"`: the constrained output is a JSON array of {name, parameters}."""

    def extract(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        opening = text.lstrip()
        if not opening.startswith("["):
            return (text if final else ""), []
        calls, end = _leading_calls(text, len(text) - len(opening) + 1, ",")
        rest = text[end:] if calls else text
        return ("" if not final or rest.strip() == "]" else rest), calls


class NamedCall(ToolCallExtractor):
    """A named function: the constrained output is its arguments."""

    named = True

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def extract(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        return "", [ToolCall(self.name, text)]


class HermesParser(ToolCallExtractor):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; the text outside them is content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def extract(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        content, calls, position = [], [], 0
        while True:
            start = text.find(self.OPEN, position)
            if start < 0:
                rest = text[position:]
                content.append(rest if final else rest[:len(rest) - partial_suffix(rest, self.OPEN)])
                break
            end = text.find(self.CLOSE, start)
            if end < 0:  # an open block: a call in the making, or (once finished) text
                content.append(text[position:] if final else text[position:start])
                break
            content.append(text[position:start])
            call = self._block_call(text[start + len(self.OPEN):end])
            if call is None:
                content.append(text[start:end + len(self.CLOSE)])
            else:
                calls.append(call)
            position = end + len(self.CLOSE)
        return "".join(content), calls

    def _block_call(self, block: str) -> ToolCall | None:
        try:
            return _call(json.loads(block))
        except json.JSONDecodeError:
            return None


class Qwen3CoderParser(HermesParser):
    """Qwen3-Coder's blocks: `<tool_call>` `<function=NAME>` then `<parameter=KEY>` value `</parameter>` for each
    argument, `</function>` `</tool_call>` (newlines between them); a value is text, typed by the tool's parameter
    schema (a string stays text; integer, number, boolean, null, object and array values are read as JSON, and as
    text when they do not parse)."""

    FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
    PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def _block_call(self, block: str) -> ToolCall | None:
        function = self.FUNCTION.fullmatch(block)
        if function is None:
            return None
        name, body = function.group(1).strip(), function.group(2)
        tool = find_tool(self.tools, name)
        schema = tool.function.parameters_schema().get("properties", {}) if tool else {}
        arguments = {key.strip(): _typed(value, (schema.get(key.strip()) or {}).get("type"))
                     for key, value in self.PARAMETER.findall(body)}
        if self.PARAMETER.sub("", body).strip():  # anything but parameters between the function's tags
            return None
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _typed(value: str, kind: str | list | None) -> Any:
    """A Qwen3-Coder parameter's text as its schema's JSON type says: text for a string (or no type), else the JSON
    value it spells, or the text when it spells none."""
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds or kinds == [None]:
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


class MistralParser(ToolCallExtractor):
    """Mistral's calls after `[TOOL_CALLS]`: a JSON array of `{"name": ..., "arguments": {...}}` (tokenizers before
    v11), or `NAME[ARGS]{...}` (optionally `NAME[CALL_ID]ID[ARGS]{...}`) with `[TOOL_CALLS]` before each call
    (v11 and later: Mistral Small 3.2, Magistral, Devstral; a call is taken once the next marker follows it, or the
    reply ends). The text before the first marker is content; what does not decode into calls (once the reply is
    final) is content too, after the calls before it."""

    keeps_special_tokens = True
    MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"

    def extract(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        start = text.find(self.MARKER)
        if start < 0:
            return (text if final else text[:len(text) - partial_suffix(text, self.MARKER)]), []
        rest = text[start + len(self.MARKER):].lstrip()
        if rest.startswith("["):
            calls = self._array_calls(rest)
            return (text, []) if final and calls is None else (text[:start], calls or [])
        segments = rest.split(self.MARKER)
        calls = self._named_calls(segments if final else segments[:-1])  # the last one may still grow
        if final and len(calls) < len(segments):  # the segments from the first that is no call are content
            return text[:start] + self.MARKER + self.MARKER.join(segments[len(calls):]), calls
        return text[:start], calls

    @staticmethod
    def _array_calls(rest: str) -> list[ToolCall] | None:
        """The calls of a JSON array of calls, once it is whole; None while it is not, or when it is not one."""
        try:
            value, _ = _DECODER.raw_decode(rest)
        except json.JSONDecodeError:
            return None
        calls = [_call(item) for item in value] if isinstance(value, list) else [None]
        return None if None in calls else calls

    def _named_calls(self, segments: list[str]) -> list[ToolCall]:
        """The calls of the leading segments that are each one whole `NAME[ARGS]{...}` (or
        `NAME[CALL_ID]ID[ARGS]{...}`)."""
        calls = []
        for segment in segments:
            name, args, arguments = segment.partition(self.ARGS)
            name = name.partition(self.CALL_ID)[0].strip()
            try:
                value, end = _DECODER.raw_decode(arguments.lstrip())
            except json.JSONDecodeError:
                return calls
            if not args or not name or not isinstance(value, dict) or arguments.lstrip()[end:].strip():
                return calls
            calls.append(ToolCall(name, json.dumps(value, ensure_ascii=False)))
        return calls


class PythonicParser(ToolCallExtractor):
    """A reply that is a Python list of calls with keyword arguments of literal values, `[f(a=1), g(b="x")]`
    (vLLM's `pythonic`; Llama 4's `<|python_start|>` and `<|python_end|>` are special tokens, decoded away). A reply
    that starts with `[` is held back until it is final, then it is calls if it parses as such, else content."""

    def extract(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        stripped = text.strip()
        if not final:
            return ("" if not stripped or stripped.startswith("[") else text), []
        calls = _python_calls(stripped) if stripped.startswith("[") else None
        return ("", calls) if calls else (text, [])


def _python_calls(text: str) -> list[ToolCall] | None:
    """The calls of a Python list of `name(key=literal, ...)`, or None when `text` is not one."""
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args or any(
                keyword.arg is None for keyword in node.keywords):  # positional arguments, **kwargs
            return None
        try:
            arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
            calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, TypeError, SyntaxError):  # not a literal, or not JSON (a set, bytes)
            return None
    return calls


class Llama3JsonParser(ToolCallExtractor):
    """Llama 3.1's JSON tool calls: a reply that starts with `{` (or `<|python_tag|>`) is calls
    `{"name": ..., "parameters": {...}}` separated by `;`; any other reply is content."""

    TAG = "<|python_tag|>"

    def extract(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        stripped = text.lstrip()
        if not final and self.TAG.startswith(stripped):  # the tag in the making
            return "", []
        if stripped.startswith(self.TAG):
            stripped = stripped[len(self.TAG):].lstrip()
        if stripped and not stripped.startswith("{"):
            return text, []
        calls, end = _leading_calls(text, len(text) - len(stripped), ";")
        rest = text[end:] if calls else text
        return (rest if final and rest.strip() else ""), calls


class PrefixedArrayParser(ToolCallExtractor):
    """A reply that opens with one of PREFIXES and then a JSON array of `{"name": ..., "arguments": {...}}` is
    calls (held back until the array is whole; text after it is content); any other reply is content."""

    PREFIXES: tuple[str, ...] = ()

    def extract(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        stripped = text.lstrip()
        prefix = next((p for p in self.PREFIXES if stripped.startswith(p)), None)
        if prefix is None:
            in_the_making = not final and any(p.startswith(stripped) for p in self.PREFIXES)
            return ("" if in_the_making else text), []
        rest = stripped[len(prefix):].lstrip()
        if not final and not rest:
            return "", []
        try:
            value, end = _DECODER.raw_decode(rest)
        except json.JSONDecodeError:  # an array in the making, or (once final) no calls
            return (text if final else ""), []
        calls = [_call(item) for item in value] if isinstance(value, list) and value else [None]
        if None in calls:
            return text, []
        return (rest[end:] if final and rest[end:].strip() else ""), calls


class GraniteParser(PrefixedArrayParser):
    """Granite 3.x's calls: `<|tool_call|>` (3.0) or `<tool_call>` (3.1 and later), then a JSON array."""

    keeps_special_tokens = True
    PREFIXES = ("<|tool_call|>", "<tool_call>")


class Phi4MiniJsonParser(PrefixedArrayParser):
    """Phi-4-mini's calls: `functools` then a JSON array."""

    PREFIXES = ("functools",)


class HarmonyParser(ToolCallExtractor):
    """gpt-oss's calls (vLLM's `openai`): harmony messages addressed `to=functions.NAME` (engine/harmony.py), each a
    call from the moment its header is read, its text the arguments as the model writes them (streamed as they
    grow). The text of messages without a recipient is content, but for the analysis channel's (the
    `openai_gptoss` reasoning parser's reasoning); messages to other recipients (built-in tools such as `browser`)
    are neither."""

    keeps_special_tokens = True

    def extract(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        return _harmony_calls(parse_reply(text, final))


def _harmony_calls(messages: list[HarmonyMessage]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a harmony reply's messages (HarmonyParser)."""
    content, calls = [], []
    for message in messages:
        if message.function is not None:
            calls.append(ToolCall(message.function, message.text))
        elif message.recipient is None and message.channel != "analysis":
            content.append(message.text)
    return "".join(content), calls


class HarmonyOrConstrained(ToolCallExtractor):
    """`required` or a named function on gpt-oss (the `openai_gptoss` reasoning parser): the constraint shapes the
    final channel's text, which `constrained` reads; a reply that calls a function in harmony's own form instead (a
    message to=functions.NAME, which the constraint does not reach) is read as that call."""

    keeps_special_tokens = True

    def __init__(self, constrained: ToolCallExtractor):
        super().__init__(constrained.tools)
        self.constrained = constrained
        self.named = constrained.named

    def extract(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        header = text.startswith((START, CHANNEL)) or not final and any(m.startswith(text) for m in (START, CHANNEL))
        messages = parse_reply(text, final)
        if header or any(message.function is not None for message in messages):
            return _harmony_calls(messages)
        return self.constrained.extract(text, final)


TOOL_PARSERS: dict[str, type[ToolCallExtractor]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "qwen3_coder": Qwen3CoderParser,
    "mistral": MistralParser, "pythonic": PythonicParser, "granite": GraniteParser,
    "phi4_mini_json": Phi4MiniJsonParser, "openai": HarmonyParser,
}


def required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """The JSON schema `required` constrains the output to: an array of calls of the tools (one, unless
    `parallel`), each `{"name": <the tool's name>, "parameters": <its arguments>}`."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                              "parameters": tool.function.parameters_schema()},
              "required": ["name", "parameters"], "additionalProperties": False} for tool in tools]
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    return schema if parallel else {**schema, "maxItems": 1}


def call_id() -> str:
    """A fresh tool call id, in OpenAI's shape."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_field(call: ToolCall, id_: str) -> dict[str, Any]:
    """A call as a message's `tool_calls` entry."""
    return {"id": id_, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ToolCallStream:
    """What of one choice's content and tool calls has been streamed; hands out the next delta."""

    def __init__(self, extractor: ToolCallExtractor):
        self.extractor = extractor
        self.text = ""
        self.content_sent = 0
        self.sent: list[tuple[str, int]] = []  # per call sent: (its id, characters of its arguments sent)

    def advance(self, text: str, final: bool) -> dict[str, Any]:
        """The delta (`content` and / or `tool_calls`) after `text` more of the output; {} when there is none."""
        self.text += text
        content, calls = self.extractor.extract(self.text, final)
        delta: dict[str, Any] = {}
        if len(content) > self.content_sent:
            delta["content"] = content[self.content_sent:]
            self.content_sent = len(content)
        deltas = []
        for index, call in enumerate(calls):
            if index == len(self.sent):
                self.sent.append((call_id(), 0))
                deltas.append({"index": index, **tool_call_field(call, self.sent[index][0])})
            elif len(call.arguments) > self.sent[index][1]:
                deltas.append({"index": index, "function": {"arguments": call.arguments[self.sent[index][1]:]}})
            self.sent[index] = (self.sent[index][0], len(call.arguments))
        if deltas:
            delta["tool_calls"] = deltas
        return delta

    @property
    def called(self) -> bool:
        """A tool call was sent."""
        return bool(self.sent)


def arguments_for_template(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message as chat templates expect it: each tool call's `arguments` a mapping, not JSON text
    (Hermes / Qwen and Llama templates write them with `tojson`)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    rendered = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function = {**function, "arguments": json.loads(function["arguments"])}
            except json.JSONDecodeError:
                pass
            call = {**call, "function": function}
        rendered.append(call)
    return {**message, "tool_calls": rendered}


def find_tool(tools: list[Tool], name: str) -> Tool | None:
    """The tool named `name`, or None."""
    return next((tool for tool in tools if tool.function.name == name), None)

