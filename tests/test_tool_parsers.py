"""The tool call extractors of server/tools.py: what each finds in a whole reply, and that streaming a reply in any
pieces sends deltas that add up to the same content and calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

from jaxserve.server.tools import (
    HermesParser,
    Llama3JsonParser,
    NamedCall,
    RequiredCalls,
    Tool,
    ToolCall,
    ToolCallStream,
    arguments_for_template,
    required_schema,
)

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
CASES = [
    # (extractor, reply, content, calls)
    (HermesParser(), "no tools here", "no tools here", []),
    (HermesParser(), f"Let me look.<tool_call>\n{json.dumps(WEATHER)}\n</tool_call>", "Let me look.",
     [ToolCall("get_weather", '{"city": "Paris", "days": 3}')]),
    (HermesParser(), '<tool_call>{"name": "a", "arguments": {}}</tool_call> and <tool_call>{"name": "b", '
                     '"arguments": {"x": [1, 2]}}</tool_call>', " and ",
     [ToolCall("a", "{}"), ToolCall("b", '{"x": [1, 2]}')]),
    (HermesParser(), "<tool_call>not json</tool_call>x", "<tool_call>not json</tool_call>x", []),
    (HermesParser(), 'cut <tool_call>{"name": "a", "argu', 'cut <tool_call>{"name": "a", "argu', []),
    (HermesParser(), "ends in <tool_c", "ends in <tool_c", []),
    (Llama3JsonParser(), "Paris is sunny.", "Paris is sunny.", []),
    (Llama3JsonParser(), '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', "",
     [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")]),
    (Llama3JsonParser(), '<|python_tag|>{"name": "a", "arguments": {"y": "z"}}', "", [ToolCall("a", '{"y": "z"}')]),
    (Llama3JsonParser(), '{"name": "a", "parameters": {}}; {"oops', '; {"oops', [ToolCall("a", "{}")]),
    (Llama3JsonParser(), '{"not": "a call"}', '{"not": "a call"}', []),
    (RequiredCalls(), '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]', "",
     [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")]),
    (RequiredCalls(), '[{"name": "a", "parameters": {}}, {"name": "b", "para', ', {"name": "b", "para',
     [ToolCall("a", "{}")]),
    (NamedCall("f"), '{"city": "Oslo"}', "", [ToolCall("f", '{"city": "Oslo"}')]),
]


@pytest.mark.parametrize("extractor,reply,content,calls", CASES)
def test_a_whole_reply_splits_into_content_and_calls(extractor, reply, content, calls):
    assert extractor.extract(reply, final=True) == (content, calls)


@pytest.mark.parametrize("extractor,reply,content,calls", CASES)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_deltas_add_up_to_the_whole_replys_split(extractor, reply, content, calls, piece):
    stream = ToolCallStream(extractor)
    sent_content, sent_calls = "", []
    pieces = [reply[i:i + piece] for i in range(0, len(reply), piece)]
    for index, text in enumerate(pieces):
        delta = stream.advance(text, final=index == len(pieces) - 1)
        sent_content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if call["index"] == len(sent_calls):  # a new call: its id, type and name come first, once
                assert call["id"].startswith("call_") and call["type"] == "function"
                sent_calls.append([call["function"]["name"], ""])
            sent_calls[call["index"]][1] += call["function"]["arguments"]
    assert sent_content == content
    assert [ToolCall(name, arguments) for name, arguments in sent_calls] == calls
    assert stream.called == bool(calls)


def test_required_schema_takes_one_call_of_each_tool_and_no_other():
    tools = [Tool.model_validate({"function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}),
        Tool.model_validate({"function": {"name": "now"}})]
    schema = required_schema(tools, parallel=True)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}],
                        schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):  # one call only without parallel tool calls
        jsonschema.validate([{"name": "now", "parameters": {}}] * 2, required_schema(tools, parallel=False))


def test_templates_get_tool_call_arguments_as_mappings():
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "d", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}
    calls = arguments_for_template(message)["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"x": 1} and calls[1]["function"]["arguments"] == "not json"
    assert message["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # the request's own message unchanged
