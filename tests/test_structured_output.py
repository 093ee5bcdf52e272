"""Structured output and tool calls (issue 18), on the bundled model, which knows nothing about JSON or tools.

Offline: every constrained answer parses and validates against its schema, fully matches its regex, is one of its
choices, or is a sentence of its grammar, greedy and sampled, with many requests in flight; constraints compile
once; bad ones are a ValueError; nothing compiles after warm-up; a step waiting only for a compile sleeps.

Through the official openai client against a real server (an engine built like the offline one, so it takes the
same executables): vLLM's extra_body fields and OpenAI's response_format, streamed and not, validate the same way;
tool_choice "required" and a named function give calls whose arguments fit the tool's schema; "auto" reads Hermes
`<tool_call>` blocks; an uncompilable constraint is a 400 before anything is queued."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time

import jsonschema
import llguidance
import openai
import pytest

from helpers import http_client, running_server, small_engine_args
from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.server.app import build_app
from jaxserve.server.config import ServerConfig
from jaxserve.structured.params import STRUCTURAL_TAG_FORM, StructuredOutputsParams

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 130}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "size": {"type": "string", "enum": ["S", "M", "L"]}},
     "required": ["color", "size"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"},
                                                  "tags": {"type": "array", "items": {"type": "string",
                                                                                      "maxLength": 8},
                                                           "maxItems": 3}},
                 "required": ["id", "tags"], "additionalProperties": False},
        "ok": {"type": "boolean"}}, "required": ["user", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                      "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["code", "ratio"], "additionalProperties": False},
]
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe"]
GRAMMAR = 'start: "(" NUM ("," NUM) ~ 0..3 ")"\nNUM: /[0-9]{1,3}/'  # bounded: a tiny model may never stop
PROMPT = "def f(x):"


ENGINE = small_engine_args(max_model_len=512, num_pages=128, max_num_seqs=16, enable_structured_outputs=True,
                           min_token_bucket=16, skip_precompile=False)
KEY = "structured-key"


@pytest.fixture(scope="module")
def llm():
    return LLM(None, **ENGINE)


def _params(constraint: StructuredOutputsParams, temperature: float, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=160, temperature=temperature, seed=seed, structured_outputs=constraint)


def test_every_answer_meets_its_constraint(llm):
    cases = [(StructuredOutputsParams(json=schema), schema) for schema in SCHEMAS]
    cases += [(StructuredOutputsParams(regex=REGEX), None), (StructuredOutputsParams(choice=CHOICES), None),
              (StructuredOutputsParams(grammar=GRAMMAR), None)]
    params = [_params(c, t, seed) for c, _ in cases for t, seed in ((0.0, 0), (1.0, 1), (1.0, 2))]
    objects = [_params(StructuredOutputsParams(json_object=True), 1.0, seed) for seed in range(4)]
    compiles_before = llm.engine.core.runner.num_lazy_compiles
    outputs = llm.generate([PROMPT] * (len(params) + len(objects)), params + objects, use_tqdm=False)
    assert llm.engine.core.runner.num_lazy_compiles == compiles_before, "constrained steps were warmed up"
    _check_json_objects([(o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs[len(params):]])
    for param, output in zip(params, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (param.structured_outputs, completion.text)
        text, kind = completion.text, param.structured_outputs.kind
        if kind == "json":
            jsonschema.validate(json.loads(text), param.structured_outputs.json)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif kind == "choice":
            assert text in CHOICES
        else:
            assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3}){0,3}\)", text), text
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def _check_json_objects(answers: list[tuple[str, str]]) -> None:
    """Answers (text, finish reason) under json_object: any JSON object meets it, so nothing bounds its length and
    a model may run into max_tokens inside one; every answer that stopped is an object, and most stopped."""
    stopped = [text for text, finish in answers if finish == "stop"]
    assert all(isinstance(json.loads(text), dict) for text in stopped), stopped
    assert len(stopped) >= len(answers) / 2, answers


def test_constrained_and_free_requests_share_steps(llm):
    """Free rows in a step with constrained ones keep their own tokens (every bit of their mask is set)."""
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate([PROMPT], free, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate([PROMPT] * 4, [free, _params(StructuredOutputsParams(choice=CHOICES), 0, 0)] * 2,
                         use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == mixed[2].outputs[0].token_ids == alone
    assert mixed[1].outputs[0].text in CHOICES


def test_constrained_steps_give_the_same_tokens_with_and_without_asynchronous_scheduling(llm):
    """Asynchronously, a constrained step is planned and its forward dispatched before the step in flight is back,
    and its masks filled once it is: the tokens are those of the synchronous engine."""
    sync = LLM(None, **{**ENGINE, "async_scheduling": False})  # built like `llm`: its executables, no compiling
    params = [_params(StructuredOutputsParams(json=schema), 0.0, 0) for schema in SCHEMAS]
    params += [_params(StructuredOutputsParams(regex=REGEX), 1.0, 3), SamplingParams(max_tokens=24, temperature=0)]
    tokens = [[o.outputs[0].token_ids for o in engine.generate([PROMPT] * len(params), params, use_tqdm=False)]
              for engine in (llm, sync)]
    assert tokens[0] == tokens[1]


def test_a_constraint_compiles_once(llm):
    compiler = llm.engine.grammars
    constraint = StructuredOutputsParams(json=SCHEMAS[0])
    first = compiler.compile(constraint)
    assert compiler.compile(StructuredOutputsParams(json=json.dumps(SCHEMAS[0]))) is first  # same schema as text


@pytest.mark.parametrize("fields,message", [
    ({"json": {"type": "strin"}}, "cannot compile the json constraint"),
    ({"regex": "(unclosed"}, "cannot compile the regex constraint"),
    ({"grammar": "start: undefined_rule"}, "cannot compile the grammar constraint"),
])
def test_a_constraint_that_cannot_compile_is_a_value_error(llm, fields, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.grammars.compile(StructuredOutputsParams(**fields))
    outputs = llm.generate([PROMPT], SamplingParams(max_tokens=4, structured_outputs=fields), use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error"  # the engine ends it alone and goes on
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]


def test_a_whitespace_pattern_decides_the_whitespace_between_json_tokens(llm):
    """JSON is compact by default (", " and ": " only); a whitespace_pattern (vLLM's) allows exactly the whitespace
    it matches between tokens, where there is any (here: a newline and an indent, so pretty-printed JSON)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
    texts = ['{"a":1,"b":2}', '{"a": 1, "b": 2}', '{\n  "a":1,\n  "b":2\n}', '{ "a" : 1 }']
    compiler = llm.engine.grammars

    def accepted(constraint: StructuredOutputsParams) -> list[bool]:
        grammar, verdicts = compiler.compile(constraint), []
        for text in texts:
            matcher, tokens = llguidance.LLMatcher(compiler.tokenizer, grammar), compiler.tokenizer.tokenize_str(text)
            verdicts.append(matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting())
        return verdicts

    assert accepted(StructuredOutputsParams(json=schema)) == [False, True, False, False]
    assert accepted(StructuredOutputsParams(json=schema, whitespace_pattern=r"\n *")) == [True, False, True, False]
    assert accepted(StructuredOutputsParams(json=schema, disable_any_whitespace=False)) == [True, True, True, False]
    with pytest.raises(ValueError, match="whitespace_pattern is for JSON constraints"):
        StructuredOutputsParams(regex="a", whitespace_pattern=" ")


@pytest.mark.parametrize("fields", [{}, {"json": {}, "regex": "a"}, {"choice": []}, {"json": 3}, {"regex": 5},
                                    {"json": {}, "whitespace_pattern": 3}])
def test_malformed_constraints_are_refused(fields):
    with pytest.raises(ValueError):
        StructuredOutputsParams(**fields)


def test_an_engine_with_structured_outputs_off_refuses_a_constraint_and_builds_fewer_samplers(llm):
    off = LLM(None, **{**ENGINE, "enable_structured_outputs": False})  # the tests' default: off
    with pytest.raises(ValueError, match="enable_structured_outputs off"):
        off.generate([PROMPT], _params(StructuredOutputsParams(choice=CHOICES), 0, 0), use_tqdm=False)
    samplers_on, samplers_off = llm.engine.core.runner.shapes()[1], off.engine.core.runner.shapes()[1]
    assert len(samplers_on) == 2 * len(samplers_off) and {shape[2] for shape in samplers_off} == {0}


def test_a_step_waiting_only_for_a_compile_sleeps_instead_of_spinning(llm, monkeypatch):
    compiler = llm.engine.grammars
    compile_now = compiler.compile
    monkeypatch.setattr(compiler, "compile", lambda params: (time.sleep(0.3), compile_now(params))[1])
    llm.engine.add_request("slow", PROMPT, _params(StructuredOutputsParams(regex="[a-z]{1,6}"), 0, 0))
    steps, start = 0, time.monotonic()
    while not llm.engine.core.scheduler.running and time.monotonic() - start < 10:
        llm.engine.step()
        steps += 1
    assert llm.engine.core.scheduler.running, "the request started once its grammar compiled"
    assert steps <= 0.3 / 0.01 + 10, steps  # a spinning loop steps thousands of times in 0.3 s
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


# ---- structural tags (vLLM's structural_tag) -------------------------------------------------------------------

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
       "additionalProperties": False}
WEATHER_TAG = {"type": "structural_tag", "triggers": ["<function="],
               "structures": [{"begin": "<function=get_weather>", "schema": CITY, "end": "</function>"},
                              {"begin": "<function=add>", "schema": ADD, "end": "</function>"}]}
# "(" is everywhere in the bundled model's code: its outputs enter the structures, as a tool-calling model's would
PAREN_TAG = {"type": "structural_tag", "triggers": ["("],
             "structures": [{"begin": "(city=", "schema": CITY, "end": ")"}, {"begin": "(add=", "schema": ADD,
                                                                               "end": ")"}]}


def _accepts(compiler, grammar: str, text: str | list[int]) -> bool:
    """The grammar takes all of `text` (or these token ids) and may end there."""
    matcher = llguidance.LLMatcher(compiler.tokenizer, grammar)
    tokens = compiler.tokenizer.tokenize_str(text) if isinstance(text, str) else text
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


def _entered_structures(text: str, tag: dict) -> list[tuple[str, object]]:
    """(begin, JSON value) of each structure `text` enters, read as the structural tag reads it: free text up to the
    first trigger, then the structure whose begin follows, its JSON and its end, then free text again; a last one
    that max_tokens cut off is left out (the grammar check says the text is right so far)."""
    entered, at = [], 0
    while (starts := [i for i in (text.find(trigger, at) for trigger in tag["triggers"]) if i >= 0]):
        start = min(starts)
        structure = next((s for s in tag["structures"] if text.startswith(s["begin"], start)), None)
        if structure is None:
            return entered
        try:
            value, at = json.JSONDecoder().raw_decode(text, start + len(structure["begin"]))
        except json.JSONDecodeError:
            return entered
        if not text.startswith(structure["end"], at):
            return entered
        entered.append((structure["begin"], value))
        at += len(structure["end"])
    return entered


def test_a_structural_tag_compiles_to_free_text_with_schema_checked_structures(llm):
    """vLLM's semantics: free text; at a trigger, the structure whose begin follows, JSON of its schema, its end;
    then free text again. The JSON follows the constraint's whitespace rule (compact by default)."""
    compiler = llm.engine.grammars
    grammar = compiler.compile(StructuredOutputsParams(structural_tag=json.dumps(WEATHER_TAG)))
    assert compiler.compile(StructuredOutputsParams(structural_tag=WEATHER_TAG)) is grammar  # the object: same tag
    call = '<function=get_weather>{"city": "Paris"}</function>'
    for text in ["", "Any text at all, {\"town\": 1} too.", f"Let me look. {call}", f"{call} Then: {call}\nDone.",
                 'Sum: <function=add>{"a": 1, "b": -2}</function>!']:
        assert _accepts(compiler, grammar, text), text
    for text in ['<function=get_weather>{"town": 1}', '<function=get_weather>{"city": 3}</function>',
                 '<function=get_weather>{"city": "Paris", "unit": "C"}</function>', '<function=get_weather>{"city":'
                 '"Paris"}</function>', "<function=get_time>{}</function>", f"{call[:-1]}"]:
        assert not _accepts(compiler, grammar, text), text
    spaced = compiler.compile(StructuredOutputsParams(structural_tag=WEATHER_TAG, whitespace_pattern=r" *"))
    assert _accepts(compiler, spaced, '<function=get_weather>{ "city" :"Paris"}</function>')


def test_a_structural_tag_trigger_shaped_like_a_special_token(llm):
    """A trigger `<...>` that is a special token of the model is that token (llguidance's reading); one that is not
    (here `<tool_call>`: the bundled tokenizer has no such token) is plain text, where vLLM cannot compile it."""
    compiler = llm.engine.grammars
    tool_call = {"structures": [{"begin": "<tool_call>", "schema": CITY, "end": "</tool_call>"}],
                 "triggers": ["<tool_call>"]}
    grammar = compiler.compile(StructuredOutputsParams(structural_tag=tool_call))
    assert _accepts(compiler, grammar, 'Calling <tool_call>{"city": "Rome"}</tool_call>.')
    assert not _accepts(compiler, grammar, "Calling <tool_call>Rome</tool_call>.")
    pad = compiler.tokenizer.tokenize_str("<pad>")
    assert len(pad) == 1 and compiler.tokenizer.is_special_token(pad[0])
    grammar = compiler.compile(StructuredOutputsParams(structural_tag={
        "structures": [{"begin": "<pad>", "schema": {"type": "integer"}, "end": "!"}], "triggers": ["<pad>"]}))
    tokens = compiler.tokenizer.tokenize_str
    assert _accepts(compiler, grammar, tokens("x ") + pad + tokens("12! y <pad"))
    assert not _accepts(compiler, grammar, tokens("x ") + pad + tokens("y"))


def test_every_output_under_a_structural_tag_is_a_sentence_of_its_grammar(llm):
    """The bundled model writes code, full of "(": every "(" it writes starts a structure, whose JSON validates
    against the structure's schema; greedy and sampled, with JSON-schema requests in the same steps."""
    constraint = StructuredOutputsParams(structural_tag=json.dumps(PAREN_TAG))
    params = [SamplingParams(max_tokens=120, temperature=t, seed=seed, structured_outputs=constraint)
              for t, seed in ((0.0, 0), (1.0, 1), (1.0, 2), (1.0, 3))]
    params += [_params(StructuredOutputsParams(json=SCHEMAS[0]), 1.0, 4)]
    outputs = [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params, use_tqdm=False)]
    grammar = llm.engine.grammars.compile(constraint)
    schemas = {structure["begin"]: structure["schema"] for structure in PAREN_TAG["structures"]}
    for completion in outputs[:-1]:
        assert completion.finish_reason in ("stop", "length"), completion
        matcher = llguidance.LLMatcher(llm.engine.grammars.tokenizer, grammar)
        assert matcher.try_consume_tokens(completion.token_ids) == len(completion.token_ids), completion.text
        entered = _entered_structures(completion.text, PAREN_TAG)
        assert entered, completion.text  # the model wrote a "(": the structure was entered and finished
        for begin, value in entered:
            jsonschema.validate(value, schemas[begin])
    jsonschema.validate(json.loads(outputs[-1].text), SCHEMAS[0])


@pytest.mark.parametrize("tag,words", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    (7, "must be a JSON object"),
    ({"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f"], "tags": []}},
     "xgrammar's"),
    ({**WEATHER_TAG, "type": "json_schema"}, 'type must be "structural_tag"'),
    ({**WEATHER_TAG, "structures": []}, "structures must be a non-empty list"),
    ({"triggers": ["<function="]}, "structures must be a non-empty list"),
    ({**WEATHER_TAG, "triggers": None}, "triggers must be a list"),
    ({**WEATHER_TAG, "triggers": ["<function=", ""]}, "triggers must be a list of non-empty strings"),
    ({**WEATHER_TAG, "triggers": ["<tool"]}, "not found in triggers"),
    ({**WEATHER_TAG, "structures": [{"begin": "<function=f>", "end": "</function>"}]}, "needs a schema"),
    ({**WEATHER_TAG, "structures": [{"begin": "<function=f>", "schema": CITY}]}, "needs a non-empty string begin"),
    ({**WEATHER_TAG, "structures": ["<function=f>"]}, "structures[0] must be an object"),
    ({**WEATHER_TAG, "structures": [{"begin": "<function=f>", "schema": CITY, "end": "", "stop": "x"}]},
     "unknown keys 'stop'"),
    ({**WEATHER_TAG, "tags": []}, "unknown keys 'tags'"),
])
def test_a_malformed_structural_tag_is_a_value_error_that_says_what_to_send(tag, words):
    with pytest.raises(ValueError, match=re.escape(words)) as raised:
        StructuredOutputsParams(structural_tag=tag)
    assert words == "not found in triggers" or STRUCTURAL_TAG_FORM in str(raised.value)
    with pytest.raises(ValueError, match=re.escape(words)):
        SamplingParams(structured_outputs={"structural_tag": tag})


def test_a_structural_tag_is_one_constraint_like_the_others(llm):
    with pytest.raises(ValueError, match="exactly one of .* got json, structural_tag"):
        StructuredOutputsParams(json=CITY, structural_tag=WEATHER_TAG)
    bad_schema = {**WEATHER_TAG, "structures": [{"begin": "<function=f>", "schema": {"type": "strin"}, "end": ""}]}
    with pytest.raises(ValueError, match="cannot compile the structural_tag constraint"):
        llm.engine.grammars.compile(StructuredOutputsParams(structural_tag=bad_schema))


# ---- through the server, with the official openai client ------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(llm):
    """A server with structured output and the Hermes tool call parser, on an engine built like `llm`'s (after
    it, so its executables are the ones `llm` compiled)."""
    options = dict(ENGINE)
    options.pop("show_progress")
    engine = LLMEngine(EngineConfig.for_model(None, **options), show_progress=False)
    with running_server(build_app(engine, ServerConfig(api_key=KEY, tool_call_parser="hermes"))) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)


def _streamed_chat(client, **kwargs) -> tuple[str, list[dict], str]:
    """(content, tool calls as {name, arguments}, finish reason) of a streamed chat, its deltas added up."""
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(model="tiny-stdlib-llama", stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.index == len(calls):
                    calls.append({"name": call.function.name, "arguments": ""})
                calls[call.index]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def _chat(client, stream: bool, **kwargs) -> tuple[str | None, list[dict], str]:
    """(content, tool calls as {name, arguments}, finish reason) of a chat, streamed or not."""
    if stream:
        return _streamed_chat(client, **kwargs)
    choice = client.chat.completions.create(model="tiny-stdlib-llama", **kwargs).choices[0]
    assert all(call.id.startswith("call_") and call.type == "function" for call in choice.message.tool_calls or [])
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


def _check(text: str, constraint: dict) -> None:
    """`text` meets a constraint given as StructuredOutputsParams fields."""
    if "json" in constraint:
        jsonschema.validate(json.loads(text), constraint["json"])
    elif "regex" in constraint:
        assert re.fullmatch(constraint["regex"], text), text
    else:
        assert text in constraint["choice"], text


def test_completions_with_vllm_fields_meet_their_constraints(client, server):
    """extra_body's guided_json (every schema), guided_regex, guided_choice and structured_outputs, sampled, in
    flight together; one of them streamed; one with a guided_whitespace_pattern."""
    cases = [("guided_json", schema, {"json": schema}) for schema in SCHEMAS]
    cases += [("guided_regex", REGEX, {"regex": REGEX}), ("guided_choice", CHOICES, {"choice": CHOICES}),
              ("structured_outputs", {"regex": REGEX}, {"regex": REGEX})]

    def complete(case):
        field, value, _ = case
        return client.completions.create(model="tiny-stdlib-llama", prompt=PROMPT, max_tokens=160, temperature=1.0,
                                         seed=7, extra_body={field: value})

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(complete, cases))
    for (_, _, constraint), answer in zip(cases, answers):
        assert answer.choices[0].finish_reason == "stop", answer.choices[0].text
        _check(answer.choices[0].text, constraint)
    streamed = client.completions.create(model="tiny-stdlib-llama", prompt=PROMPT, max_tokens=160, temperature=0,
                                         stream=True, extra_body={"guided_json": SCHEMAS[3]})
    jsonschema.validate(json.loads("".join(chunk.choices[0].text for chunk in streamed)), SCHEMAS[3])
    pretty = client.completions.create(model="tiny-stdlib-llama", prompt=PROMPT, max_tokens=300, temperature=0,
                                       extra_body={"guided_json": SCHEMAS[3], "guided_whitespace_pattern": r"\n {0,2}"})
    assert pretty.choices[0].finish_reason == "stop", pretty.choices[0].text
    jsonschema.validate(json.loads(pretty.choices[0].text), SCHEMAS[3])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_response_format_gives_json_of_the_schema(client, stream):
    for schema in (SCHEMAS[0], SCHEMAS[4]):
        response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
        kwargs = dict(messages=MESSAGES, max_tokens=160, temperature=0, response_format=response_format)
        if stream:
            text = _streamed_chat(client, **kwargs)[0]
        else:
            text = client.chat.completions.create(model="tiny-stdlib-llama", **kwargs).choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
    answers = [_chat(client, stream, messages=MESSAGES, max_tokens=160, temperature=1.0, seed=seed,
                     response_format={"type": "json_object"}) for seed in range(4)]
    _check_json_objects([(content, finish) for content, _, finish in answers])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required_calls_tools_with_valid_arguments(client, stream):
    content, calls, finish = _chat(client, stream, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                   max_tokens=200, temperature=1.0, seed=3)
    assert not content and calls and finish == "tool_calls"
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_choice_calls_that_function(client, stream):
    content, calls, finish = _chat(client, stream, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0,
                                   tool_choice={"type": "function", "function": {"name": "add"}})
    assert not content and [call["name"] for call in calls] == ["add"] and finish == "stop"  # a named call keeps "stop"
    jsonschema.validate(json.loads(calls[0]["arguments"]), TOOLS[1]["function"]["parameters"])


HERMES_CALL = (r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", '
               r'"unit": "celsius"\}\}</tool_call>')


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_reads_hermes_tool_calls_from_the_text(client, stream):
    """The model is made to write a Hermes block (a regex on its output): "auto" finds the call in the text."""
    content, calls, finish = _chat(client, stream, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=1.0,
                                   seed=5, extra_body={"guided_regex": "Sure[.] " + HERMES_CALL})
    assert content == "Sure. " and finish == "tool_calls"
    assert [call["name"] for call in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), TOOLS[0]["function"]["parameters"])
    # left alone, the model writes no call: its reply is all content
    free = client.chat.completions.create(model="tiny-stdlib-llama", messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                         temperature=0).choices[0]
    assert free.message.content and not free.message.tool_calls and free.finish_reason == "length"


def test_the_chat_template_renders_the_tools(server):
    url, engine = server
    answer = http_client.post(f"{url}/tokenize", json={"messages": MESSAGES, "tools": TOOLS}).json()
    text = engine.tokenizer.decode(answer["tokens"])
    assert '"name": "get_weather"' in text and '"name": "add"' in text


@pytest.mark.parametrize("body,param,words", [
    ({"guided_regex": "(unclosed"}, "guided_regex", "cannot compile the regex constraint"),
    ({"guided_json": {"type": "strin"}}, "guided_json", "cannot compile the json constraint"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "response_format", "cannot compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "at most one output constraint"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "for JSON constraints"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "the request has none"),
    ({"structured_outputs": {"regex": "a", "colour": "red"}}, "structured_outputs", "colour"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "at most one"),
    ({"structural_tag": "{not json"}, "structural_tag", "not valid JSON"),
    ({"structural_tag": json.dumps({**WEATHER_TAG, "triggers": ["<tool"]})}, "structural_tag", "not found in triggers"),
    ({"structured_outputs": {"structural_tag": json.dumps({**WEATHER_TAG, "structures": []})}}, "structured_outputs",
     "structures must be a non-empty list"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "triggered_tags"}}}, "response_format",
     "xgrammar's"),
    ({"response_format": {**WEATHER_TAG, "structures": [{"begin": "<function=f>", "end": ""}]}}, "response_format",
     "needs a schema"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<function="]}}, "response_format",
     "structures must be a non-empty list"),
    ({"structural_tag": json.dumps({**WEATHER_TAG, "structures": [{"begin": "<f>", "schema": {"type": "strin"},
                                                                   "end": ""}], "triggers": ["<f"]})},
     "structural_tag", "cannot compile the structural_tag constraint"),
    ({"guided_json": CITY, "structural_tag": json.dumps(WEATHER_TAG)}, "structural_tag", "at most one"),
    ({"response_format": WEATHER_TAG, "structured_outputs": {"regex": "a"}}, "response_format", "at most one"),
])
def test_a_bad_constraint_is_a_400_naming_its_field_and_queues_nothing(client, server, body, param, words):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="tiny-stdlib-llama", messages=MESSAGES, max_tokens=4, extra_body=body)
    error = raised.value.body
    assert error["param"] == param and words in error["message"], error
    stats = server[1].stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["num_requests_waiting"] == 0


def test_a_bad_structural_tag_on_completions_is_a_400_naming_its_field(client):
    for body, param in (({"structural_tag": "[]"}, "structural_tag"),
                        ({"response_format": {"type": "structural_tag", "format": {}}}, "response_format")):
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model="tiny-stdlib-llama", prompt=PROMPT, max_tokens=4, extra_body=body)
        assert raised.value.body["param"] == param and "structural_tag" in raised.value.body["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_structural_tags_through_the_server_enter_their_structures(client, stream):
    """vLLM's three spellings (the structural_tag extra and structured_outputs' key on completions, where the model
    writes code, full of "("; response_format on chat, sampled, with a trigger " "): each answer enters its
    structures, whose JSON validates against their schemas."""
    text = json.dumps(PAREN_TAG)
    answers = []
    for extra in ({"structural_tag": text}, {"structured_outputs": {"structural_tag": text}}):
        kwargs = dict(model="tiny-stdlib-llama", prompt=PROMPT, max_tokens=100, temperature=0, extra_body=extra)
        if stream:
            answers.append("".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)))
        else:
            answers.append(client.completions.create(**kwargs).choices[0].text)
    assert answers[0] == answers[1]
    word_tag = {"type": "structural_tag", "triggers": [" "],
                "structures": [{"begin": " city=", "schema": CITY, "end": ";"}]}
    chat = _chat(client, stream, messages=MESSAGES, max_tokens=100, temperature=1.0, seed=1,
                 response_format=word_tag)[0]
    for answer, tag in ((answers[0], PAREN_TAG), (chat, word_tag)):
        entered = _entered_structures(answer, tag)
        assert entered, answer
        schemas = {structure["begin"]: structure["schema"] for structure in tag["structures"]}
        for begin, value in entered:
            jsonschema.validate(value, schemas[begin])


def test_nothing_compiles_after_warm_up_with_constraints_in_the_batch(server, client):
    """Run after every request to `server` (the Qwen3-Coder server below comes after it: making an engine compiles
    its pool): every constrained request above ran on executables built at start-up."""
    stats = server[1].stats()
    assert stats["lazy_bucket_compilations"] == 0
    assert stats["compilations_after_warmup"] == 0


@pytest.fixture(scope="module")
def coder_client(llm):
    """A client of a server with the Qwen3-Coder tool call parser (an engine built like `llm`'s: its executables;
    after the check that nothing compiled, since making an engine compiles its pool)."""
    options = dict(ENGINE)
    options.pop("show_progress")
    engine = LLMEngine(EngineConfig.for_model(None, **options), show_progress=False)
    with running_server(build_app(engine, ServerConfig(api_key=KEY, tool_call_parser="qwen3_coder"))) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_reads_qwen3_coder_tool_calls_typed_by_the_tools_schema(coder_client, stream):
    """The model is made to write a Qwen3-Coder block: its parameter texts become the schema's types (add's a and b
    integers) in the call's JSON arguments."""
    block = (r"<tool_call>\n<function=add>\n<parameter=a>\n[1-9][0-9]?\n</parameter>\n"
             r"<parameter=b>\n-?[0-9]\n</parameter>\n</function>\n</tool_call>")
    content, calls, finish = _chat(coder_client, stream, messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                   temperature=1.0, seed=3, extra_body={"guided_regex": "Adding[.]\n" + block})
    assert content == "Adding.\n" and finish == "tool_calls" and [call["name"] for call in calls] == ["add"]
    arguments = json.loads(calls[0]["arguments"])
    assert sorted(arguments) == ["a", "b"] and all(isinstance(value, int) for value in arguments.values())
    jsonschema.validate(arguments, TOOLS[1]["function"]["parameters"])
