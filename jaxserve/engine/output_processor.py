"""OutputProcessor: token ids -> text, stop strings, finish reasons, vLLM-shaped RequestOutputs.

A user request with `n` samples is `n` engine requests (its children); this module folds them
back into one RequestOutput. With `best_of` > `n` it has `best_of` children, and, as vLLM does,
shows nothing until all of them have finished, then only the `n` with the highest cumulative
logprob, indexed 0..n-1 from the highest down.

What an output holds follows the request's `output_kind` (vLLM's RequestOutputKind): CUMULATIVE
everything so far at every step the request moves (each output owns its lists: an earlier one never
changes); DELTA only the samples that moved, each with its new token ids, logprobs and text (text
that could still turn out to begin an excluded stop string is held back until it cannot), the
prompt's logprobs in the first output alone; FINAL_ONLY one output once every sample has finished,
and none before, so a step builds no output for a request still running.

`process` builds each step's outputs at once (LLMEngine). A front end that streams can instead `advance` the
requests each step and build a running request's output only when its reader asks (`RequestState.output`): a
reader that falls behind then costs one output, not one a step; a finished request's last output is built at once
(`output_of`, which forgets it).
"""

from __future__ import annotations

import dataclasses
import time

from jaxserve.engine.stop_checker import StopStringChecker
from jaxserve.outputs import (
    ClassificationOutput,
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    TokenPoolingOutput,
)
from jaxserve.pooling.pooled import PooledPrompt
from jaxserve.request import Logprob, Request, RequestStatus
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.tokenizer import IncrementalDetokenizer


@dataclasses.dataclass
class _SampleState:
    """One child request's text and finish state."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    stop_checker: StopStringChecker
    num_tokens_seen: int = 0
    text_end: int | None = None  # where a stop string cut the text (None: nowhere)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # DELTA: what earlier outputs have shown
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    finish_sent: bool = False

    @property
    def text(self) -> str:
        """The sample's text: its detokenizer's, up to where a stop string cut it."""
        return "" if self.detokenizer is None else self.detokenizer.text[: self.text_end]

    def completion(self, index: int, show_logprobs: bool) -> CompletionOutput:
        """Everything this sample holds, as output `index`, in lists of its own."""
        return self._output(index, self.text, 0, show_logprobs)

    def delta(self, show_logprobs: bool) -> CompletionOutput | None:
        """What this sample holds that no earlier output showed (None: nothing), and mark it shown. While it
        runs, its text's last characters that could begin an excluded stop string are held back."""
        finished = self.finish_reason is not None
        text = self.stop_checker.streamable_delta(self.text, self.num_sent_chars, finished)
        if not text and len(self.token_ids) == self.num_sent_tokens and (self.finish_sent or not finished):
            return None
        completion = self._output(self.index, text, self.num_sent_tokens, show_logprobs)
        self.num_sent_tokens, self.num_sent_chars = len(self.token_ids), self.num_sent_chars + len(text)
        self.finish_sent = finished
        return completion

    def _output(self, index: int, text: str, first_token: int, show_logprobs: bool) -> CompletionOutput:
        """Output `index` with `text` and the token ids (and logprobs) from `first_token` on, in lists of its own."""
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=self.token_ids[first_token:],
            cumulative_logprob=self.cumulative_logprob if show_logprobs else None,
            logprobs=self.logprobs[first_token:] if show_logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclasses.dataclass
class RequestState:
    """A user request and its children."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: dict[str, _SampleState]  # child request id -> state, in sample index order
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None  # the scoring child's list, filled by the engine
    num_returned: int  # n: fewer than the samples when best_of > n
    show_logprobs: bool  # the user asked for logprobs (best_of > n computes them anyway, to rank)
    output_kind: RequestOutputKind
    children: list[Request]  # the engine requests of its samples, in sample order
    error: str | None = None
    num_cached_tokens: int = 0
    pooled: PooledPrompt | None = None  # an embedding request's pool, filled by the engine

    # (loops, not all / sum / max over generators: these run for every request a step, in the front end)
    @property
    def finished(self) -> bool:
        """True once every sample has finished."""
        for sample in self.samples.values():
            if sample.finish_reason is None:
                return False
        return True

    @property
    def num_output_tokens(self) -> int:
        """The output tokens of all its samples so far."""
        total = 0
        for sample in self.samples.values():
            total += len(sample.token_ids)
        return total

    @property
    def longest_output(self) -> int:
        """The output tokens of its longest sample so far."""
        longest = 0
        for sample in self.samples.values():
            if len(sample.token_ids) > longest:
                longest = len(sample.token_ids)
        return longest

    def output(self) -> RequestOutput | PoolingRequestOutput | None:
        """The output its `output_kind` shows now; None when there is nothing to show: FINAL_ONLY before every
        sample has finished, DELTA when no sample moved, and best_of > n while any sample runs (nothing is shown
        before the ranking is known, so no sample that loses is ever shown)."""
        self._take_children_metrics()
        if self.pooled is not None:
            return self._pooling_output()
        samples = list(self.samples.values())  # in index order: add_request adds them so
        finished = self.finished
        show, prompt_logprobs = self.show_logprobs, self.prompt_logprobs
        if self.num_returned < len(samples) or self.output_kind is RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            if self.num_returned < len(samples):  # nothing was shown before, whatever the kind
                # Stable: equal cumulative logprobs keep the sample order.
                samples = sorted(samples, key=lambda s: s.cumulative_logprob, reverse=True)[: self.num_returned]
            completions = [s.completion(index, show) for index, s in enumerate(samples)]
        elif self.output_kind is RequestOutputKind.DELTA:
            completions = [c for c in (s.delta(show) for s in samples) if c is not None]
            if not completions:
                return None
            self.prompt_logprobs = None  # shown in the first output alone
        else:
            completions = [s.completion(s.index, show) for s in samples]
        if prompt_logprobs is not None:
            prompt_logprobs = list(prompt_logprobs)  # the output's own: the engine's list grows while the prompt runs
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, finished, self.metrics,
                             prompt_logprobs, self.error, self.num_cached_tokens)

    def _take_children_metrics(self) -> None:
        """The metrics and cached-token count as of now: the earliest time any sample was scheduled and gave a
        token, the most preemptions and cached prompt tokens of any."""
        metrics = self.metrics
        for request in self.children:  # (comparisons, not min and max: this runs for every output)
            scheduled, first_token = request.first_scheduled_time, request.first_token_time
            if scheduled is not None and (metrics.first_scheduled_time is None
                                          or scheduled < metrics.first_scheduled_time):
                metrics.first_scheduled_time = scheduled
            if first_token is not None and (metrics.first_token_time is None or first_token < metrics.first_token_time):
                metrics.first_token_time = first_token
            if request.num_preemptions > metrics.num_preemptions:
                metrics.num_preemptions = request.num_preemptions
            if request.num_cached_tokens > self.num_cached_tokens:
                self.num_cached_tokens = request.num_cached_tokens

    def _pooling_output(self) -> PoolingRequestOutput:
        """A pooling request's output: its embedding (or class probabilities, or a token-wise task's every prompt
        token's) once it has finished with its whole prompt pooled."""
        (sample,) = self.samples.values()
        finished = sample.finish_reason is not None
        complete = sample.finish_reason == "stop" and not self.pooled.positions(len(self.prompt_token_ids))
        outputs = None
        if complete:
            pooled = self.pooled
            if pooled.per_token:
                outputs = TokenPoolingOutput(pooled.token_data())
            elif pooled.activation is None:
                outputs = PoolingOutput(pooled.embedding())
            else:
                outputs = ClassificationOutput(pooled.probs())
        return PoolingRequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, finished,
                                    self.metrics, self.error, self.num_cached_tokens)


class OutputProcessor:
    """Keeps per-request detokenizers and turns engine updates into RequestOutputs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._requests: dict[str, RequestState] = {}  # user request id -> state
        self._parent_of: dict[str, str] = {}  # child request id -> user request id

    def add_request(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        """Start tracking a user request whose samples are `children` (in sample order)."""
        first = children[0]
        samples = {
            child.request_id: self._new_sample(index, child.prompt_token_ids, child.sampling_params)
            for index, child in enumerate(children)
        }
        scoring = next((child for child in children if child.prompt_logprobs is not None), None)
        params = first.sampling_params
        self._requests[request_id] = RequestState(
            request_id, prompt, first.prompt_token_ids, samples,
            RequestMetrics(first.arrival_time, max_tokens=first.max_tokens),
            None if scoring is None else scoring.prompt_logprobs,
            num_returned=params.n, show_logprobs=params.output_logprobs is not None, output_kind=params.output_kind,
            children=list(children), pooled=first.pooled,
        )
        for child in children:
            self._parent_of[child.request_id] = request_id

    def _new_sample(self, index: int, prompt_ids: list[int], params: SamplingParams) -> _SampleState:
        detokenizer = None
        if params.detokenize:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, params.skip_special_tokens, params.spaces_between_special_tokens
            )
        return _SampleState(
            index=index,
            detokenizer=detokenizer,
            stop_checker=StopStringChecker(params.stop, params.include_stop_str_in_output),
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
        )

    def has_request(self, request_id: str) -> bool:
        """True while the user request `request_id` is tracked (queued or running)."""
        return request_id in self._requests

    def child_ids(self, request_id: str) -> list[str]:
        """Engine request ids of a user request's samples."""
        state = self._requests.get(request_id)
        return list(state.samples) if state else []

    def process(self, changed: list[Request]) -> tuple[list[RequestOutput], list[tuple[str, RequestStatus]]]:
        """Fold engine updates in; returns (outputs of the user requests that moved, a best_of > n request's
        only once it has finished; (child id, status) of the samples this ended: a stop string, or an error
        while detokenizing, which the caller must end in the scheduler)."""
        to_finish: list[tuple[str, RequestStatus]] = []
        touched: dict[str, RequestState] = {}
        for request in changed:
            state = self._take(request, to_finish)
            if state is None:
                continue
            if (state.output_kind is not RequestOutputKind.FINAL_ONLY
                    or state.samples[request.request_id].finish_reason is not None):
                touched[state.request_id] = state  # (a FINAL_ONLY request shows nothing while its samples run)
        outputs = [output for output in map(self.output_of, touched.values()) if output is not None]
        return outputs, to_finish

    def advance(self, changed: list[Request]) -> tuple[list[RequestState], list[tuple[str, RequestStatus]]]:
        """Fold engine updates in without building outputs; returns (the user requests that moved, in the order
        they first moved; (child id, status) of the samples this ended, as `process` gives them)."""
        to_finish: list[tuple[str, RequestStatus]] = []
        moved: dict[str, RequestState] = {}
        for request in changed:
            state = self._take(request, to_finish)
            if state is not None:
                moved[state.request_id] = state
        return list(moved.values()), to_finish

    def output_of(self, state: RequestState) -> RequestOutput | PoolingRequestOutput | None:
        """The output `state` shows now (None: nothing yet, see RequestState.output); once it is the final one,
        the request is forgotten."""
        output = state.output()
        if output is not None and output.finished:
            state.metrics.finished_time = time.monotonic()
            self._forget(state.request_id)
        return output

    def _take(self, request: Request, to_finish: list[tuple[str, RequestStatus]]) -> RequestState | None:
        """Fold one sample's update into its user request (None: not tracked); a status the scheduler must give
        the sample goes into `to_finish`."""
        parent_id = self._parent_of.get(request.request_id)
        if parent_id is None:
            return None
        state = self._requests[parent_id]
        status = self._update_sample_or_fail(state, state.samples[request.request_id], request)
        if status is not None:
            to_finish.append((request.request_id, status))
        return state

    def _update_sample_or_fail(self, state: RequestState, sample: _SampleState, request: Request
                               ) -> RequestStatus | None:
        """Update one sample; an exception fails this sample alone (finish reason 'error'). Returns the
        status the scheduler must give the request, if this ended it."""
        try:
            stopped = self._update_sample(sample, request)
        except Exception as error:
            state.error = f"the engine could not process this request's output: {type(error).__name__}: {error}"
            sample.finish_reason = "error"
            return None if request.is_finished else RequestStatus.FINISHED_ERROR
        state.error = state.error or request.error
        return RequestStatus.FINISHED_STOPPED if stopped else None

    def abort(self, request_id: str) -> RequestOutput | None:
        """Mark every unfinished sample of a user request aborted; returns its final output."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        for sample in state.samples.values():
            sample.finish_reason = sample.finish_reason or "abort"
        state.metrics.finished_time = time.monotonic()
        self._forget(request_id)
        return state.output()

    def _forget(self, request_id: str) -> None:
        state = self._requests.pop(request_id)
        for child_id in state.samples:
            self._parent_of.pop(child_id, None)

    def _update_sample(self, sample: _SampleState, request: Request) -> bool:
        """Take the request's new tokens, one at a time (a multi-step decode brings several): True when a stop
        string ended the sample; its later tokens are dropped."""
        if sample.finish_reason is not None:
            return False
        finished = request.is_finished
        new_ids = request.output_token_ids[sample.num_tokens_seen :]
        new_logprobs = request.output_logprobs[sample.num_tokens_seen :] if sample.logprobs is not None else []
        sample.num_tokens_seen = len(request.output_token_ids)
        for index, token_id in enumerate(new_ids):
            sample.token_ids.append(token_id)
            if new_logprobs:
                sample.logprobs.append(new_logprobs[index])
                sample.cumulative_logprob += new_logprobs[index][token_id].logprob
            if sample.detokenizer is None:
                continue
            delta = sample.detokenizer.add_tokens([token_id])
            if finished and index == len(new_ids) - 1:
                delta += sample.detokenizer.finish()
            if not delta or not sample.stop_checker.stop:
                continue  # no stop string can end here (and the text is not joined for nothing)
            match = sample.stop_checker.check(sample.text, len(delta))
            if match is not None:
                sample.text_end = match.truncate_to
                sample.finish_reason, sample.stop_reason = "stop", match.stop
                return not finished
        if finished:
            sample.finish_reason = request.status.finish_reason
            sample.stop_reason = request.stop_reason
        return False
