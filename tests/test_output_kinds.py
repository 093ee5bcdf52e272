"""SamplingParams.output_kind (vLLM's RequestOutputKind): CUMULATIVE outputs hold everything so far, DELTA outputs
only what is new (text that could begin an excluded stop string held back), FINAL_ONLY one output at the end. The
OutputProcessor is driven here as the engine drives it (tokens appended to the engine requests, then `process`);
then a reader's stream joining the deltas it missed, and one that builds its output when read (the engine-core
process's front end); then the same on a real engine, and `LLM.generate`."""

import asyncio
import copy
import dataclasses
import threading
from unittest import mock

import pytest
from helpers import checkpoint, expected, small_engine_args

from jaxserve import LLM, SamplingParams
from jaxserve.engine.async_engine import AsyncLLMEngine, RequestStream
from jaxserve.engine.llm_engine import default_model_path
from jaxserve.engine.output_processor import OutputProcessor, RequestState
from jaxserve.request import Logprob, Request, RequestStatus
from jaxserve.sampling_params import RequestOutputKind
from jaxserve.tokenizer import load_tokenizer

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def tokens(tokenizer):
    return tokenizer.encode(TEXT, add_special_tokens=False)


PROMPT_LOGPROBS = [None, {2: Logprob(-1.5, 1)}, {3: Logprob(-0.5, 1)}]  # of the prompt [1, 2, 3]


def _request(tokenizer, samples: list[list[int]], kind, **options) -> tuple[OutputProcessor, list[Request]]:
    """An OutputProcessor tracking one user request "r" whose sample i will be given `samples[i]`; its children.
    With `prompt_logprobs` the first sample has scored its prompt (PROMPT_LOGPROBS)."""
    options.setdefault("n", len(samples))
    params = SamplingParams(max_tokens=max(map(len, samples)), output_kind=kind, **options)
    children = [Request(f"r-{i}", [1, 2, 3], params.engine_params(), eos_token_ids=(), seed=i,
                        max_tokens=len(tokens)) for i, tokens in enumerate(samples)]
    if params.prompt_logprobs is not None:
        children[0].prompt_logprobs = list(PROMPT_LOGPROBS)
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, children)
    return processor, children


def _step(children: list[Request], samples: list[list[int]], step: int) -> list[Request]:
    """Give each running sample its token of `step`, as the engine would (a sample whose list ends finishes, length
    capped); the samples that moved."""
    moved = [child for child, tokens in zip(children, samples) if not child.is_finished and step < len(tokens)]
    for child in moved:
        token = samples[int(child.request_id[2:])][step]
        child.output_token_ids.append(token)
        child.output_logprobs.append({token: Logprob(-0.25 * (step % 3 + 1) - int(child.request_id[2:]))})
        if len(child.output_token_ids) == child.max_tokens:
            child.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return moved


def _end_samples(children: list[Request], to_finish: list[tuple[str, RequestStatus]]) -> None:
    """A stop string: the engine ends the sample."""
    for child_id, status in to_finish:
        next(child for child in children if child.request_id == child_id).status = status


def _run(tokenizer, samples: list[list[int]], kind, abort_after: int | None = None, **options):
    """Drive an OutputProcessor over one user request whose sample i is given `samples[i]`, a token a step, as the
    engine would; returns the outputs of every step, and with `abort_after` aborts the request after that many
    steps (its final output last)."""
    processor, children = _request(tokenizer, samples, kind, **options)
    outputs = []
    for step in range(max(map(len, samples))):
        if step == abort_after:
            return outputs + [processor.abort("r")]
        step_outputs, to_finish = processor.process(_step(children, samples, step))
        _end_samples(children, to_finish)
        outputs += step_outputs
    assert not processor.has_request("r")
    return outputs


async def _read_when_read(tokenizer, samples: list[list[int]], kind, read_after: set[int], whole: bool = False,
                          **options) -> tuple[list, list[bool], int]:
    """Drive the same request as the engine-core process's front end does: `advance` a step, hand a running request
    to its stream (`moved`) and a finished one's final output (`put`); a reader reads after the steps in
    `read_after` and at the end. Returns (what it read, whether the reader was woken after each step, how many
    outputs were built)."""
    processor, children = _request(tokenizer, samples, kind, **options)
    stream, received, woken = RequestStream("r", lambda stream: None, kind is DELTA, whole), [], []
    with mock.patch.object(RequestState, "output", autospec=True, side_effect=RequestState.output) as built:
        for step in range(max(map(len, samples))):
            states, to_finish = processor.advance(_step(children, samples, step))
            _end_samples(children, to_finish)
            for state in states:
                if state.finished:
                    stream.put(processor.output_of(state))
                else:
                    stream.moved(state)
            woken.append(stream._ready.is_set())
            if step in read_after:
                received.append(await asyncio.wait_for(stream.__anext__(), timeout=5))
        received.append(await asyncio.wait_for(stream.__anext__(), timeout=5))
    assert not processor.has_request("r") and stream.finished
    return received, woken, built.call_count


def _joined(deltas) -> dict[int, dict]:
    """Each sample's deltas joined: index -> its fields as one output would hold them."""
    joined = {}
    for output in deltas:
        for completion in output.outputs:
            sample = joined.setdefault(completion.index, {"text": "", "token_ids": [], "logprobs": []})
            sample["text"] += completion.text
            sample["token_ids"] += completion.token_ids
            sample["logprobs"] += completion.logprobs or []
            sample.update(cumulative_logprob=completion.cumulative_logprob, finish_reason=completion.finish_reason,
                          stop_reason=completion.stop_reason)
    return joined


def _fields(completion) -> dict:
    fields = {field.name: getattr(completion, field.name) for field in dataclasses.fields(completion)}
    fields.pop("index")
    fields["logprobs"] = fields["logprobs"] or []
    return fields


@pytest.mark.parametrize("options", [{}, {"logprobs": 1}, {"stop": ["fibonacci(n - 1)"]},
                                     {"stop": ["fibonacci(n - 1)"], "include_stop_str_in_output": True}],
                         ids=["plain", "logprobs", "stop", "stop-included"])
def test_deltas_add_up_to_the_cumulative_output_and_final_only_is_its_last(tokenizer, tokens, options):
    cumulative = _run(tokenizer, [tokens], CUMULATIVE, **options)
    deltas = _run(tokenizer, [tokens], DELTA, **options)
    (final,) = _run(tokenizer, [tokens], FINAL_ONLY, **options)
    last = cumulative[-1]
    assert last.finished and final.finished and deltas[-1].finished
    assert not any(output.finished for output in cumulative[:-1] + deltas[:-1])
    assert final.outputs == last.outputs
    assert _joined(deltas) == {0: _fields(last.outputs[0])}
    if "stop" in options:  # it stopped early
        assert last.outputs[0].finish_reason == "stop" and len(last.outputs[0].token_ids) < len(tokens)
    # A delta's text is never taken back: what had been shown at each step begins the final text (the cumulative
    # outputs do show text that a stop string cuts later; a server holds it back itself).
    shown = ""
    for output in deltas:
        shown += "".join(completion.text for completion in output.outputs)
        assert last.outputs[0].text.startswith(shown)
    if options.get("stop") and not options.get("include_stop_str_in_output"):
        assert any(not last.outputs[0].text.startswith(output.outputs[0].text) for output in cumulative)


def test_the_prompts_logprobs_come_in_every_cumulative_output_and_the_first_delta_alone(tokenizer, tokens):
    cumulative = _run(tokenizer, [tokens[:6]], CUMULATIVE, prompt_logprobs=1)
    deltas = _run(tokenizer, [tokens[:6]], DELTA, prompt_logprobs=1)
    (final,) = _run(tokenizer, [tokens[:6]], FINAL_ONLY, prompt_logprobs=1)
    assert all(output.prompt_logprobs == PROMPT_LOGPROBS for output in cumulative + [final])
    assert deltas[0].prompt_logprobs == PROMPT_LOGPROBS and all(o.prompt_logprobs is None for o in deltas[1:])


def test_cumulative_outputs_never_change_once_handed_out(tokenizer, tokens):
    received = []
    for output in _run(tokenizer, [tokens, tokens[3:]], CUMULATIVE, logprobs=0):
        received.append((output, copy.deepcopy(output)))
    for output, snapshot in received:
        assert output == snapshot


def test_delta_outputs_hold_only_the_samples_that_moved(tokenizer, tokens):
    samples = [tokens, tokens[5:12]]  # the second finishes after 7 tokens
    cumulative = _run(tokenizer, samples, CUMULATIVE)
    deltas = _run(tokenizer, samples, DELTA)
    assert [c.index for c in deltas[6].outputs] == [0, 1] and deltas[6].outputs[1].finish_reason == "length"
    assert all([c.index for c in output.outputs] == [0] for output in deltas[7:])
    assert _joined(deltas) == {i: _fields(completion) for i, completion in enumerate(cumulative[-1].outputs)}


def test_best_of_shows_one_ranked_output_whatever_the_kind(tokenizer, tokens):
    samples = [tokens[:8], tokens[2:10], tokens[4:12]]  # cumulative logprobs: sample 0 highest, 2 lowest
    results = {kind: _run(tokenizer, samples, kind, n=1, best_of=3) for kind in RequestOutputKind}
    for kind, outputs in results.items():
        assert len(outputs) == 1 and outputs[0].finished, kind
        assert [c.token_ids for c in outputs[0].outputs] == [tokens[:8]]
    assert results[DELTA][0].outputs == results[CUMULATIVE][0].outputs == results[FINAL_ONLY][0].outputs


def test_an_abort_ends_every_kind_with_what_was_not_yet_shown(tokenizer, tokens):
    cumulative = _run(tokenizer, [tokens], CUMULATIVE, abort_after=9, stop=["fibonacci(n - 2)"])
    deltas = _run(tokenizer, [tokens], DELTA, abort_after=9, stop=["fibonacci(n - 2)"])
    final = _run(tokenizer, [tokens], FINAL_ONLY, abort_after=9, stop=["fibonacci(n - 2)"])
    assert cumulative[-1].outputs[0].finish_reason == deltas[-1].outputs[0].finish_reason == "abort"
    assert len(final) == 1 and final[0].outputs == cumulative[-1].outputs
    assert _joined(deltas) == {0: _fields(cumulative[-1].outputs[0])}
    assert deltas[-1].outputs[0].text  # the held-back tail comes with the abort


def test_a_stream_of_deltas_joins_what_its_reader_missed(tokenizer, tokens):
    deltas = _run(tokenizer, [tokens], DELTA, logprobs=0)  # a token each
    assert len(deltas) > 13

    async def read() -> tuple[list, list[bool]]:
        stream, received, woken = RequestStream("r", lambda stream: None, deltas=True), [], []
        for index, output in enumerate(deltas):
            stream.put(output, stream_interval=4)
            woken.append(stream._ready.is_set())
            if index in (5, 8, len(deltas) - 1):  # the reader reads now and then
                received.append(await asyncio.wait_for(stream.__anext__(), timeout=5))
        return received, woken

    received, woken = asyncio.run(read())
    assert [output.finished for output in received] == [False, False, True]
    # woken by the first output, then once 4 more tokens have come than when it was last woken (at 5 tokens)
    assert woken[:6] == [True] * 6 and woken[6:9] == [False, False, True] and woken[9:12] == [False] * 3
    assert [output.outputs[0].token_ids for output in received[:2]] == [tokens[:6], tokens[6:9]]
    assert _joined(received) == _joined(deltas)


def test_a_cumulative_stream_hands_its_reader_the_latest_output(tokenizer, tokens):
    outputs = _run(tokenizer, [tokens], CUMULATIVE)

    async def read():
        stream = RequestStream("r", lambda stream: None)
        for output in outputs[:5]:
            stream.put(output)
        return await asyncio.wait_for(stream.__anext__(), timeout=5)

    assert asyncio.run(read()) is outputs[4]


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA], ids=["cumulative", "delta"])
def test_a_stream_that_builds_its_output_when_read_gives_what_each_step_would_have(tokenizer, tokens, kind):
    samples, options = [tokens, tokens[5:12]], {"logprobs": 0, "stop": ["fibonacci(n - 1)"]}
    every_step = _run(tokenizer, samples, kind, **options)
    received, woken, built = asyncio.run(_read_when_read(tokenizer, samples, kind, {5, 8}, **options))
    assert len(every_step) > 13 and len(received) == 3 and received[-1].finished
    assert built == 3  # one output a read, not one a step
    assert all(woken)  # (stream interval 1: every step wakes the reader)
    if kind is CUMULATIVE:  # each read gets the latest output as the step's own would have been
        assert [(o.outputs, o.finished) for o in received] == [(o.outputs, o.finished)
                                                              for o in (every_step[5], every_step[8], every_step[-1])]
    else:  # each read gets every delta since the last joined, however the steps split them
        assert [c.token_ids for c in received[1].outputs] == [tokens[6:9], tokens[11:12]]
        assert _joined(received) == _joined(every_step)


def test_a_whole_reply_wakes_its_reader_for_the_final_output_alone(tokenizer, tokens):
    received, woken, built = asyncio.run(_read_when_read(tokenizer, [tokens], CUMULATIVE, set(), whole=True))
    assert woken == [False] * (len(tokens) - 1) + [True]
    assert built == 1 and received[0].outputs == _run(tokenizer, [tokens], CUMULATIVE)[-1].outputs


def test_a_failed_stream_drops_the_output_it_had_not_built(tokenizer, tokens):
    async def read():
        processor, children = _request(tokenizer, [tokens], CUMULATIVE)
        stream = RequestStream("r", lambda stream: None)
        ((state,), _) = processor.advance(_step(children, [tokens], 0))
        stream.moved(state)
        assert stream.started and stream._ready.is_set()
        stream.fail(ValueError("the core refused it"))
        with pytest.raises(ValueError, match="refused"):
            await asyncio.wait_for(stream.__anext__(), timeout=5)

    asyncio.run(read())


def test_an_output_takes_the_earliest_times_and_the_most_of_its_samples_counts(tokenizer, tokens):
    params = SamplingParams(n=2, max_tokens=4)
    children = [Request(f"r-{i}", [1, 2, 3], params, eos_token_ids=(), seed=i, max_tokens=4) for i in range(2)]
    for child, scheduled, first_token, preemptions, cached in zip(children, (2.0, 1.0), (3.0, 2.5), (1, 3), (16, 0)):
        child.first_scheduled_time, child.first_token_time = scheduled, first_token
        child.num_preemptions, child.num_cached_tokens = preemptions, cached
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, children)
    children[0].output_token_ids.append(tokens[0])  # only the first sample moved
    (output,), _ = processor.process(children[:1])
    assert (output.metrics.first_scheduled_time, output.metrics.first_token_time) == (1.0, 2.5)
    assert (output.metrics.num_preemptions, output.num_cached_tokens) == (3, 16)


# ---- a real engine ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    return LLM(checkpoint("llama"), **small_engine_args(skip_precompile=True))


def _stream(llm, prompt, params) -> list:
    engine = llm.engine
    engine.reset_prefix_cache()  # each run computes the same programs, so the same floats
    engine.add_request("kinds", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_an_engine_streams_each_kind_and_llm_generate_runs_final_only(llm):
    prompt = expected("llama")["prompts"][3]
    base = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, logprobs=1)
    cumulative = _stream(llm, prompt, base)
    deltas = _stream(llm, prompt, base.clone(output_kind=DELTA))
    final = _stream(llm, prompt, base.clone(output_kind=FINAL_ONLY))
    assert len(cumulative) >= 12 and len(final) == 1
    assert final[0].outputs == cumulative[-1].outputs
    assert _joined(deltas) == {i: _fields(c) for i, c in enumerate(cumulative[-1].outputs)}
    # LLM.generate reads only the final output: its requests run FINAL_ONLY, whatever the params say, and the
    # caller's params stay as they were
    for params in (base, base.clone(output_kind=DELTA)):
        kind = params.output_kind
        llm.engine.reset_prefix_cache()
        (result,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        assert result.outputs == cumulative[-1].outputs and params.output_kind is kind
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_an_async_engine_joins_the_deltas_its_reader_missed(llm):
    """A reader that reads only once the request has ended gets one output holding every delta joined."""
    prompt = expected("llama")["prompts"][2]
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=10, ignore_eos=True, logprobs=0)
    want = _stream(llm, prompt, params)[-1]
    llm.engine.reset_prefix_cache()
    ended = threading.Event()

    def on_outputs(outputs):  # the engine thread's every batch of outputs
        if any(output.finished for output in outputs):
            ended.set()

    async def read() -> list:
        engine = AsyncLLMEngine(llm.engine, on_outputs=on_outputs)
        engine.start()
        try:
            made = engine.make_requests("async-delta", prompt, params.clone(output_kind=DELTA))
            stream = engine.submit("async-delta", made)
            assert await asyncio.get_running_loop().run_in_executor(None, ended.wait, 60)
            await asyncio.sleep(0.1)  # the last outputs reach the stream on the event loop
            return [output async for output in stream]
        finally:
            await engine.stop()

    (received,) = asyncio.run(read())
    assert received.finished and _joined([received]) == {0: _fields(want.outputs[0])}
