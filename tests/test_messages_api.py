"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API, which vLLM serves too).

The translation alone: messages and content blocks to chat messages, request fields to the chat request's, the
refusals. The content blocks alone: any cutting of a reply's deltas gives the same blocks, and the events add up
to them (hypothesis). End to end through the anthropic client on the bundled model (its x-api-key header): every
answer is checked against the chat route's answer to the same conversation (same greedy tokens, same prompt
length), whole and streamed; a stop sequence; a named tool and its result given back; token counting; errors in
Anthropic's shape; every page back.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from hypothesis import given, settings, strategies as st

from conftest import API_KEY
from helpers import chat_reply_deltas, http_client, running_server, small_engine_args, whole_chat_reply
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.server.app import build_app
from jaxserve.server.config import ServerConfig
from jaxserve.server.errors import APIError
from jaxserve.server.messages_api import ContentBlocks
from jaxserve.server.messages_protocol import MessagesRequest

MODEL = "tiny-stdlib-llama"
ENGINE = small_engine_args(max_model_len=256, num_pages=96, max_num_seqs=8, enable_structured_outputs=True)
PROMPT = "def fibonacci(n):"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer"], "additionalProperties": False}
TOOL = {"name": "answer", "description": "give the answer", "input_schema": SCHEMA}
CHAT_TOOL = {"type": "function", "function": {"name": "answer", "description": "give the answer",
                                              "parameters": SCHEMA}}


# ---- the translation ------------------------------------------------------------------------------------------


def _request(**fields) -> MessagesRequest:
    return MessagesRequest(**{"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                              **fields})


def test_messages_and_blocks_become_chat_messages():
    request = _request(system=[{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}], messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "x"},
            {"type": "text", "text": "calling"},
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}},
            {"type": "tool_use", "id": "toolu_2", "name": "g", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "one"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "no"}],
             "is_error": True},
            {"type": "text", "text": "and?"}]},
        {"role": "assistant", "content": "sure"}])
    assert [m.for_template() for m in request.to_chat().messages] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "calling", "reasoning": "hm", "reasoning_content": "hm", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "one"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no"},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "sure"},
    ]


def test_request_fields_become_the_chat_requests():
    chat = _request(max_tokens=12, stop_sequences=["\n\n"], temperature=0.5, top_p=0.9, top_k=4,
                    metadata={"user_id": "u1"}, tools=[TOOL], tool_choice={"type": "any",
                                                                           "disable_parallel_tool_use": True},
                    thinking={"type": "disabled"}).to_chat()
    assert (chat.max_completion_tokens, chat.stop, chat.temperature, chat.top_p, chat.top_k, chat.user) == (
        12, ["\n\n"], 0.5, 0.9, 4, "u1")
    assert chat.tool_choice == "required" and not chat.parallel_tool_calls
    assert chat.tools[0].model_dump(exclude_none=True) == CHAT_TOOL
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    named = _request(tools=[TOOL], tool_choice={"type": "tool", "name": "answer"}).to_chat()
    assert named.tool_choice.function.name == "answer" and named.parallel_tool_calls
    assert _request(tool_choice={"type": "none"}, tools=[TOOL]).to_chat().tool_choice == "none"
    assert _request(thinking={"type": "enabled", "budget_tokens": 1024}).to_chat().chat_template_kwargs is None
    shaped = _request(output_config={"effort": "high", "format": {"type": "json_schema", "schema": SCHEMA}},
                      cache_control={"type": "ephemeral"}, thinking={"type": "adaptive"}).to_chat()
    assert shaped.chat_template_kwargs == {"reasoning_effort": "high"}
    assert shaped.response_format.type == "json_schema" and shaped.response_format.json_schema.json_schema == SCHEMA


@pytest.mark.parametrize("fields, param, message", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages", "'image' blocks"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages", "role must be user or assistant"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]}, "messages",
     "not supported in a assistant message"),
    ({"messages": []}, "messages", "at least one message"),
    ({"messages": [{"role": "assistant", "content": [{"type": "thinking", "signature": "s"}]}]}, "messages",
     "needs its thinking as a string"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools", "only custom tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "tool_choice", "needs the tool's name"),
    ({"thinking": {"type": "enabled"}}, "thinking", "budget_tokens"),
    ({"system": [{"type": "image"}]}, "system", "list of text blocks"),
    ({"thinking": {"type": "sometimes"}}, "thinking", "thinking type must be"),
    ({"output_config": {"format": {"type": "text"}}}, "output_config", "json_schema"),
])
def test_requests_that_mean_no_chat_request_are_refused(fields, param, message):
    with pytest.raises(APIError, match=message) as error:
        _request(**fields).to_chat()
    assert error.value.param == param


# ---- the content blocks ---------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 20), max_size=5).map(lambda cuts: sorted(set(cuts))))
def test_content_blocks_do_not_depend_on_how_the_reply_was_cut(cuts):
    whole, cut = ContentBlocks(), ContentBlocks()
    whole.add(whole_chat_reply())
    whole.finish()
    events = [event for delta in chat_reply_deltas(cuts) for event in cut.add(delta)] + cut.finish()
    assert cut.blocks == whole.blocks
    assert cut.blocks == [{"type": "thinking", "thinking": "let me think about it", "signature": ""},
                          {"type": "text", "text": "The answer: "},
                          {"type": "tool_use", "id": "call_2", "name": "answer", "input": {"answer": 42}},
                          {"type": "tool_use", "id": "call_3", "name": "answer", "input": {"answer": 7}}]
    # the events: each block started, its deltas, then stopped; one block at a time
    for index, block in enumerate(cut.blocks):
        mine = [e for e in events if e["index"] == index]
        assert mine[0]["type"] == "content_block_start" and mine[-1] == {"type": "content_block_stop", "index": index}
        pieces = [e["delta"] for e in mine if e["type"] == "content_block_delta"]
        joined = "".join(p.get("text", p.get("thinking", p.get("partial_json"))) for p in pieces)
        assert joined == (json.dumps(block["input"]) if block["type"] == "tool_use" else block[block["type"]])
    assert [e["index"] for e in events] == sorted(e["index"] for e in events)


def test_a_reply_with_nothing_in_it_is_an_empty_text_block():
    blocks = ContentBlocks()
    events = blocks.finish()
    assert blocks.blocks == [{"type": "text", "text": ""}] and events[-1]["type"] == "content_block_stop"


# ---- end to end -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    options = {k: v for k, v in ENGINE.items() if k != "show_progress"}
    engine = LLMEngine(EngineConfig.for_model(None, **options), show_progress=False)
    with running_server(build_app(engine, ServerConfig(api_key=API_KEY))) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server[0], api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def chat_client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0)


def _chat(chat_client, messages: list[dict], max_tokens: int, **kwargs):
    """The chat route's greedy answer to `messages`."""
    return chat_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                               **kwargs)


def _message(client, stream: bool, **kwargs):
    """A message, whole or streamed (then the stream's final message, after checking its events add up to it)."""
    kwargs = {"model": MODEL, "extra_body": {"temperature": 0}, **kwargs}  # (the SDK sends no temperature now)
    if not stream:
        return client.messages.create(**kwargs)
    events = list(client.messages.create(stream=True, **kwargs))
    assert events[0].type == "message_start" and [e.type for e in events[-2:]] == ["message_delta", "message_stop"]
    with client.messages.stream(**kwargs) as streamed:
        final = streamed.get_final_message()
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text == "".join(block.text for block in final.content if block.type == "text")
    assert events[-2].delta.stop_reason == final.stop_reason
    assert events[-2].usage.output_tokens == final.usage.output_tokens
    return final


def _input_tokens(message) -> int:
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_message_is_the_chat_routes_answer(client, chat_client, stream):
    chat = _chat(chat_client, [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}], 20)
    message = _message(client, stream, system="be brief", max_tokens=20, messages=[{"role": "user",
                                                                                    "content": PROMPT}])
    (block,) = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert (_input_tokens(message), message.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                     chat.usage.completion_tokens)
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.model == MODEL and message.role == "assistant" and message.id.startswith("msg_")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_sequence_ends_the_message_and_is_named(client, stream):
    whole = client.messages.create(model=MODEL, max_tokens=24, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": PROMPT}]).content[0].text
    stop = whole[len(whole) // 2:][:3]
    message = _message(client, stream, max_tokens=24, messages=[{"role": "user", "content": PROMPT}],
                       stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == whole[:whole.index(stop)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_and_its_result_given_back(client, chat_client, stream):
    message = _message(client, stream, max_tokens=40, messages=[{"role": "user", "content": PROMPT}], tools=[TOOL],
                       tool_choice={"type": "tool", "name": "answer"})
    (call,) = message.content
    assert call.type == "tool_use" and call.name == "answer" and message.stop_reason == "tool_use"
    jsonschema.validate(call.input, SCHEMA)
    turns = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": [call.model_dump()]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "42"}]}]
    after = client.messages.create(model=MODEL, max_tokens=4, extra_body={"temperature": 0}, messages=turns,
                                   tools=[TOOL],
                                   tool_choice={"type": "none"})
    chat = _chat(chat_client, [{"role": "user", "content": PROMPT},
                               {"role": "assistant", "content": None, "tool_calls": [
                                   {"id": call.id, "type": "function",
                                    "function": {"name": "answer", "arguments": json.dumps(call.input)}}]},
                               {"role": "tool", "tool_call_id": call.id, "content": "42"}], 4,
                 tools=[CHAT_TOOL], tool_choice="none")
    assert _input_tokens(after) == chat.usage.prompt_tokens
    assert after.content[0].text == chat.choices[0].message.content
    counted = client.messages.count_tokens(model=MODEL, messages=turns, tools=[TOOL])
    assert counted.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_output_schema_constrains_the_text(client, stream):
    message = _message(client, stream, max_tokens=40, messages=[{"role": "user", "content": PROMPT}],
                       output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), SCHEMA)


@pytest.mark.parametrize("body, status, kind, says", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     "'image' blocks"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "invalid_request_error",
     "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL]}, 400, "invalid_request_error",
     "--tool-call-parser"),  # tool_choice auto needs one
    ({"messages": [{"role": "user", "content": "x" * 3000}]}, 400, "invalid_request_error", "max_model_len"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "not_found_error", "nope"),
    ({"messages": [{"role": "user", "content": "x"}], "speed": "fast"}, 400, "invalid_request_error", "speed"),
])
def test_bad_requests_get_an_anthropic_error(server, body, status, kind, says):
    response = http_client.post(f"{server[0]}/v1/messages", headers={"x-api-key": API_KEY},
                                json={"model": MODEL, "max_tokens": 4, **body})
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and says in error["error"]["message"]


def test_a_missing_key_is_an_anthropic_authentication_error(server):
    with pytest.raises(anthropic.AuthenticationError) as error:
        anthropic.Anthropic(base_url=server[0], api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert error.value.body["error"]["type"] == "authentication_error"


def test_every_page_comes_back(server, client):
    client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": PROMPT}])
    stats = server[1].stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
