"""Reasoning models (`reasoning_parser`): chat replies split into `reasoning` and `content`, and structured output
that constrains only the answer after the thinking.

The parser alone: whole replies, streamed replies cut anywhere (hypothesis), prompts that close the thinking,
tokenizers without the markers. A constrained request's grammar alone: free until the end marker, then enforced.

End to end, through the openai client against a real server: the bundled model thinks in no markers, so the test
makes one that does. A plain engine first gives the greedy reply of a chat; the test model is the bundled model
with that reply's k-th token renamed `</think>` (and a token neither uses renamed `<think>`) in its tokenizer,
so its greedy reply is the same tokens, and "thinks" for exactly k tokens. Its answers are checked against those
tokens: the reasoning is the text of the first k, the content the text after the marker, streamed or not; a JSON
schema constrains only the tokens after the marker; a prompt that closes the thinking makes the whole reply
content, constrained from the first token.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import openai
import pytest
from hypothesis import given, settings, strategies as st
from transformers import AutoTokenizer

from helpers import http_client, renamed_model, running_server, small_engine_args
from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine, default_model_path
from jaxserve.engine.reasoning import ReasoningParser
from jaxserve.server.app import build_app
from jaxserve.server.config import ServerConfig
from jaxserve.structured.constraint import ReplyConstraint, ThinkingSection
from jaxserve.structured.grammar import GrammarCompiler
from jaxserve.structured.params import StructuredOutputsParams

ENGINE = small_engine_args(max_model_len=256, num_pages=96, max_num_seqs=8, enable_structured_outputs=True)
MESSAGES = [{"role": "user", "content": "def fibonacci(n):"}]
CLOSED = MESSAGES + [{"role": "assistant", "content": "<think>\n</think>\n"}]  # the template's empty thinking
MAX_TOKENS = 24
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer"], "additionalProperties": False}
PARSER = ReasoningParser("<think>", "</think>", 7, 8)
OPENS_ITSELF = ReasoningParser("<think>", "</think>", 7, 8, opens_in_reply=True)  # Magistral's rule


# ---- the parser alone --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, thinking, reasoning, content", [
    ("abc</think>xyz", True, "abc", "xyz"),
    ("<think>abc</think>xyz", True, "abc", "xyz"),
    ("\n<think>abc</think>", True, "abc", ""),
    ("a</think>b</think>c", True, "a", "b</think>c"),
    ("cut short", True, "cut short", ""),
    ("abc</think>xyz", False, "", "abc</think>xyz"),
])
def test_a_whole_reply_splits_at_the_end_marker(text, thinking, reasoning, content):
    assert PARSER.split(text, thinking, final=True) == (reasoning, content)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", " ", "<", "/", "think", ">", "<think>", "</think>", "</thi", "nk>", "\n"]),
                max_size=12),
       st.lists(st.integers(0, 40), max_size=6), st.booleans())
def test_streamed_deltas_add_up_to_the_whole_split(pieces, cuts, thinking):
    """However a reply is cut into deltas, what the stream has handed out is the split of the text so far read
    whole, held back alike, up to the whole reply's split (for a model whose thinking opens in the prompt, and for
    one that opens it itself)."""
    text = "".join(pieces)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    for parser in (PARSER, OPENS_ITSELF):
        stream, reasoning, content = parser.stream(thinking), "", ""
        for start, end in zip(bounds, bounds[1:]):
            thought, said = stream.advance(text[start:end], final=end == len(text))
            reasoning, content = reasoning + thought, content + said
            assert (reasoning, content) == parser.split(text[:end], thinking, final=end == len(text))
        if len(bounds) == 1:
            reasoning, content = stream.advance("", final=True)
        assert (reasoning, content) == parser.split(text, thinking, final=True)


@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>abc</think>xyz", "abc", "xyz"),
    (" <think>abc", "abc", ""),
    ("answer</think>", "", "answer</think>"),  # no opening marker: no thinking
])
def test_a_model_that_opens_its_thinking_itself_answers_without_it(text, reasoning, content):
    assert OPENS_ITSELF.split(text, True, final=True) == (reasoning, content)
    assert OPENS_ITSELF.split("<thi", True, final=False) == ("", "")  # the opening marker in the making


@pytest.mark.parametrize("prompt, closed", [
    ([1, 2, 3], False), ([7, 1, 2], False), ([7, 1, 8, 2], True), ([8, 7, 1], False), ([8], True), ([], False),
])
def test_a_prompt_closes_the_thinking_when_its_last_marker_is_the_end(prompt, closed):
    assert PARSER.prompt_ends_reasoning(prompt) is closed


def test_a_tokenizer_without_the_markers_is_refused_before_the_engine_loads():
    with pytest.raises(ValueError, match="no token '<think>'"):
        ReasoningParser.load("deepseek_r1", AutoTokenizer.from_pretrained(default_model_path()))
    with pytest.raises(ValueError, match="no token '<think>'"):
        LLMEngine(EngineConfig.for_model(None, reasoning_parser="qwen3", **_engine_options()))
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        EngineConfig(reasoning_parser="granite")


def test_a_grammar_that_starts_after_a_token_is_free_until_that_token():
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    compiled = compiler.submit(StructuredOutputsParams(regex="[0-9]{2}"))
    compiled.result()
    (digit,) = tokenizer.encode("7", add_special_tokens=False)
    (word,) = tokenizer.encode("def", add_special_tokens=False)
    def constraint() -> ReplyConstraint:
        thinking = ThinkingSection((word,), None, None, lambda recent: (word,), ())
        return ReplyConstraint(compiler.request_grammar(compiled), thinking)

    grammar = constraint()
    assert grammar.accept(digit) and grammar.accept(digit) and not grammar.is_finished  # free: no grammar yet
    assert grammar.accept(word) and grammar.thinking is None  # from here on, two digits
    assert grammar.accept(digit) and not grammar.is_finished
    assert grammar.accept(digit) and grammar.is_finished
    constrained = constraint()
    assert constrained.accept(word) and not constrained.accept(word)


# ---- end to end --------------------------------------------------------------------------------------------------

def _engine_options() -> dict:
    return {k: v for k, v in ENGINE.items() if k != "show_progress"}


@pytest.fixture(scope="module")
def greedy():
    """(prompt ids, greedy reply ids) of MESSAGES from the bundled model, the index k of the token that becomes
    the end marker (the first of the reply's tokens, from the third on, that neither the prompt nor the reply has
    before it), and an id neither holds (the start marker)."""
    llm = LLM(None, **ENGINE)
    output = llm.chat(MESSAGES, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                      use_tqdm=False)[0]
    prompt, reply = output.prompt_token_ids, output.outputs[0].token_ids
    eos = llm.engine.tokenizer.eos_token_id
    del llm
    free = reply.index(eos) if eos in reply else len(reply)  # the reply before any EOS
    k = next(i for i in range(2, free - 4) if reply[i] not in reply[:i] and reply[i] not in prompt)
    start = next(t for t in range(4095, 100, -1) if t not in prompt and t not in reply)
    return prompt, reply, k, start


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory, greedy):
    """The bundled model whose tokenizer calls the reply's k-th token `</think>` and another `<think>`."""
    _, reply, k, start = greedy
    folder = renamed_model(tmp_path_factory.mktemp("thinking"), {start: "<think>", reply[k]: "</think>"}, False)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tokenizer.encode(rendered, add_special_tokens=False) == greedy[0], "the renaming changed the prompt's ids"
    return folder


@pytest.fixture(scope="module")
def server(thinking_model, greedy):
    engine = LLMEngine(EngineConfig.for_model(thinking_model, reasoning_parser="deepseek_r1", **_engine_options()),
                       show_progress=False)
    with running_server(build_app(engine, ServerConfig())) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def expected(server, greedy):
    """(reasoning, content) of the greedy reply: the text of the tokens before the end marker, and after it."""
    _, reply, k, _ = greedy
    tokenizer = server[1].tokenizer
    return tokenizer.decode(reply[:k]), tokenizer.decode(reply[k + 1:])


def _chat(client, stream: bool, **kwargs) -> tuple[str | None, str | None, str | None]:
    """(reasoning, reasoning_content, content) of a chat reply, its deltas added up when streamed."""
    kwargs = {"model": "tiny-stdlib-llama", "temperature": 0, **kwargs}
    if not stream:
        message = client.chat.completions.create(**kwargs).choices[0].message
        return message.reasoning, message.reasoning_content, message.content
    reasoning = legacy = content = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            if getattr(delta, "reasoning", None):
                assert content is None, "the thinking streamed after the answer began"
                reasoning = (reasoning or "") + delta.reasoning
                legacy = (legacy or "") + delta.reasoning_content
            if delta.content:
                content = (content or "") + delta.content
    return reasoning, legacy, content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_reply_splits_into_reasoning_and_content(client, expected, stream):
    reasoning, legacy, content = _chat(client, stream, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                       extra_body={"ignore_eos": True})
    assert expected[0] and expected[1]
    assert (reasoning, legacy, content) == (expected[0], expected[0], expected[1])
    hidden = client.chat.completions.create(model="tiny-stdlib-llama", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                            temperature=0, extra_body={"ignore_eos": True, "include_reasoning": False})
    assert hidden.choices[0].message.reasoning is None and hidden.choices[0].message.content == expected[1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_schema_constrains_only_the_answer_after_the_thinking(client, expected, stream):
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    reasoning, _, content = _chat(client, stream, messages=MESSAGES, max_tokens=MAX_TOKENS + 40,
                                  response_format=response_format)
    assert reasoning == expected[0]  # the thinking was the free greedy reply
    jsonschema.validate(json.loads(content), SCHEMA)


def test_a_prompt_that_closes_the_thinking_gets_a_constrained_answer_only(client, server):
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    message = client.chat.completions.create(
        model="tiny-stdlib-llama", messages=CLOSED, max_tokens=40, temperature=0, response_format=response_format,
        extra_body={"add_generation_prompt": False, "continue_final_message": True}).choices[0].message
    assert message.reasoning is None
    jsonschema.validate(json.loads(message.content), SCHEMA)


def test_a_named_tool_call_comes_from_the_answer(client):
    """(The tools change the prompt and so the reply: the prompt closes the thinking here.)"""
    tool = {"type": "function", "function": {"name": "answer", "parameters": SCHEMA}}
    choice = client.chat.completions.create(
        model="tiny-stdlib-llama", messages=CLOSED, max_tokens=40, temperature=0, tools=[tool],
        tool_choice={"type": "function", "function": {"name": "answer"}},
        extra_body={"add_generation_prompt": False, "continue_final_message": True}).choices[0]
    assert choice.message.reasoning is None and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "answer"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_response_holds_a_reasoning_item_then_the_message(client, expected, greedy, stream):
    """/v1/responses: the thinking is a reasoning item (its text in `content`), counted in reasoning_tokens with its
    end marker; the answer is the message after it."""
    kwargs = dict(model="tiny-stdlib-llama", input=MESSAGES, max_output_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        response = events[-1].response
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == expected[0]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected[1]
    else:
        response = client.responses.create(**kwargs)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and [part.text for part in reasoning.content] == [expected[0]]
    assert message.type == "message" and response.output_text == expected[1]
    assert response.usage.output_tokens_details.reasoning_tokens == greedy[2] + 1


def test_completions_keep_the_markers_and_constrain_after_them(server, greedy):
    """/v1/completions does not split the text (vLLM's rule), but its constraints also wait for the end marker;
    every page comes back afterwards."""
    url, engine = server
    prompt, reply, k, _ = greedy
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    def complete(seed: int):
        return client.completions.create(model="tiny-stdlib-llama", prompt=prompt, max_tokens=MAX_TOKENS + 8,
                                         temperature=0 if seed == 0 else 1.0, seed=seed,
                                         extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}", "return_token_ids": True})

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(complete, range(4)))
    greedy_choice = answers[0].choices[0]
    assert greedy_choice.token_ids[:k + 1] == reply[:k + 1]
    for answer in answers:
        text, finish = answer.choices[0].text, answer.choices[0].finish_reason
        if "</think>" in text:  # (a sampled reply may not close its thinking within max_tokens)
            answer_text = text.split("</think>", 1)[1]  # all of it, or what max_tokens left of it
            assert re.fullmatch("[0-9]{3}-[a-z]{2}" if finish == "stop" else "[0-9]{0,3}(-[a-z]{0,2})?",
                                answer_text), text
    assert "</think>" in greedy_choice.text
    stats = engine.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


# ---- thinking_token_budget ---------------------------------------------------------------------------------------

def _budgets(k: int) -> list[int]:
    """Budgets around the greedy reply's thinking of k tokens: forced at once, early, just before its own end, and
    never (k and more)."""
    return sorted({0, 1, 3, k - 1, k, k + 2})


def _with_budget(complete, prompt: list[int], reply: list[int], k: int, end: int, budget: int,
                 max_tokens: int) -> list[int]:
    """The greedy reply under `budget`: the reply itself when it ends its thinking within it, else its first `budget`
    tokens, the end marker, and the greedy continuation of those (`complete(prompt ids, max_tokens)`)."""
    if budget >= k:
        return reply[:max_tokens]
    forced = [*reply[:budget], end]
    return forced + complete(prompt + forced, max_tokens - len(forced))


def test_a_thinking_budget_forces_the_end_marker_after_that_many_tokens(server, greedy):
    """thinking_token_budget b (vLLM's field): the first b tokens as the model writes them, then `</think>` however
    likely, then the answer as the model goes on from there; a budget the thinking keeps changes nothing. Every
    page comes back."""
    url, engine = server
    prompt, reply, k, _ = greedy
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    def complete(ids: list[int], max_tokens: int, **extra) -> list[int]:
        return client.completions.create(model="tiny-stdlib-llama", prompt=ids, max_tokens=max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True, **extra}
                                         ).choices[0].token_ids

    end = engine.reasoning.end_token_id
    for budget in _budgets(k):
        want = _with_budget(complete, prompt, reply, k, end, budget, MAX_TOKENS)
        assert complete(prompt, MAX_TOKENS, thinking_token_budget=budget) == want, f"budget {budget}"
    assert complete(prompt, MAX_TOKENS, thinking_token_budget=-1) == reply[:MAX_TOKENS]  # vLLM's "no budget"
    stats = engine.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_chat_under_a_thinking_budget_reasons_that_long_then_answers(client, server, greedy, stream):
    """The forced end splits the reply like the model's own: the reasoning is the budget's tokens, the content what
    follows the marker; the Messages API's enabled thinking takes budget_tokens as the budget."""
    url, engine = server
    prompt, reply, k, _ = greedy
    budget, tokenizer = 2, engine.tokenizer
    forced = [*reply[:budget], engine.reasoning.end_token_id]
    answer = client.completions.create(model="tiny-stdlib-llama", prompt=prompt + forced,
                                       max_tokens=MAX_TOKENS - len(forced), temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    reasoning, _, content = _chat(client, stream, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                  extra_body={"ignore_eos": True, "thinking_token_budget": budget})
    assert (reasoning, content) == (tokenizer.decode(reply[:budget]), answer)
    if not stream:
        body = {"model": "tiny-stdlib-llama", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
                "thinking": {"type": "enabled", "budget_tokens": budget}}
        blocks = http_client.post(f"{url}/v1/messages", json=body, timeout=60).json()["content"]
        assert blocks[0]["type"] == "thinking" and blocks[0]["thinking"] == tokenizer.decode(reply[:budget])


@pytest.fixture(scope="module", params=["ngram", "async+multistep4"])
def budget_engine(request, thinking_model):
    """An offline engine over the thinking model that may sample several tokens of a row per step: speculation
    (n-gram proposals, a guess from any one token seen) or async scheduling with four steps per call."""
    options = {"ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_min": 1, "prompt_lookup_max": 2}},
               "async+multistep4": {"async_scheduling": True, "num_scheduler_steps": 4}}[request.param]
    llm = LLM(thinking_model, reasoning_parser="deepseek_r1", **{**ENGINE, **options})
    yield request.param, llm
    del llm


def test_a_thinking_budget_holds_when_a_step_samples_several_tokens(budget_engine, greedy, monkeypatch):
    """A row may verify proposals, or take several steps in a call, only while its next tokens are certainly free
    (before its budget runs out): the forced end lands at the same token as one step at a time, in one batch of
    every budget, and speculation and multi-step decoding do run on the free rows."""
    name, llm = budget_engine
    prompt, reply, k, _ = greedy
    end = llm.engine.reasoning.end_token_id
    greedy_params = dict(temperature=0, ignore_eos=True)

    def complete(ids: list[int], max_tokens: int) -> list[int]:
        output = llm.generate([ids], SamplingParams(max_tokens=max_tokens, **greedy_params), use_tqdm=False)[0]
        return list(output.outputs[0].token_ids)

    budgets = _budgets(k)
    want = [_with_budget(complete, prompt, reply, k, end, budget, MAX_TOKENS) for budget in budgets]
    scheduler, steps = llm.engine.core.scheduler, []

    def recorded(schedule=scheduler.schedule):
        steps.append(schedule())
        return steps[-1]

    monkeypatch.setattr(scheduler, "schedule", recorded)
    outputs = llm.generate([prompt] * len(budgets), [SamplingParams(max_tokens=MAX_TOKENS, thinking_token_budget=b,
                                                                    **greedy_params) for b in budgets],
                           use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == want
    several = [item for step in steps for item in step.scheduled if item.spec_token_ids or item.num_steps > 1]
    assert several, f"{name}: no row sampled several tokens in a step"
    stats = llm.engine.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


# ---- a model that opens its thinking itself, in special tokens (Magistral's [THINK] ... [/THINK]) ------------------

PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # no "<": the reply's first token is new
OPENING = [{"role": "user", "content": "import os"}]  # under it, the bundled model's greedy reply starts with "from"


@pytest.fixture(scope="module")
def magistral(tmp_path_factory):
    """(URL, engine, greedy reply ids, k) of a server with reasoning_parser mistral (and PLAIN_TEMPLATE) over the
    bundled model whose tokenizer calls the greedy reply's first token `[THINK]` and its k-th `[/THINK]`, both
    special tokens: its greedy reply to OPENING opens its thinking itself and closes it after k - 1 tokens."""
    llm = LLM(None, **{**ENGINE, "skip_precompile": True})
    output = llm.chat(OPENING, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                      use_tqdm=False, chat_template=PLAIN_TEMPLATE)[0]
    prompt, reply = output.prompt_token_ids, output.outputs[0].token_ids
    del llm
    assert reply[0] not in prompt, "the reply's first token must not be the prompt's"
    k = next(i for i in range(2, len(reply) - 4) if reply[i] not in reply[:i] and reply[i] not in prompt)
    folder = renamed_model(tmp_path_factory.mktemp("magistral"), {reply[0]: "[THINK]", reply[k]: "[/THINK]"}, True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rendered = tokenizer.apply_chat_template(OPENING, tokenize=False, add_generation_prompt=True,
                                             chat_template=PLAIN_TEMPLATE)
    assert tokenizer.encode(rendered, add_special_tokens=False) == prompt, "the renaming changed the prompt's ids"
    engine = LLMEngine(EngineConfig.for_model(folder, reasoning_parser="mistral",
                                              **{**_engine_options(), "skip_precompile": True}), show_progress=False)
    with running_server(build_app(engine, ServerConfig(chat_template=PLAIN_TEMPLATE))) as url:
        yield url, engine, reply, k


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_reply_that_opens_its_thinking_in_special_tokens_splits_at_them(magistral, stream):
    """The markers are special tokens, so the chat route keeps them in the text to split it; the thinking is the
    text between them, the answer the text after."""
    url, engine, reply, k = magistral
    assert engine.reasoning.keeps_special_tokens and engine.reasoning.opens_in_reply
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    reasoning, _, content = _chat(client, stream, messages=OPENING, max_tokens=MAX_TOKENS,
                                  extra_body={"ignore_eos": True})
    decode = lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    assert reasoning and content
    assert (reasoning, content) == (decode(reply[1:k]), decode(reply[k + 1:]))


def test_a_reply_that_does_not_open_its_thinking_is_all_answer_and_constrained_at_once(magistral):
    """With `[THINK]` banned the model answers at once: no reasoning, the whole reply is content; a schema then
    constrains it from its first token. Unbanned, the schema waits for the end of the thinking."""
    url, engine, reply, k = magistral
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    ban = {"logit_bias": {str(reply[0]): -100}}
    reasoning, _, content = _chat(client, False, messages=OPENING, max_tokens=8, extra_body={"ignore_eos": True},
                                  **ban)
    assert reasoning is None and content and not content.startswith("[THINK]")
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    for bias, thinks in (({}, True), (ban, False)):
        reasoning, _, content = _chat(client, False, messages=OPENING, max_tokens=MAX_TOKENS + 40,
                                      response_format=response_format, **bias)
        assert (reasoning is not None) == thinks, (reasoning, content)
        jsonschema.validate(json.loads(content), SCHEMA)
    stats = engine.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
