"""gpt-oss's harmony format: `reasoning_parser: openai_gptoss` and `tool_call_parser: openai`.

The parser alone: a reply's messages (headers in either form, text cut anywhere), the split into reasoning and
content, whole and streamed in any pieces (hypothesis), the prompt's open message, reasoning token counts, and a
constraint that waits for the final channel's header (several tokens in a row).

End to end, through the openai client against a real server: the bundled model writes no harmony, so the test
makes a tokenizer that has harmony's markers as special tokens (the bundled model's last seven token ids renamed)
and a harmony chat template, and the server constrains the whole reply (`structured_outputs_in_reasoning`): a
Lark grammar makes the model write an analysis message and then an answer, or a preamble and a tool call whose
arguments a JSON schema constrains. The replies come back split: reasoning, content, tool calls, finish reasons,
streamed or not, in /v1/chat/completions and /v1/responses; a named function's constrained call; what reaches the
template (`reasoning_effort`, an assistant's reasoning as `thinking`). A gpt-oss engine takes the parser by default.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from hypothesis import given, settings, strategies as st
from transformers import AutoTokenizer

from helpers import checkpoint, renamed_model, running_server, small_engine_args
from benchmarks import reply_parsing
from jaxserve.config import EngineConfig
from jaxserve.engine.harmony import MARKERS, HarmonyReasoning, parse_reply
from jaxserve.engine.llm_engine import LLMEngine, default_model_path
from jaxserve.server.app import build_app
from jaxserve.server.config import ServerConfig
from jaxserve.server.protocol import ChatMessage
from jaxserve.server.tools import HarmonyParser, ToolCall, ToolCallStream
from jaxserve.structured.constraint import ReplyConstraint, ThinkingSection
from jaxserve.structured.grammar import GrammarCompiler
from jaxserve.structured.params import StructuredOutputsParams

ENGINE = small_engine_args(max_model_len=256, num_pages=96, max_num_seqs=8, enable_structured_outputs=True)
# gpt-oss's template reads reasoning_effort and an assistant's thinking too
TEMPLATE = ("{% if reasoning_effort is defined %}<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>"
            "{% endif %}{% for m in messages %}{% if m.get('thinking') %}"
            "{% if m.get('tool_calls') and m.get('content') %}{{ raise_exception('Cannot pass both') }}{% endif %}"
            "<|start|>assistant<|channel|>analysis<|message|>{{ m['thinking'] }}<|end|>{% endif %}"
            "<|start|>{{ m['role'] }}<|message|>{{ m.get('content') or '' }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
IDS = {marker: 4095 - i for i, marker in enumerate(MARKERS)}  # the renamed tokens
PARSER = HarmonyReasoning(IDS, (IDS["<|channel|>"], 9, IDS["<|message|>"]), (IDS["<|channel|>"], 8, IDS["<|message|>"]))
CALL = ('<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}'
        "<|call|>")
REPLY = ("<|channel|>analysis<|message|>Two numbers.<|end|><|start|>assistant<|channel|>analysis<|message|>Add them."
         "<|end|><|start|>assistant<|channel|>commentary<|message|>Adding.<|end|>" + CALL)


# ---- the parser alone --------------------------------------------------------------------------------------------

def test_a_reply_reads_as_its_messages():
    first, second, preamble, call = parse_reply(REPLY, final=True)
    assert (first.channel, first.text, first.recipient, first.complete) == ("analysis", "Two numbers.", None, True)
    assert second.source == "<|start|>assistant<|channel|>analysis<|message|>Add them.<|end|>"
    assert (preamble.channel, preamble.text) == ("commentary", "Adding.")
    assert (call.channel, call.recipient, call.content_type, call.function) == ("commentary", "functions.add", "json",
                                                                                "add")
    assert call.source == CALL and call.text == '{"a": 1, "b": 2}'
    (before,) = parse_reply("<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}", final=True)
    assert (before.recipient, before.content_type, before.text) == ("functions.now", "json", "{}")
    bare, final = parse_reply("going on<|start|>assistant<|channel|>final<|message|>Done", final=True)
    assert (bare.channel, bare.text, final.channel, final.text) == (None, "going on", "final", "Done")


@pytest.mark.parametrize("text, final, expected", [
    ("<|channel|>analysis<|mess", False, []),  # a header in the making is held back
    ("<|channel|>final<|message|>x <|e", False, [("final", "x ", False)]),  # so is a marker in the making
    ("<|channel|>final<|message|>x <|e", True, [("final", "x <|e", True)]),
    ("<|channel|>analysis", True, [("analysis", "", True)]),  # cut in its header
    ("<|channel|>analysis<|message|>a<|channel|>final<|message|>b", False,
     [("analysis", "a", True), ("final", "b", False)]),  # a header ends the message before it
])
def test_text_that_may_still_become_a_marker_waits(text, final, expected):
    assert [(m.channel, m.text, m.complete) for m in parse_reply(text, final)] == expected


@pytest.mark.parametrize("text, thinking, reasoning, content", [
    (REPLY, False, "Two numbers.\nAdd them.", "Adding." + CALL),  # a call stays for the tool call parser
    ("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Yes.", False, "Hm.", "Yes."),
    ("<|channel|>analysis<|message|>cut sho", False, "cut sho", ""),
    ("thinking on<|end|><|start|>assistant<|channel|>final<|message|>Yes.", True, "thinking on", "Yes."),
    ("answering on", False, "", "answering on"),  # the prompt opened the final message (or no channel)
])
def test_a_whole_reply_splits_by_channel(text, thinking, reasoning, content):
    assert PARSER.split(text, thinking, final=True) == (reasoning, content)
    assert _channel_split(text, thinking, final=True) == (reasoning, content)


def _channel_split(text: str, thinking: bool, final: bool) -> tuple[str, str]:
    """The split's definition over `parse_reply`'s messages, read whole: analysis texts joined by new lines (and
    text before any header when the prompt opened an analysis message); calls as written, other texts the content."""
    reasoning, content = [], []
    for index, message in enumerate(parse_reply(text, final)):
        if message.recipient is not None:
            content.append(message.source)
        elif message.channel == "analysis" or (message.channel is None and index == 0 and thinking):
            reasoning.append(message.text)
        else:
            content.append(message.text)
    return "\n".join(reasoning), "".join(content)


def _cut(text: str, cuts: list[int]) -> list[tuple[str, bool]]:
    """`text` cut at `cuts`, as (piece, whether it is the last)."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [(text[start:end], end == len(text)) for start, end in zip(bounds, bounds[1:])]
    return pieces or [("", True)]


PIECES = ["<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.f", "json",
          "<|constrain|>", "<|message|>", "<|end|>", "<|call|>", "<|", "end|>", "x", " ", "{}"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=14), st.lists(st.integers(0, 120), max_size=8), st.booleans())
def test_streamed_deltas_add_up_to_the_whole_split(pieces, cuts, thinking):
    """However a reply is cut into deltas, the stream's reasoning and content so far are the split of the text so
    far read whole (held back alike), and the tool call parser's content and calls over that content add up to the
    whole reply's."""
    text = "".join(pieces)
    stream, calls, reasoning, content = PARSER.stream(thinking), ToolCallStream(HarmonyParser()), "", ""
    sent_calls, read, split = [], "", ""
    for piece, final in _cut(text, cuts):
        thought, said = stream.advance(piece, final)
        read, split = read + piece, split + said
        reasoning = reasoning + thought
        assert (reasoning, split) == _channel_split(read, thinking, final)
        delta = calls.advance(said, final)
        content = content + delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if call["index"] == len(sent_calls):
                sent_calls.append([call["function"]["name"], ""])
            sent_calls[call["index"]][1] += call["function"]["arguments"]
    assert (content, [ToolCall(*c) for c in sent_calls]) == HarmonyParser().extract(split, final=True)


def test_the_parsing_benchmark_streams_its_replies_alike():
    """benchmarks/reply_parsing.py at a small size: both harmony splits hand out the reply's reasoning and answer."""
    harmony, _ = reply_parsing.replies(40, seed=1)
    whole = reply_parsing.stream_reply(harmony, reply_parsing.Resplit(reply_parsing.HARMONY, False),
                                       ToolCallStream(HarmonyParser()))[1]
    streamed = reply_parsing.stream_reply(harmony, reply_parsing.HARMONY.stream(False),
                                          ToolCallStream(HarmonyParser()))[1]
    assert streamed == whole == ("".join(harmony[3:43]), "".join(harmony[49:]))


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    """The bundled model whose tokenizer calls its last seven token ids harmony's markers (special tokens)."""
    return renamed_model(tmp_path_factory.mktemp("harmony"), {i: marker for marker, i in IDS.items()}, True)


@pytest.fixture(scope="module")
def tokenizer(harmony_model):
    return AutoTokenizer.from_pretrained(harmony_model)


def test_the_prompt_says_which_message_the_reply_goes_on_with(tokenizer):
    parser = HarmonyReasoning.load(tokenizer)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    fresh = encode("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    history = encode("<|start|>assistant<|channel|>final<|message|>Hello<|end|><|start|>user<|message|>Hi<|end|>"
                     "<|start|>assistant")
    in_final = encode("<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Sure")
    in_analysis = encode("<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>analysis<|message|>So")
    assert parser.final_header == tuple(encode("<|channel|>final<|message|>"))
    for prompt, thinking, waits in ((fresh, False, True), (history, False, True), (in_final, False, False),
                                    (in_analysis, True, True)):
        assert parser.starts_thinking(prompt) is thinking
        assert parser.thinking_markers(prompt) == ((parser.final_header if waits else None), None)
    reply = encode("<|channel|>analysis<|message|>Hm hm<|end|><|start|>assistant<|channel|>final<|message|>Yes")
    assert parser.reasoning_tokens(fresh, reply) == reply.index(IDS["<|end|>"]) + 1
    cut = len(parser.analysis_header) + 2
    assert parser.reasoning_tokens(fresh, reply[:cut]) == cut  # cut in its thinking
    assert parser.reasoning_tokens(in_final, encode("Yes")) == 0


def test_a_constraint_waits_for_every_token_of_the_final_header(tokenizer):
    parser = HarmonyReasoning.load(tokenizer)
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    compiled = compiler.submit(StructuredOutputsParams(regex="[0-9]{2}"))
    compiled.result()
    (digit,) = tokenizer.encode("7", add_special_tokens=False)
    channel, final, message = parser.final_header
    def constraint() -> ReplyConstraint:
        thinking = ThinkingSection(parser.final_header, None, None, parser.budget_end, ())
        return ReplyConstraint(compiler.request_grammar(compiled), thinking)

    grammar = constraint()
    for token in (channel, digit, message, final, message, channel, final):  # the header broken, then begun again
        assert grammar.accept(token) and grammar.thinking is not None
    assert grammar.accept(message) and grammar.thinking is None  # from here on, two digits
    assert grammar.accept(digit) and grammar.accept(digit) and grammar.is_finished
    refusing = constraint()
    assert all(refusing.accept(token) for token in parser.final_header) and not refusing.accept(channel)


def test_gpt_oss_reads_harmony_unless_told_otherwise_or_its_tokenizer_lacks_the_markers(tmp_path):
    """As vLLM, a gpt-oss engine splits its replies as harmony without a reasoning_parser; a named parser wins, and
    a tokenizer without harmony's markers (the fixture's) gets none."""
    fixture = checkpoint("gpt-oss")
    vocabulary = len(AutoTokenizer.from_pretrained(fixture))
    markers = (*MARKERS, "<think>", "</think>")
    harmony = renamed_model(tmp_path, {vocabulary - 1 - i: marker for i, marker in enumerate(markers)}, True, fixture)
    options = small_engine_args(skip_precompile=True, max_num_seqs=4, num_pages=16)
    options.pop("show_progress")
    parsers = [LLMEngine(EngineConfig.for_model(model, **options, **named), show_progress=False).reasoning
               for model, named in ((harmony, {}), (harmony, {"reasoning_parser": "qwen3"}), (fixture, {}))]
    assert isinstance(parsers[0], HarmonyReasoning) and parsers[1].end == "</think>" and parsers[2] is None


def test_a_tokenizer_without_harmony_markers_and_a_tool_parser_without_its_reasoning_are_refused():
    with pytest.raises(ValueError, match="no token '<|start|>'"):
        HarmonyReasoning.load(AutoTokenizer.from_pretrained(default_model_path()))
    with pytest.raises(ValueError, match="--reasoning-parser openai_gptoss"):
        ServerConfig(tool_call_parser="openai").check_reasoning(None)


# ---- end to end --------------------------------------------------------------------------------------------------

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
ANSWER = ('start: <|channel|> "analysis" <|message|> "Two and two." <|end|> <|start|> "assistant" <|channel|> '
          '"final" <|message|> "Four."')
CALLING = ('start: <|channel|> "analysis" <|message|> "Use the tool." <|end|> <|start|> "assistant" <|channel|> '
           '"commentary" <|message|> "Adding." <|end|> <|start|> "assistant" <|channel|> "commentary to=functions.add '
           f'" <|constrain|> "json" <|message|> %json {json.dumps(ADD)}')


@pytest.fixture(scope="module")
def server(harmony_model):
    options = {k: v for k, v in ENGINE.items() if k != "show_progress"}
    engine = LLMEngine(EngineConfig.for_model(harmony_model, reasoning_parser="openai_gptoss",
                                              structured_outputs_in_reasoning=True, **options), show_progress=False)
    config = ServerConfig(chat_template=TEMPLATE, tool_call_parser="openai")
    with running_server(build_app(engine, config)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0)


def _chat(client, stream: bool, grammar: str, **kwargs) -> tuple[str | None, str | None, list, str]:
    """(reasoning, content, tool calls as (name, arguments), finish reason) of a chat reply that `grammar` spells,
    its deltas added up when streamed."""
    kwargs = {"model": "tiny-stdlib-llama", "messages": MESSAGES, "temperature": 0, "max_tokens": 80,
              "extra_body": {"guided_grammar": grammar}, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.reasoning, choice.message.content, calls, choice.finish_reason
    reasoning = content = finish = None
    calls = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            if getattr(delta, "reasoning", None):
                reasoning = (reasoning or "") + delta.reasoning
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or []:
                if call.index == len(calls):
                    calls.append((call.function.name, ""))
                calls[call.index] = (calls[call.index][0], calls[call.index][1] + (call.function.arguments or ""))
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_answer_comes_back_apart_from_its_analysis(client, stream):
    assert _chat(client, stream, ANSWER) == ("Two and two.", "Four.", [], "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_comes_back_as_a_call_after_its_preamble(client, stream):
    reasoning, content, calls, finish = _chat(client, stream, CALLING, tools=TOOLS)
    assert (reasoning, content, finish) == ("Use the tool.", "Adding.", "tool_calls")
    ((name, arguments),) = calls
    assert name == "add"
    jsonschema.validate(json.loads(arguments), ADD)


def test_a_response_holds_the_analysis_as_a_reasoning_item(client):
    """/v1/responses: a reasoning item, then the message; reasoning_tokens counts through the analysis' end."""
    chat = client.chat.completions.create(model="tiny-stdlib-llama", messages=MESSAGES, temperature=0, max_tokens=80,
                                          extra_body={"guided_grammar": ANSWER, "return_token_ids": True})
    tokens = chat.choices[0].token_ids
    response = client.responses.create(model="tiny-stdlib-llama", input=MESSAGES, temperature=0,
                                       max_output_tokens=80, extra_body={"guided_grammar": ANSWER})
    reasoning, message = response.output
    assert [part.text for part in reasoning.content] == ["Two and two."] and response.output_text == "Four."
    assert response.usage.output_tokens_details.reasoning_tokens == tokens.index(IDS["<|end|>"]) + 1


def test_a_named_function_is_called_with_its_constrained_arguments(client):
    """(The server constrains the whole reply, so the named function's schema shapes it from the first token.)"""
    choice = client.chat.completions.create(model="tiny-stdlib-llama", messages=MESSAGES, temperature=0,
                                            max_tokens=80, tools=TOOLS,
                                            tool_choice={"type": "function", "function": {"name": "add"}}).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), ADD)


def test_an_assistants_reasoning_reaches_the_template_as_its_thinking(client, tokenizer):
    """The reasoning a client gives back with a tool call (vLLM's `reasoning`, or `reasoning_content`) is the
    `thinking` gpt-oss's template writes before the call; a preamble given back beside it is left out, since that
    template refuses a tool call's message with both (as this test's template does)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}

    def prompt(assistant: dict) -> str:
        history = [*MESSAGES, {"role": "assistant", "tool_calls": [call], **assistant},
                   {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
        chat = client.chat.completions.create(model="tiny-stdlib-llama", messages=history, max_tokens=1, tools=TOOLS,
                                              extra_body={"return_token_ids": True})
        return tokenizer.decode(chat.prompt_token_ids, skip_special_tokens=False)

    analysis = ("<|start|>assistant<|channel|>analysis<|message|>Use the tool.<|end|>"
                "<|start|>assistant<|message|><|end|>")
    assert analysis in prompt({"content": None, "reasoning": "Use the tool."})
    assert analysis in prompt({"reasoning_content": "Use the tool."})
    assert analysis in prompt({"content": "Adding.", "reasoning": "Use the tool."})
    assert "<|message|>Adding.<|end|>" in prompt({"content": "Adding."})  # no reasoning: the content as it is


def test_messages_reach_templates_as_vllm_gives_them():
    assistant = ChatMessage(role="assistant", content="Hi", reasoning_content="Hm.")
    assert assistant.for_template() == {"role": "assistant", "content": "Hi", "reasoning": "Hm.",
                                        "reasoning_content": "Hm."}
    assert ChatMessage(role="user", content="Hi").for_template() == {"role": "user", "content": "Hi"}
    with_call = {"role": "assistant", "content": "Adding.", "reasoning": "Hm.", "tool_calls": [{}]}
    assert PARSER.template_message(with_call) == {"role": "assistant", "reasoning": "Hm.", "tool_calls": [{}],
                                                  "thinking": "Hm."}
    assert PARSER.template_message({"role": "assistant", "content": "Yes."}) == {"role": "assistant",
                                                                                 "content": "Yes."}
    assert "thinking" not in PARSER.template_message({"role": "user", "content": "x", "reasoning": "y"})


def test_a_thinking_budget_forces_the_final_message(client, server):
    """gpt-oss under thinking_token_budget: after that many tokens the final channel's message is forced from where
    the reply stands (here the bundled model's free text after `<|start|>assistant`, a header, closed empty), then
    the model answers on; a budget of 0 opens the final message at once, so the whole reply is content. A budget
    beside a grammar that spells out the whole reply (structured_outputs_in_reasoning) is a 400."""
    engine, parser = server[1], server[1].reasoning

    def complete(ids: list[int], max_tokens: int, **extra) -> list[int]:
        return client.completions.create(model="tiny-stdlib-llama", prompt=ids, max_tokens=max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True, **extra}
                                         ).choices[0].token_ids

    chat = client.chat.completions.create(model="tiny-stdlib-llama", messages=MESSAGES, max_tokens=1,
                                          extra_body={"return_token_ids": True})
    prompt, free = chat.prompt_token_ids, complete(chat.prompt_token_ids, 4)
    forced = [*free, *parser.budget_end(tuple(prompt[-8:] + free))]
    assert forced[4:] == [IDS["<|message|>"], IDS["<|end|>"], IDS["<|start|>"], *engine.tokenizer.encode(
        "assistant", add_special_tokens=False), *parser.final_header]
    assert complete(prompt, 24, thinking_token_budget=4) == forced + complete(prompt + forced, 24 - len(forced))
    answer = client.completions.create(model="tiny-stdlib-llama", prompt=prompt + list(parser.final_header),
                                       max_tokens=10, temperature=0).choices[0].text
    message = client.chat.completions.create(model="tiny-stdlib-llama", messages=MESSAGES, temperature=0,
                                             max_tokens=10 + len(parser.final_header),
                                             extra_body={"thinking_token_budget": 0}).choices[0].message
    assert (message.reasoning, message.content) == (None, answer)
    with pytest.raises(openai.BadRequestError, match="structured_outputs_in_reasoning"):
        _chat(client, False, ANSWER, extra_body={"guided_grammar": ANSWER, "thinking_token_budget": 8})


def test_every_page_comes_back(server):
    stats = server[1].stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_reasoning_effort_reaches_the_chat_template(client, tokenizer):
    """OpenAI's `reasoning_effort` goes to the template as `reasoning_effort` (gpt-oss's writes it into its system
    message); `chat_template_kwargs` naming it win."""
    def prompt(kwargs: dict | None = None, **fields) -> str:
        chat = client.chat.completions.create(model="tiny-stdlib-llama", messages=MESSAGES, max_tokens=1,
                                              extra_body={"return_token_ids": True, "chat_template_kwargs": kwargs},
                                              **fields)
        return tokenizer.decode(chat.prompt_token_ids, skip_special_tokens=False)

    assert prompt(reasoning_effort="high").startswith("<|start|>system<|message|>Reasoning: high<|end|>")
    assert "Reasoning" not in prompt()
    assert "Reasoning: low" in prompt({"reasoning_effort": "low"}, reasoning_effort="high")
