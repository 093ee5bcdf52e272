"""The tool call extractors of server/tools.py: what each finds in a whole reply, and that streaming a reply in any
pieces sends deltas that add up to the same content and calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

from jaxserve.server.config import VALID_TOOL_CALL_PARSERS
from jaxserve.server.tools import (
    TOOL_PARSERS,
    GraniteParser,
    HarmonyOrConstrained,
    HarmonyParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedCall,
    Phi4MiniJsonParser,
    PythonicParser,
    Qwen3CoderParser,
    RequiredCalls,
    Tool,
    ToolCall,
    ToolCallStream,
    arguments_for_template,
    required_schema,
)

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
WEATHER_TOOL = Tool.model_validate({"function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}, "note": {"type": ["string", "null"]}}}}})
QWEN3_CODER = Qwen3CoderParser([WEATHER_TOOL])
WEATHER_XML = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
               "</parameter>\n</function>\n</tool_call>")
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
    # Qwen3-Coder: values typed by the tool's schema (a string stays text, "3" is an integer)
    (QWEN3_CODER, f"Checking.\n{WEATHER_XML}", "Checking.\n",
     [ToolCall("get_weather", '{"city": "Paris", "days": 3}')]),
    (QWEN3_CODER, "<tool_call>\n<function=get_weather>\n<parameter=city>\n007\n</parameter>\n<parameter=metric>\ntrue\n"
                  "</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
                  "<parameter=days>\nsoon\n</parameter>\n</function>\n</tool_call>", "",
     [ToolCall("get_weather", '{"city": "007", "metric": true, "hours": [1, 2], "note": "null", "days": "soon"}')]),
    (QWEN3_CODER, "<tool_call>\n<function=other_tool>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>", "",
     [ToolCall("other_tool", '{"x": "1"}')]),  # an unknown tool's values stay text
    (QWEN3_CODER, "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>",
     "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>", []),
    (QWEN3_CODER, "<tool_call>\n<function=get_weather>\n<parameter=city>\nPa", "<tool_call>\n<function=get_weather>"
                  "\n<parameter=city>\nPa", []),  # cut short: text once final
    # Mistral: a JSON array after [TOOL_CALLS] (tokenizers before v11), or NAME[ARGS]{...} per call (v11+)
    (MistralParser(), "Sure. [TOOL_CALLS][" + json.dumps(WEATHER) + ', {"name": "now", "arguments": {}}]', "Sure. ",
     [ToolCall("get_weather", '{"city": "Paris", "days": 3}'), ToolCall("now", "{}")]),
    (MistralParser(), '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]now[ARGS]{}', "",
     [ToolCall("get_weather", '{"city": "Paris", "days": 3}'), ToolCall("now", "{}")]),
    (MistralParser(), '[TOOL_CALLS]now[CALL_ID]a1b2c3d4e[ARGS]{"tz": "UTC"}', "", [ToolCall("now", '{"tz": "UTC"}')]),
    (MistralParser(), "plain [TOOL_", "plain [TOOL_", []),
    (MistralParser(), '[TOOL_CALLS]now[ARGS]{"tz": ', '[TOOL_CALLS]now[ARGS]{"tz": ', []),
    (MistralParser(), '[TOOL_CALLS][{"not": "a call"}]', '[TOOL_CALLS][{"not": "a call"}]', []),
    (MistralParser(), '[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]bad[ARGS]{"x": 1} trailing', '[TOOL_CALLS]bad[ARGS]{"x": 1} '
     'trailing', [ToolCall("now", "{}")]),  # the call before stays a call; the rest is content
    # pythonic: a Python list of calls with literal keyword arguments
    (PythonicParser(), '[get_weather(city="Paris", days=3), now()]', "",
     [ToolCall("get_weather", '{"city": "Paris", "days": 3}'), ToolCall("now", "{}")]),
    (PythonicParser(), "[f(x=[1, (2, 3)], y={'k': None}, z=-1.5)]", "",
     [ToolCall("f", '{"x": [1, [2, 3]], "y": {"k": null}, "z": -1.5}')]),
    (PythonicParser(), "The weather is fine.", "The weather is fine.", []),
    (PythonicParser(), "[1, 2, 3]", "[1, 2, 3]", []),
    (PythonicParser(), "[f(x=open('a'))]", "[f(x=open('a'))]", []),  # not a literal
    (PythonicParser(), "[f(1)]", "[f(1)]", []),  # positional
    (PythonicParser(), "[f(**kw)]", "[f(**kw)]", []),
    (PythonicParser(), "[f(x=1)] and more", "[f(x=1)] and more", []),
    # Granite 3.x and Phi-4-mini: a marker, then a JSON array of calls (text after the array is content)
    (GraniteParser(), "<|tool_call|>[" + json.dumps(WEATHER) + ', {"name": "now", "arguments": {}}]', "",
     [ToolCall("get_weather", '{"city": "Paris", "days": 3}'), ToolCall("now", "{}")]),
    (GraniteParser(), ' <tool_call>[{"name": "now", "arguments": {"tz": "UTC"}}] done', " done",
     [ToolCall("now", '{"tz": "UTC"}')]),
    (GraniteParser(), "It is sunny in Paris.", "It is sunny in Paris.", []),
    (GraniteParser(), "<tool_", "<tool_", []),
    (GraniteParser(), '<|tool_call|>[{"name": "now", "argu', '<|tool_call|>[{"name": "now", "argu', []),
    (GraniteParser(), '<|tool_call|>[{"not": "a call"}]', '<|tool_call|>[{"not": "a call"}]', []),
    (Phi4MiniJsonParser(), 'functools[{"name": "now", "arguments": {}}]', "", [ToolCall("now", "{}")]),
    (Phi4MiniJsonParser(), "functional programming", "functional programming", []),
    (Phi4MiniJsonParser(), "functools[]", "functools[]", []),
    # gpt-oss (harmony): messages to functions.NAME are calls; final and preamble text is content, analysis is not
    (HarmonyParser(), '<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>commentary '
                      'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris", "days": 3}<|call|>', "",
     [ToolCall("get_weather", '{"city":"Paris", "days": 3}')]),  # the arguments as written
    (HarmonyParser(), '<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.now'
                      '<|channel|>commentary json<|message|>{}', "Checking.", [ToolCall("now", "{}")]),
    (HarmonyParser(), "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.",
     "Sunny.", []),
    (HarmonyParser(), "<|channel|>commentary to=functions.f <|constrain|>json<|message|>not json<|call|>", "",
     [ToolCall("f", "not json")]),
    (HarmonyParser(), '<|channel|>commentary to=functions.f json<|message|>{"x": ', "", [ToolCall("f", '{"x": ')]),
    (HarmonyParser(), "<|channel|>analysis to=browser.search<|message|>{}<|call|>", "", []),  # a built-in tool
    (HarmonyParser(), "no header at all", "no header at all", []),
    (HarmonyParser(), "<|channel|>final<|message|>cut <|", "cut <|", []),
    # required or a named function on gpt-oss: the constrained final text, or the model's own harmony call
    (HarmonyOrConstrained(NamedCall("f")), '{"x": 1}', "", [ToolCall("f", '{"x": 1}')]),
    (HarmonyOrConstrained(NamedCall("f")), '<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json'
                                           '<|message|>{"x":1}', "", [ToolCall("f", '{"x":1}')]),
    (HarmonyOrConstrained(RequiredCalls()), '[{"name": "a", "parameters": {}}]', "", [ToolCall("a", "{}")]),
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


def test_the_cli_names_every_parser_the_server_has():
    assert tuple(TOOL_PARSERS) == VALID_TOOL_CALL_PARSERS
    assert [name for name, parser in TOOL_PARSERS.items() if parser.keeps_special_tokens] == ["mistral", "granite",
                                                                                               "openai"]
    assert [name for name, parser in TOOL_PARSERS.items() if parser.named] == []  # "auto": the model chose


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
