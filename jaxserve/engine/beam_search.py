"""Beam search as vLLM runs it: the engine scores one token per beam per step, the search is host code.

Each step every live beam runs through the engine as its own one-token request (prompt = the beam's
tokens) with `logprobs = 2 * beam_width`, temperature 0 by default: a beam's candidates are the tokens of
that logprob dict. Across the beams of one prompt the candidates are ranked by cumulative logprob; a
candidate that is an EOS token (unless `ignore_eos`) joins the finished beams, and the best
`beam_width` of the others are the next live beams. After `max_tokens` steps (or when no beam is
live), finished and live beams together are ranked by vLLM's length-penalised score
(`beam_search_score`) and the best `beam_width` are returned.

The engine needs nothing special for this: each step is ordinary requests. With prefix caching a
beam's tokens are found in the page cache, so a step computes little more than its last token.

`BeamSearch` is one prompt's search; `beam_step` (pure) turns live beams and their candidates into the
next live beams and the newly finished ones. Two drivers run searches in lock step, one engine batch
per step: `run_beam_search` (LLM.beam_search, through LLM.generate) and `run_beam_search_async` (the
server, through `AsyncLLMEngine` with `async_engine_step`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.request import Logprob
from jaxserve.sampling_params import FLOAT32_MAX, INT32_MAX, SamplingParams, check_float, check_int

if TYPE_CHECKING:
    from jaxserve.engine.async_engine import AsyncLLMEngine, RequestStream

StepPrompt = dict  # {"prompt_token_ids": [...], optional "cache_salt": str}: one beam's engine request


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search parameters, validated (ValueError naming the field).

    `beam_width` beams are kept and returned; each step asks the engine for the top `2 * beam_width`
    tokens of every beam, so `beam_width` is at most half of SamplingParams.MAX_LOGPROBS. Finished beams
    are ranked by cum_logprob / length ** `length_penalty` (length: all tokens, prompt included, but not
    the EOS that finished the beam). With `ignore_eos` EOS is an ordinary token. `temperature` is the
    step requests' (vLLM's field): above 0 each beam also gets its sampled token as a candidate.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    MAX_BEAM_WIDTH: ClassVar[int] = SamplingParams.MAX_LOGPROBS // 2

    def __post_init__(self):
        check_int("beam_width", self.beam_width, 1, self.MAX_BEAM_WIDTH)
        check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}.")
        check_float("temperature", self.temperature, 0.0, FLOAT32_MAX)
        check_float("length_penalty", self.length_penalty, -FLOAT32_MAX, FLOAT32_MAX)

    def step_params(self) -> SamplingParams:
        """What each beam's one-token request runs with: its candidates are the returned logprobs."""
        return SamplingParams(max_tokens=1, logprobs=2 * self.beam_width, temperature=self.temperature)


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam (vLLM's shape): its tokens (prompt + generated), for each generated token the candidates
    the engine returned for it, and the sum of its generated tokens' logprobs."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None  # the decoded tokens (prompt included, as vLLM; no special tokens), set on returned beams
    finish_reason: str | None = None  # 'stop' (ended on an EOS token) or 'length'; None while live
    stop_reason: int | None = None  # the EOS token id that ended it


@dataclasses.dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first (vLLM's shape, plus the prompt)."""

    sequences: list[BeamSearchSequence]
    prompt: str | None = None
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)


def beam_search_score(sequence: BeamSearchSequence, length_penalty: float) -> float:
    """vLLM's length-penalised score: cum_logprob / length ** length_penalty, where the length counts the
    prompt and the generated tokens but not the EOS token that finished the beam."""
    length = len(sequence.tokens) - (1 if sequence.finish_reason == "stop" else 0)
    return sequence.cum_logprob / length**length_penalty


def beam_step(
    beams: Sequence[BeamSearchSequence], candidates: Sequence[dict[int, Logprob]], beam_width: int,
    eos_token_ids: Sequence[int],
) -> tuple[list[BeamSearchSequence], list[BeamSearchSequence]]:
    """One step of the search: (next live beams, best first; beams that finished on EOS this step).

    `candidates[i]` are the next-token logprobs the engine returned for `beams[i]`. Every candidate
    that is in `eos_token_ids` finishes its beam; of the others the `beam_width` with the highest
    cumulative logprob live on (ties keep beam order, then the order of the logprob dict).
    """
    extended: list[tuple[float, int, int]] = []  # (cumulative logprob, beam index, token id)
    finished = []
    for index, (beam, entries) in enumerate(zip(beams, candidates)):
        for token_id, entry in entries.items():
            cum_logprob = beam.cum_logprob + entry.logprob
            if token_id in eos_token_ids:
                finished.append(_child(beam, entries, token_id, cum_logprob, finish_reason="stop"))
            else:
                extended.append((cum_logprob, index, token_id))
    extended.sort(key=lambda c: c[0], reverse=True)
    live = [_child(beams[i], candidates[i], token_id, cum) for cum, i, token_id in extended[:beam_width]]
    return live, finished


def _child(beam: BeamSearchSequence, entries: dict[int, Logprob], token_id: int, cum_logprob: float,
           finish_reason: str | None = None) -> BeamSearchSequence:
    """`beam` extended by `token_id`."""
    return BeamSearchSequence(
        tokens=beam.tokens + [token_id], logprobs=beam.logprobs + [entries], cum_logprob=cum_logprob,
        finish_reason=finish_reason, stop_reason=token_id if finish_reason == "stop" else None,
    )


class BeamSearch:
    """The search for one prompt: its live beams, its finished beams and the steps left.

    `max_model_len` bounds the steps, so no beam ever grows past what the engine accepts as a prompt.
    """

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: Sequence[int],
                 max_model_len: int, prompt: str | None = None, cache_salt: str | None = None):
        if len(prompt_token_ids) >= max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens but max_model_len is {max_model_len}")
        self.params = params
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.eos_token_ids = () if params.ignore_eos else tuple(eos_token_ids)
        self.cache_salt = cache_salt
        self.steps_left = min(params.max_tokens, max_model_len - len(prompt_token_ids))
        self.live = [BeamSearchSequence(tokens=list(prompt_token_ids), logprobs=[])]
        self.finished: list[BeamSearchSequence] = []

    @property
    def done(self) -> bool:
        """True once no step is left or no beam is live."""
        return self.steps_left == 0 or not self.live

    def step_prompts(self) -> list[StepPrompt]:
        """The engine request of each live beam this step, in beam order."""
        salt = {} if self.cache_salt is None else {"cache_salt": self.cache_salt}
        return [{"prompt_token_ids": beam.tokens, **salt} for beam in self.live]

    def advance(self, candidates: Sequence[dict[int, Logprob]]) -> None:
        """Take one step, given each live beam's candidates."""
        self.live, finished = beam_step(self.live, candidates, self.params.beam_width, self.eos_token_ids)
        self.finished += finished
        self.steps_left -= 1

    def output(self, tokenizer) -> BeamSearchOutput:
        """The best `beam_width` beams, finished and live together, by `beam_search_score`; each with its
        text (all its tokens decoded, prompt included as in vLLM, but without special tokens such as BOS) and a finish
        reason ('length' for a live beam)."""
        beams = self.finished + [dataclasses.replace(beam, finish_reason="length") for beam in self.live]
        beams.sort(key=lambda beam: beam_search_score(beam, self.params.length_penalty), reverse=True)
        best = beams[:self.params.beam_width]
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens, skip_special_tokens=True)
        return BeamSearchOutput(sequences=best, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids)


def step_candidates(output: RequestOutput) -> dict[int, Logprob]:
    """The next-token logprobs of one beam's step request; RuntimeError when the engine failed it."""
    sample = output.outputs[0] if output.outputs else None
    if output.error is not None or sample is None or not sample.logprobs:
        reason = output.error or (sample.finish_reason if sample else None) or "no logprobs"
        raise RuntimeError(f"the engine failed a beam search step: {reason}")
    return sample.logprobs[0]


def run_beam_search(searches: Sequence[BeamSearch],
                    step: Callable[[list[StepPrompt]], list[RequestOutput]]) -> None:
    """Run `searches` to the end in lock step; `step` runs one batch of beam requests and returns their
    outputs in order (LLM.beam_search passes LLM.generate)."""
    while active := [search for search in searches if not search.done]:
        _advance(active, step(_step_prompts(active)))


async def run_beam_search_async(searches: Sequence[BeamSearch],
                                step: Callable[[list[StepPrompt]], Awaitable[list[RequestOutput]]]) -> None:
    """`run_beam_search` with an async `step` (the server's, `async_engine_step`)."""
    while active := [search for search in searches if not search.done]:
        _advance(active, await step(_step_prompts(active)))


def _step_prompts(searches: Sequence[BeamSearch]) -> list[StepPrompt]:
    return [prompt for search in searches for prompt in search.step_prompts()]


def _advance(searches: Sequence[BeamSearch], outputs: list[RequestOutput]) -> None:
    """Hand each search the candidates of its own beams (outputs in `_step_prompts` order)."""
    candidates = iter([step_candidates(output) for output in outputs])
    for search in searches:
        search.advance(list(itertools.islice(candidates, len(search.live))))


def async_engine_step(engine: AsyncLLMEngine, request_id: str, params: BeamSearchParams, priority: int = 0,
                      ) -> Callable[[list[StepPrompt]], Awaitable[list[RequestOutput]]]:
    """A step for `run_beam_search_async` that submits each beam as a one-token request to `engine` and
    waits for all of them. Raises what `make_requests` / `check_capacity` raise (ValueError,
    EngineOverloadedError, EngineDeadError) and what a request's stream ends with; a cancelled step
    closes its streams, which aborts its requests."""
    step_params = params.step_params()
    steps = itertools.count()

    async def step(prompts: list[StepPrompt]) -> list[RequestOutput]:
        step_id = f"{request_id}-step{next(steps)}"
        made = [engine.make_requests(f"{step_id}-{i}", prompt["prompt_token_ids"], step_params, priority,
                                     prompt.get("cache_salt")) for i, prompt in enumerate(prompts)]
        engine.check_capacity(len(made))
        streams = [engine.submit(f"{step_id}-{i}", m) for i, m in enumerate(made)]
        readers = [asyncio.ensure_future(_last_output(stream)) for stream in streams]
        try:
            return list(await asyncio.gather(*readers))
        finally:  # however the step ends (a failed beam, cancellation), nothing of it keeps running
            for reader in readers:
                reader.cancel()
            for stream in streams:
                stream.close()

    return step


async def _last_output(stream: RequestStream) -> RequestOutput:
    """The final output of a stream."""
    output = None
    async for output in stream:
        pass
    return output


def request_output(request_id: str, output: BeamSearchOutput, num_beams: int, tokenizer,
                   skip_special_tokens: bool = True, include_stop_token: bool = False) -> RequestOutput:
    """The best `num_beams` beams of a search as one RequestOutput (as vLLM's server returns them): each
    beam a sample with its generated tokens (without the EOS that finished it unless
    `include_stop_token`), their text and logprobs, and its cumulative logprob."""
    num_prompt_tokens = len(output.prompt_token_ids)
    samples = []
    for index, beam in enumerate(output.sequences[:num_beams]):
        end = len(beam.tokens) - (1 if beam.finish_reason == "stop" and not include_stop_token else 0)
        token_ids = beam.tokens[num_prompt_tokens:end]  # (generated,)
        samples.append(CompletionOutput(
            index=index, text=tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens),
            token_ids=token_ids, cumulative_logprob=beam.cum_logprob, logprobs=beam.logprobs[:len(token_ids)],
            finish_reason=beam.finish_reason, stop_reason=beam.stop_reason,
        ))
    now = time.monotonic()
    return RequestOutput(request_id=request_id, prompt=output.prompt, prompt_token_ids=output.prompt_token_ids,
                         outputs=samples, finished=True,
                         metrics=RequestMetrics(arrival_time=now, finished_time=now))
