"""EngineCore: schedule -> build batch -> run -> update. Token ids in, token ids out (no tokenizer)."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Mapping

from jaxserve.batch.builder import (
    PageRows,
    build_batch,
    build_decode_steps,
    build_pooling_batch,
    build_prompt_logprob_batch,
    build_proposals,
    build_sampling_batch,
    fill_token_bitmasks,
)
from jaxserve.config import EngineConfig
from jaxserve.distributed.channel import LeaderChannel
from jaxserve.distributed.mirror import serve_leader
from jaxserve.engine.core_builder import build_core_parts
from jaxserve.engine.host_gc import tune_garbage_collector
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.step_results import record_pooled, record_prompt_logprobs, sampled_tokens
from jaxserve.engine.step_timing import StepTiming
from jaxserve.lora_request import LoRARequest
from jaxserve.request import Request, RequestStatus
from jaxserve.runner.executables import CompileCounter
from jaxserve.runner.runner import PendingStep
from jaxserve.spec_decode.metrics import SpecDecodeStats
from jaxserve.spec_decode.ngram import NgramProposer
from jaxserve.spec_decode.proposer import Proposer
from jaxserve.step import SchedulerOutput

logger = logging.getLogger("jaxserve")
# Longest a step with nothing to run sleeps on the grammar compiles its waiting requests need (they wake it at
# once; a request arriving meanwhile waits at most this).
GRAMMAR_WAIT_S = 0.01


class EngineCore:
    """Owns the scheduler, the page pool and the runner of one model."""

    def __init__(self, config: EngineConfig, model_path: str, show_progress: bool = True, first_device: int = 0):
        """The engine of `config` over `tensor_parallel_size` devices from `first_device` on (a data-parallel
        replica's); in a multi-host launch (`distributed_coordinator`), over every process's devices."""
        self.config = config
        parts = build_core_parts(config, model_path, show_progress, first_device)  # engine/core_builder.py
        for field in dataclasses.fields(parts):  # self.group, .channel, .spec, ... .runner, .kv, ... .weights
            setattr(self, field.name, getattr(parts, field.name))
        self.timing = StepTiming()
        self.scheduler = Scheduler(config.scheduler_settings(self.max_model_len), self.kv, self._make_proposer())
        self._compiles_after_warmup_base = CompileCounter.count()
        self.counters = collections.Counter()
        self._in_flight: collections.deque[_InFlight] = collections.deque()  # dispatched, samples not brought
        self._page_rows = PageRows()  # the running requests' page-table rows, kept between steps
        self.spec_stats = SpecDecodeStats(config.num_speculative_tokens)
        tune_garbage_collector()  # fewer collections in the step loop (engine/host_gc.py)

    def on_peer_lost(self, callback) -> None:
        """Call `callback(reason)` when a process of this multi-host launch goes (the process itself ends soon
        after: distributed/mirror.py); never called in a one-process engine."""
        if isinstance(self.channel, LeaderChannel):
            self.channel.on_lost(callback)

    @property
    def is_leader(self) -> bool:
        """Whether this process plans the steps (always, but on a multi-host launch's followers)."""
        return self.group is None or self.group.is_leader

    def follow_leader(self) -> None:
        """A follower's life after start-up: make the leader's device calls until it stops (a lost leader ends
        the process with EXIT_PEER_LOST)."""
        runners = {"runner": self.runner, **({"draft": self.draft.runner} if self.draft is not None else {})}
        serve_leader(runners, self.channel)

    def _make_proposer(self) -> Proposer | None:
        """The proposer speculative_config names (None without speculative decoding)."""
        speculative = self.config.speculative_config
        if speculative is None:
            return None
        if self.draft is not None:  # a draft model or an EAGLE head
            proposer = self.draft
        else:
            proposer = NgramProposer(speculative.num_speculative_tokens, speculative.prompt_lookup_min,
                                     speculative.prompt_lookup_max)
        return _TimedProposer(proposer, self.timing)

    def add_request(self, request: Request) -> None:
        """Queue a validated request (ValueError while asleep)."""
        self.weights.check_awake("run requests")
        self.scheduler.add_request(request)

    def add_lora(self, request: LoRARequest) -> int:
        """Load a LoRA adapter into a free slot and return the slot (engine/lora_slots.py); ValueError when the
        engine serves no adapters, sleeps, or cannot load this one."""
        if not self.config.lora_config.enable_lora:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora")
        self.weights.check_awake("load LoRA adapters")
        return self.lora_slots.add(request, self.runner)

    def remove_lora(self, name: str) -> None:
        """Free the slot of the adapter loaded as `name`; ValueError while an unfinished request uses it."""
        self.lora_slots.get(name)  # an unknown name is refused first
        self.weights.check_awake("remove LoRA adapters")
        self.lora_slots.remove(name, self.scheduler.requests.values(), self.runner)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string); their pages go back at once."""
        for request_id in request_ids:
            self.scheduler.finish_request(request_id, status)

    def reset_prefix_cache(self) -> int:
        """Forget every cached page, the draft model's too (held pages stay held); returns how many of the
        target's were forgotten."""
        if self.draft is not None:
            self.draft.kv.pool.reset_cache()
        return self.kv.pool.reset_cache()

    def update_weights(self, source: str | Mapping[str, object]) -> int:
        """Serve new weights of the same model from now on (model/weight_update.py): from a Hugging Face folder
        (every process of a multi-host launch reads its shards of it) or from arrays by their Hugging Face names
        (a one-process engine); returns the weights version (updates so far). Steps dispatched before run with
        the old weights; requests already running keep the KV they computed with them, but no request made from
        now on takes a page cached before (the prefix cache is forgotten, and requests' salts carry the version).
        ValueError, the served weights untouched, for a source that does not fit the model. The draft model of
        speculative decoding keeps its weights. While asleep, the weights are read when the engine wakes up."""
        source = self.weights.checked_source(source)  # here: before the runner's call, mirrored to every process
        if not self.weights.sleep_level:
            self.runner.update_weights(source)
        self.kv.pool.reset_cache()
        version = self.weights.updated(source)
        logger.info("weights updated (version %d)", version)
        return version

    def sleep(self, level: int = 1) -> None:
        """Free the device memory the engine holds between uses (vLLM's sleep mode, for a trainer that shares the
        devices): the KV pool (the prefix cache is forgotten) and the weights, copied to host memory first at level
        1, discarded at level 2 (`wake_up` reads them again from their folder, or from what `update_weights` gives
        while asleep). LoRA slots, KV scales and a draft model's weights wait in host memory at either level.
        ValueError without enable_sleep_mode, with unfinished requests, on a multi-host engine, or asleep."""
        self.weights.check_can_sleep(self.config.model_config.enable_sleep_mode, level, len(self.scheduler.requests))
        while self._in_flight:  # steps of requests aborted since
            self._collect()
        self.reset_prefix_cache()
        self.runner.sleep(keep_weights=level == 1)
        if self.draft is not None:
            self.draft.runner.sleep(keep_weights=True)
        self.weights.fell_asleep(level)
        logger.info("asleep (level %d): the KV pool and the weights left the devices", level)

    def wake_up(self) -> None:
        """Take the devices back after `sleep` (nothing happens awake): zeroed KV pools and the weights, from host
        memory, or read from what `update_weights` gave while asleep, or after level 2 from the folder they came
        from. ValueError, still asleep, after level 2 with no folder to read them from (the served weights came
        from arrays, a converted folder or random): give them with `update_weights` first."""
        if not self.weights.sleep_level:
            return
        self.runner.wake_up(self.weights.wake_source())
        if self.draft is not None:
            self.draft.runner.wake_up()
        self.weights.woke_up()
        logger.info("awake: the KV pool and the weights are back on the devices")

    def has_unfinished_requests(self) -> bool:
        """True while anything waits or runs."""
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[Request]:
        """One engine step; returns the requests that got a new token or finished.

        Plans and dispatches a step, then brings the samples of the step before it (asynchronous
        scheduling: the device computes this step meanwhile) or of this one (synchronous). A planned
        step reads the tokens the host has not seen yet on the device; when a running request needs
        its output on the host to be planned (penalties, bad words), the step in flight is brought first.

        When the step's inputs cannot be built because of one request (a value that passed validation
        but does not fit its array, say), that request alone ends with FINISHED_ERROR and the others
        run in the next step.
        """
        changed: list[Request] = self.scheduler.fail_grammars()
        if self._in_flight and any(request.needs_output_on_host for request in self.scheduler.running):
            changed += self._collect()
        launched, more = self._launch()
        changed += more
        if not launched and not self._in_flight and not changed:  # nothing to do but wait for grammars
            compiles = self.scheduler.pending_compiles()
            if compiles:
                concurrent.futures.wait(compiles, timeout=GRAMMAR_WAIT_S,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
        # Steps left on the device. A proposer reads each request's latest tokens, so speculative steps are
        # brought before the next is planned.
        overlap = self.config.scheduler_config.async_scheduling and self.scheduler.proposer is None
        keep = 1 if overlap and launched else 0
        while len(self._in_flight) > keep:
            changed += self._collect()
        return changed

    def _launch(self) -> tuple[bool, list[Request]]:
        """Schedule, build and dispatch one step; (whether one was dispatched, requests that failed or got tokens).

        A step with constrained rows is planned, built and its forward dispatched like any other, the step in
        flight running meanwhile; their masks need the tokens that step samples, so it is brought back (its
        requests are returned) and the masks filled while this step's forward runs, and only its sampler waits
        for them."""
        with self.timing.measure("schedule"):
            output = self.scheduler.schedule()
        self.counters["preemptions"] += len(output.preempted_ids)
        if output.swap_out or output.swap_in:
            with self.timing.measure("swap"):
                self.runner.swap(output.swap_out, output.swap_in)
        if output.is_empty:
            return False, []
        with self.timing.measure("build"):
            try:
                batch, sampling, (prompt, prompt_counts), (pooling, pooled_spans), steps, proposals = \
                    self._build_inputs(output)
            except Exception:
                return False, self._fail_unbuildable(output)
        started, collected = time.perf_counter(), []
        if sampling.token_bitmask.shape[1]:  # constrained rows (never a multi-step step; never proposing)
            with self.timing.measure("dispatch"):
                forward = self.runner.dispatch_forward(batch, prompt, pooling)
            while self._in_flight:
                collected += self._collect()
            with self.timing.measure("build"):
                fill_token_bitmasks(sampling, output)
            with self.timing.measure("dispatch"):
                pending = self.runner.dispatch_sampler(forward, sampling, proposals)
        else:
            with self.timing.measure("dispatch"):
                pending = self.runner.dispatch(batch, sampling, prompt, steps, proposals, pooling)
        self.timing.dispatched(started, pending.ready)
        self._in_flight.append(_InFlight(output, prompt_counts, pooled_spans, pending))
        self.counters["steps"] += 1
        self.counters["scheduled_tokens"] += sum(item.num_positions for item in output.scheduled)
        self.counters["padded_tokens"] += batch.input_ids.shape[0] * max(item.num_steps for item in output.scheduled)
        return True, collected

    def _collect(self) -> list[Request]:
        """Wait for the oldest step in flight and bring its samples to the scheduler."""
        step = self._in_flight.popleft()
        with self.timing.measure("wait"):
            result = step.pending.fetch()
        if self.runner.host_swap is not None:
            with self.timing.measure("swap"):
                self.runner.host_swap.flush()  # swap-outs dispatched before this step: copied by now
        with self.timing.measure("update"):
            if step.prompt_counts:
                record_prompt_logprobs(step.output, step.prompt_counts, result.prompt_logprobs)
            if step.pooled_spans:
                record_pooled(step.output, step.pooled_spans, result.pooled)
            return self.scheduler.update(step.output, sampled_tokens(step.output, result, self.spec_stats))

    def _build_inputs(self, output: SchedulerOutput):
        """The step's padded inputs: BatchDescriptor, SamplingBatch, (PromptLogprobBatch or None, counts),
        (PoolingBatch or None, counts), DecodeSteps or None, Proposals or None."""
        device_rows = {}  # request id -> its row in the step in flight, whose samples stay on the device
        if self._in_flight:
            device_rows = {item.request.request_id: row
                           for row, item in enumerate(self._in_flight[-1].output.scheduled)}
        batch = build_batch(output, self.config.cache_config.page_size, self.ladders, device_rows, self._page_rows)
        num_rows = batch.page_table.shape[0]
        sampling = build_sampling_batch(output, num_rows, self.ladders, self.spec.vocab_size)
        prompt = build_prompt_logprob_batch(output, batch.input_ids.shape[0])
        pooling = build_pooling_batch(output, batch.input_ids.shape[0], num_rows)
        proposals = build_proposals(output, num_rows, 1 + self.config.num_speculative_tokens)
        return batch, sampling, prompt, pooling, build_decode_steps(output, num_rows), proposals

    def _fail_unbuildable(self, output: SchedulerOutput) -> list[Request]:
        """Find the requests whose inputs cannot be built, each on its own, and end them with an error."""
        failed = []
        for item in output.scheduled:
            try:
                self._build_inputs(SchedulerOutput([item], []))
            except Exception as error:
                item.request.error = f"the engine could not run this request: {type(error).__name__}: {error}"
                failed.append(item.request)
        if not failed:
            raise RuntimeError("the step's inputs cannot be built, though each request's can")
        self.scheduler.unschedule(output)
        for request in failed:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
        return failed

    def kv_page_states(self) -> list[list[int]]:
        """The KV pool's map: each page's state (kv.PAGE_STATES: free, cached, in use, shared), run-length
        encoded (PagePool.page_states)."""
        return self.kv.pool.page_states()

    def kv_occupancy(self) -> tuple[int, int]:
        """(KV pages held by requests, reserved ones included; token slots of those pages holding computed
        KV, a shared page counted once). Walks every held page: for benchmarks, not for every step."""
        filled: dict[int, int] = {}  # page id -> slots holding computed KV
        page_size = self.kv.page_size
        for request in self.scheduler.requests.values():
            for index, page in enumerate(self.kv.page_ids(request.request_id)):
                slots = min(max(request.num_computed_tokens - index * page_size, 0), page_size)
                filled[page] = max(filled.get(page, 0), slots)
        return self.kv.pool.num_usable - self.kv.pool.num_free, sum(filled.values())

    def stats(self) -> dict:
        """Engine counters for monitoring and tests."""
        return {
            "steps": self.counters["steps"],
            "scheduled_tokens": self.counters["scheduled_tokens"],
            "padded_tokens": self.counters["padded_tokens"],
            "preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.scheduler.num_prompt_tokens,
            "generation_tokens": self.scheduler.num_generation_tokens,
            "prefix_cache_queries": self.scheduler.num_prefix_cache_queries,
            "prefix_cache_hits": self.scheduler.num_prefix_cache_hits,
            "swapped_out_requests": self.scheduler.num_swapped_out_requests,
            "swapped_out_pages": self.scheduler.num_swapped_out_pages,
            "swapped_in_pages": self.scheduler.num_swapped_in_pages,
            "host_pages_total": self.kv.host_pool.num_usable if self.kv.host_pool else 0,
            "host_pages_free": self.kv.host_pool.num_free if self.kv.host_pool else 0,
            "cpu_cache_usage_perc": self.kv.host_pool.usage() if self.kv.host_pool else 0.0,
            "kv_pages_total": self.kv.pool.num_usable,
            "kv_pages_free": self.kv.pool.num_free,
            "draft_kv_pages_total": self.draft.kv.pool.num_usable if self.draft else 0,
            "draft_kv_pages_free": self.draft.kv.pool.num_free if self.draft else 0,
            "draft_fed_tokens": self.draft.num_fed_tokens if self.draft else 0,
            "draft_prefix_cache_hits": self.draft.num_cached_tokens if self.draft else 0,
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "num_requests_swapped": len(self.kv.swapped_request_ids()),
            "num_requests_by_priority": self.scheduler.queue_lengths_by_priority(),
            "lora": (self.lora_slots.stats(self.scheduler.running, self.scheduler.waiting)
                     if self.config.lora_config.enable_lora else None),
            "compilations_after_warmup": (CompileCounter.count() - self._compiles_after_warmup_base
                                          - self.runner.num_background_compiles),
            "background_compiles_left": self.runner.background_compiles_left(),
            "steps_in_the_largest_bucket": self.runner.num_repadded_steps,
            "lazy_bucket_compilations": self.runner.num_lazy_compiles,
            "executables": self.runner.num_executables(),
            "timing": self.timing.summary(),
            "spec_decode": self.spec_stats.summary(),
        }


@dataclasses.dataclass
class _TimedProposer:
    """A proposer whose time counts as the step timing's "propose" phase (part of "schedule")."""

    proposer: Proposer
    timing: StepTiming

    def propose(self, requests: list[Request]) -> list[list[int]]:
        """The proposer's guesses, timed."""
        with self.timing.measure("propose"):
            return self.proposer.propose(requests)

    def release(self, request_id: str) -> None:
        """Forward to the proposer."""
        self.proposer.release(request_id)


@dataclasses.dataclass
class _InFlight:
    """A dispatched step whose samples the scheduler has not seen."""

    output: SchedulerOutput
    prompt_counts: list[int]  # prompt-logprob entries per scheduled row ([] when none)
    pooled_spans: list[slice]  # the step tokens each scheduled row pooled ([] when none)
    pending: PendingStep
