"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

The translation alone: input items to chat messages, request fields to the chat request's, the refusals. The
output items alone: any cutting of a reply's deltas gives the same items, and the events add up to them
(hypothesis). End to end through the openai client on the bundled model: every answer is checked against the
chat route's answer to the same conversation (same greedy tokens, same prompt length), whole and streamed, with
instructions, a chained conversation (previous_response_id), logprobs, a JSON schema, a named function call and
its output given back; the kept responses (GET, DELETE, the oldest forgotten); refusals; every page back.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from hypothesis import given, settings, strategies as st

from helpers import chat_reply_deltas, http_client, running_server, small_engine_args, whole_chat_reply
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.server.app import build_app
from jaxserve.server.config import ServerConfig
from jaxserve.server.errors import APIError
from jaxserve.server.responses_api import OutputItems
from jaxserve.server.responses_protocol import ResponsesRequest, conversation
from jaxserve.server.tools import NamedToolChoice

MODEL = "tiny-stdlib-llama"
ENGINE = small_engine_args(max_model_len=256, num_pages=96, max_num_seqs=8, enable_structured_outputs=True)
PROMPT = "def fibonacci(n):"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer"], "additionalProperties": False}
TOOL = {"type": "function", "name": "answer", "description": "give the answer", "parameters": SCHEMA}
KEPT = 3


# ---- the translation ------------------------------------------------------------------------------------------


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "function_call", "call_id": "call_3", "name": "f", "arguments": "{}"},
    ]
    assert [m.for_template() for m in conversation(items)] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "calling", "reasoning": "hm", "reasoning_content": "hm", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "content": "one", "tool_call_id": "call_1"},
        {"role": "tool", "content": "two", "tool_call_id": "call_2"},
        {"role": "assistant", "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ]
    thought_then_call = [{"role": "user", "content": "a"},
                         {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "use f"}]},
                         {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
                         {"type": "reasoning", "summary": [{"type": "summary_text", "text": "no text"}]},
                         {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "left over"}]},
                         {"role": "user", "content": "b"}]
    assert [m.for_template() for m in conversation(thought_then_call)] == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "reasoning": "use f", "reasoning_content": "use f", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "user", "content": "b"},
    ]


@pytest.mark.parametrize("items, message", [
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "only text parts"),
    ([{"type": "file_search_call", "id": "x"}], "items of type 'file_search_call' are not supported"),
    ([{"role": "robot", "content": "x"}], "role must be user, assistant, system or developer"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id must be a string"),
    (["hello"], "input[0] must be an object"),
])
def test_input_items_that_cannot_be_chat_messages_are_refused(items, message):
    with pytest.raises(APIError, match=message.replace("[", r"\[").replace("]", r"\]")) as error:
        conversation(items)
    assert (error.value.status, error.value.param) == (400, "input")


def test_request_fields_become_the_chat_requests():
    request = ResponsesRequest(
        input="hi", instructions="be brief", max_output_tokens=7, temperature=0.5, top_k=3, tools=[TOOL],
        tool_choice={"type": "function", "name": "answer"}, include=["message.output_text.logprobs"], top_logprobs=2,
        reasoning={"effort": "low"}, stop=["x"])
    chat = request.to_chat([])
    assert [m.for_template() for m in chat.messages] == [{"role": "system", "content": "be brief"},
                                                         {"role": "user", "content": "hi"}]
    assert (chat.max_completion_tokens, chat.temperature, chat.top_k, chat.stop) == (7, 0.5, 3, ["x"])
    assert (chat.logprobs, chat.top_logprobs) == (True, 2)
    assert chat.tools[0].function.name == "answer" and chat.tools[0].function.parameters == SCHEMA
    assert isinstance(chat.tool_choice, NamedToolChoice) and chat.tool_choice.function.name == "answer"
    assert chat.reasoning_effort == "low" and chat.template_kwargs() == {"reasoning_effort": "low"}
    formatted = ResponsesRequest(input="hi", text={"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}})
    assert formatted.to_chat([]).structured_output().json == SCHEMA
    assert ResponsesRequest(input="hi", text={"format": {"type": "json_object"}}).to_chat([]).structured_output() \
        .json_object


@pytest.mark.parametrize("fields, param", [
    ({"n": 2}, "n"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
])
def test_request_fields_this_server_cannot_honour_are_refused(fields, param):
    with pytest.raises(APIError) as error:
        ResponsesRequest(input="hi", **fields).check()
    assert (error.value.status, error.value.param) == (400, param)


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"text": {"format": {"type": "json_object"}}, "response_format": {"type": "json_object"}}, "text"),
    ({"input": []}, "input"),
])
def test_requests_that_mean_no_chat_request_are_refused(fields, param):
    with pytest.raises(APIError) as error:
        ResponsesRequest(**{"input": "hi", **fields}).to_chat([])
    assert (error.value.status, error.value.param) == (400, param)


# ---- the output items -----------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 20), max_size=5).map(lambda cuts: sorted(set(cuts))))
def test_output_items_do_not_depend_on_how_the_reply_was_cut(cuts):
    whole, cut = OutputItems(False), OutputItems(False)
    whole.add(whole_chat_reply())
    whole.finish()
    events = [event for delta in chat_reply_deltas(cuts) for event in cut.add(delta)] + cut.finish()
    strip = [{k: v for k, v in item.items() if k != "id"} for item in cut.items]
    assert strip == [{k: v for k, v in item.items() if k != "id"} for item in whole.items]
    assert [item["type"] for item in cut.items] == ["reasoning", "message", "function_call", "function_call"]
    # the events: each item added, its deltas, then done with what the deltas add up to
    for index, item in enumerate(cut.items):
        mine = [e for e in events if e.get("output_index") == index]
        assert mine[0]["type"] == "response.output_item.added" and mine[-1]["type"] == "response.output_item.done"
        assert mine[-1]["item"] == item and item["status"] == "completed"
        deltas = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
        assert deltas == (item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"])
    assert [e["output_index"] for e in events] == sorted(e["output_index"] for e in events)  # one item at a time


def test_a_reply_with_nothing_in_it_is_an_empty_message():
    items = OutputItems(False)
    events = items.finish()
    assert [item["type"] for item in items.items] == ["message"] and items.items[0]["content"][0]["text"] == ""
    assert events[-1]["type"] == "response.output_item.done"


# ---- end to end -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    options = {k: v for k, v in ENGINE.items() if k != "show_progress"}
    engine = LLMEngine(EngineConfig.for_model(None, **options), show_progress=False)
    with running_server(build_app(engine, ServerConfig(max_stored_responses=KEPT))) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0)


def _chat(client, messages: list[dict], max_tokens: int, **kwargs):
    """The chat route's greedy answer to `messages`."""
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          **kwargs)


def _respond(client, stream: bool, **kwargs):
    """A response, whole or streamed (then its events' final response, after checking the events add up to it)."""
    kwargs = {"model": MODEL, "temperature": 0, **kwargs}
    if not stream:
        return client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1].response
    assert events[-1].type == ("response.completed" if final.status == "completed" else "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert [e.item for e in events if e.type == "response.output_item.done"] == final.output
    return final


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_response_is_the_chat_routes_answer(client, stream):
    chat = _chat(client, [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}], 20)
    response = _respond(client, stream, input=PROMPT, instructions="be brief", max_output_tokens=20)
    assert response.output_text == chat.choices[0].message.content
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                           chat.usage.completion_tokens)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.instructions == "be brief" and response.max_output_tokens == 20 and response.model == MODEL
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")


def test_a_chained_response_continues_the_conversation(client):
    """previous_response_id: the earlier input and output come before the new input (not its instructions)."""
    first = client.responses.create(model=MODEL, input=PROMPT, instructions="be brief", max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(model=MODEL, input=[{"role": "user", "content": "and then?"}],
                                     previous_response_id=first.id, max_output_tokens=8, temperature=0)
    chat = _chat(client, [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "and then?"}], 8)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id


def test_logprobs_of_the_output_text(client):
    chat = _chat(client, [{"role": "user", "content": PROMPT}], 6, logprobs=True, top_logprobs=2)
    for stream in (False, True):
        response = _respond(client, stream, input=PROMPT, max_output_tokens=6,
                            include=["message.output_text.logprobs"], top_logprobs=2)
        logprobs = response.output[0].content[0].logprobs
        assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in logprobs] == \
            [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in chat.choices[0].logprobs.content]
    assert client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=2).output[0].content[0].logprobs \
        is None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_schema_constrains_the_text(client, stream):
    response = _respond(client, stream, input=PROMPT, max_output_tokens=40,
                        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}})
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_function_call_and_its_output_given_back(client, stream):
    response = _respond(client, stream, input=PROMPT, max_output_tokens=40, tools=[TOOL],
                        tool_choice={"type": "function", "name": "answer"})
    (call,) = response.output
    assert call.type == "function_call" and call.name == "answer" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    # the call and its result given back: the prompt is the chat route's for the same turns
    turns = [{"role": "user", "content": PROMPT}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "42"}]
    after = client.responses.create(model=MODEL, input=turns, tools=[TOOL], tool_choice="none", max_output_tokens=4,
                                    temperature=0)
    chat_tool = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
    chat = _chat(client, [{"role": "user", "content": PROMPT},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": call.call_id, "type": "function",
                               "function": {"name": "answer", "arguments": call.arguments}}]},
                          {"role": "tool", "tool_call_id": call.call_id, "content": "42"}], 4,
                 tools=[chat_tool], tool_choice="none")
    assert after.usage.input_tokens == chat.usage.prompt_tokens
    assert after.output_text == chat.choices[0].message.content


def test_kept_responses_can_be_read_and_deleted_and_the_oldest_are_forgotten(server, client):
    url, _ = server
    made = [client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=2, temperature=0) for _ in range(2)]
    assert made[0].store and client.responses.retrieve(made[0].id).output_text == made[0].output_text
    client.responses.delete(made[0].id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[0].id)
    unkept = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=2, store=False)
    assert not unkept.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    for _ in range(KEPT):
        client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError) as error:  # only the newest KEPT are kept
        client.responses.create(model=MODEL, input="x", previous_response_id=made[1].id)
    assert error.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body, status, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "tools": [TOOL]}, 400, "tool_choice"),  # "auto" needs a tool call parser
    ({"input": "x" * 3000}, 400, "input"),  # longer than max_model_len
    ({"input": "x", "model": "nope"}, 404, "model"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, 400, "text"),
])
def test_bad_requests_get_an_error_that_names_the_field(server, body, status, param):
    response = http_client.post(f"{server[0]}/v1/responses", json={"model": MODEL, **body})
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_every_page_comes_back(server, client):
    client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=4)
    stats = server[1].stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_a_kept_responses_input_items_are_listed_and_it_cannot_be_cancelled(client):
    """GET .../input_items through the openai client: the response's own input (not its previous turns), the last
    first by default, a page at a time with `after`; a string input is one user message. POST .../cancel: only a
    background response can be cancelled, and none runs in the background here."""
    first = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=2, temperature=0)
    (item,) = client.responses.input_items.list(first.id).data
    assert (item.type, item.role, item.content[0].type, item.content[0].text) == ("message", "user", "input_text",
                                                                                   PROMPT)
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "user", "content": [{"type": "input_text", "text": "c"}]}]
    second = client.responses.create(model=MODEL, input=turns, previous_response_id=first.id, max_output_tokens=2)
    listed = client.responses.input_items.list(second.id)
    assert [i.content[0].text for i in listed.data] == ["c", "b", "a"] and not listed.has_more
    assert listed.data[1].content[0].type == "output_text"
    page = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["a", "b"] and page.has_more
    rest = client.responses.input_items.list(second.id, order="asc", after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["c"] and not rest.has_more
    with pytest.raises(openai.BadRequestError, match="only a background response can be cancelled"):
        client.responses.cancel(second.id)
    with pytest.raises(openai.BadRequestError, match="limit must be between 1 and 100"):
        client.responses.input_items.list(second.id, limit=0)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_missing")
