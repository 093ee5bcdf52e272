"""Drive an `LLMEngine` over a benchmark workload, recording every step and every request's tokens.

Both jaxserve systems of `jaxserve bench throughput` (continuous and static batching) run through
`drive`, so they are timed by the same loop; the per-step records give the KV-memory and timeline
reports, the per-request traces the latency ones (through stats.RequestTrace, as the online client).
Requests run with output_kind DELTA: a step's outputs carry only its new tokens, so the driver's own
work per step does not grow with the outputs' lengths.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from jaxserve.bench.stats import RequestTrace
from jaxserve.bench.workloads import BenchRequest, Workload
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import RequestOutputKind, SamplingParams


@dataclasses.dataclass
class StepRecord:
    """One engine step as the driver saw it."""

    start: float  # time.perf_counter() before engine.step() (s)
    end: float  # after it (s)
    num_tokens: int  # real (unpadded) tokens scheduled
    num_running: int  # requests running after the step
    num_waiting: int  # requests waiting after the step
    pages_in_use: int  # KV pages held by requests after the step (reservations included)
    token_slots_used: int  # tokens whose KV those pages hold


@dataclasses.dataclass
class DriveResult:
    """A whole workload's run."""

    seconds: float  # from the first request added to the last one finished
    steps: list[StepRecord]
    traces: list[RequestTrace]  # in workload order; one chunk per step that gave the request tokens
    output_token_ids: list[list[int]]  # in workload order
    preemptions: list[int]  # in workload order: how often the request's samples were preempted


def bench_params(request: BenchRequest) -> SamplingParams:
    """Greedy, EOS ignored: the request generates exactly `output_len` tokens."""
    return SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)


def drive(engine: LLMEngine, workload: Workload, arrival_times: Sequence[float] | None = None,
          params: Callable[[BenchRequest], SamplingParams] = bench_params) -> DriveResult:
    """Run `workload` to the end on `engine` (which must be idle): request i is added once
    `arrival_times[i]` seconds have passed since the start (all at once when None), with the sampling
    parameters `params(request)` (greedy and exact lengths by default). With n > 1 a trace counts the
    tokens of all samples and `output_token_ids` holds the first sample's."""
    requests = workload.requests
    arrivals = list(arrival_times) if arrival_times is not None else [0.0] * len(requests)
    if len(arrivals) != len(requests):
        raise ValueError(f"{len(arrivals)} arrival times for {len(requests)} requests")
    if engine.has_unfinished_requests():
        raise ValueError("the engine must be idle before a benchmark run")
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])  # request indices by arrival
    traces = [RequestTrace(start=0.0, chunk_times=[], chunk_tokens=[], end=0.0,
                           prompt_tokens=len(request.prompt_token_ids), output_tokens=0) for request in requests]
    outputs: list[list[int]] = [[] for _ in requests]
    children: list[list] = [[] for _ in requests]  # each workload request's engine Requests
    steps: list[StepRecord] = []
    index_of = {f"bench-{i}": i for i in range(len(requests))}
    next_arrival = 0
    start = time.perf_counter()
    while next_arrival < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while next_arrival < len(order) and arrivals[order[next_arrival]] <= now - start:
            i = order[next_arrival]
            request_params = params(requests[i]).clone(output_kind=RequestOutputKind.DELTA)
            made = engine.make_requests(f"bench-{i}", list(requests[i].prompt_token_ids), request_params)
            engine.submit(f"bench-{i}", made)
            children[i] = made[1]
            traces[i].start = time.perf_counter()
            next_arrival += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + arrivals[order[next_arrival]] - time.perf_counter()))
            continue
        steps.append(_timed_step(engine, traces, outputs, index_of))
    return DriveResult(seconds=time.perf_counter() - start, steps=steps, traces=traces, output_token_ids=outputs,
                       preemptions=[sum(child.num_preemptions for child in made) for made in children])


def _timed_step(engine: LLMEngine, traces: list[RequestTrace], outputs: list[list[int]],
                index_of: dict[str, int]) -> StepRecord:
    """One engine step: its record, and each moved request's new tokens in its trace."""
    tokens_before = engine.core.counters["scheduled_tokens"]
    step_start = time.perf_counter()
    moved = engine.step()
    step_end = time.perf_counter()
    for output in moved:  # DELTA outputs: each sample's new tokens
        i = index_of[output.request_id]
        num_new = sum(len(sample.token_ids) for sample in output.outputs)
        if num_new:
            traces[i].chunk_times.append(step_end)
            traces[i].chunk_tokens.append(num_new)
        outputs[i].extend(token for sample in output.outputs if sample.index == 0 for token in sample.token_ids)
        traces[i].output_tokens += num_new
        if output.finished:
            traces[i].end = step_end
    pages_in_use, token_slots_used = engine.core.kv_occupancy()
    return StepRecord(
        start=step_start, end=step_end, num_tokens=engine.core.counters["scheduled_tokens"] - tokens_before,
        num_running=len(engine.core.scheduler.running), num_waiting=len(engine.core.scheduler.waiting),
        pages_in_use=pages_in_use, token_slots_used=token_slots_used,
    )
