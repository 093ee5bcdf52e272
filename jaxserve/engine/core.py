"""EngineCore: schedule -> build batch -> run -> update. Token ids in, token ids out (no tokenizer)."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Mapping

from jaxserve.attention import fp8
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
from jaxserve.config import EAGLE_METHODS, EngineConfig, runs_pooling
from jaxserve.distributed import runtime
from jaxserve.distributed.channel import FollowerChannel, LeaderChannel
from jaxserve.distributed.mirror import Mirrored, exit_soon, serve_leader
from jaxserve.engine.host_gc import tune_garbage_collector
from jaxserve.engine.lora_slots import LoraSlots
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sizing import bucket_ladders, resolve_max_model_len, resolve_num_host_pages, resolve_num_pages
from jaxserve.engine.step_timing import StepTiming
from jaxserve.engine.weight_control import WeightControl
from jaxserve.kv.cache_manager import KVCacheManager, pages_for_tokens
from jaxserve.kv.page_pool import PagePool
from jaxserve.kv.sizing import reserve_device_memory
from jaxserve.lora_request import LoRARequest
from jaxserve.model.checkpoint import is_checkpoint, load_weights
from jaxserve.model.eagle import read_head_config
from jaxserve.model.lora import lora_slot_structs, with_lora_slots
from jaxserve.model.registry import load_model_spec, model_for
from jaxserve.pooling.params import PoolerConfig, matryoshka_dimensions, resolve_pooler_config
from jaxserve.request import Logprob, Request, RequestStatus
from jaxserve.runner.executables import CompileCounter, enable_compilation_cache
from jaxserve.runner.runner import PendingStep, Runner, StepOutput, TokenLogprobs
from jaxserve.sharding import cache_kv_heads, check_replica_devices, make_mesh, with_expert_parallel
from jaxserve.spec_decode.draft import DraftModelProposer
from jaxserve.spec_decode.eagle import EagleProposer
from jaxserve.spec_decode.metrics import SpecDecodeStats
from jaxserve.spec_decode.ngram import NgramProposer
from jaxserve.spec_decode.proposer import Proposer
from jaxserve.step import SampledToken, SchedulerOutput

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
        reserve_device_memory(config.gpu_memory_utilization)  # before JAX starts its GPU backend
        self.group = runtime.join(config.distributed_coordinator, config.num_processes, config.process_id,
                                  config.distributed_timeout_s)  # before anything touches a device
        self.channel = self._open_step_channel()
        enable_compilation_cache(config.compilation_cache_dir)
        self.spec = with_expert_parallel(load_model_spec(model_path), config.enable_expert_parallel)
        self.max_model_len = resolve_max_model_len(config, self.spec)
        self.spec = self.spec.for_max_model_len(self.max_model_len)
        pooling = runs_pooling(config, self.spec)
        if self.spec.classifier is not None and config.speculative_config:
            raise ValueError("speculative_config: a sequence classifier generates nothing to speculate on; leave it "
                             "unset")
        tp = config.tensor_parallel_size
        if self.group is not None:
            runtime.check_mesh_spans_processes(tp, self.group)
        check_replica_devices(tp, config.data_parallel_size)  # before replica 0 loads anything
        self.mesh = make_mesh(tp, first_device)
        kv_heads = cache_kv_heads(self.spec, tp)
        params, dtype = load_weights(config, model_path, self.spec, self.mesh, kv_heads)
        if config.enable_lora:  # max_loras free adapter slots in the params (model/lora.py)
            params = with_lora_slots(params, lora_slot_structs(model_for(self.spec.architecture), self.spec, kv_heads,
                                                               self.mesh, config.max_loras, config.max_lora_rank,
                                                               dtype))
        self.ladders = bucket_ladders(config, self.spec, self.max_model_len)
        method = (config.speculative_config or {}).get("method")  # speculative decoding's proposer
        head = None  # an EAGLE head's folder, read once: what the target keeps for it, then the head
        if method in EAGLE_METHODS:
            head = read_head_config(config.speculative_config["model"], method, self.spec)
        self.runner = Runner(
            self.spec, params, self.mesh,
            page_size=config.page_size, num_cache_kv_heads=kv_heads,
            cache_dtype=fp8.cache_dtype(config.kv_cache_dtype, dtype), ladders=self.ladders,
            attention_backend=config.attention_backend,
            num_scheduler_steps=config.num_scheduler_steps, num_speculative_tokens=config.num_speculative_tokens,
            structured_outputs=config.enable_structured_outputs, pooling=pooling, logprobs_mode=config.logprobs_mode,
            features=head.features if head else None,  # what an EAGLE head reads of the target
        )
        # runner pooling: how prompts are pooled into embeddings or classes, and the sizes a Matryoshka model may cut
        # embeddings to
        self.pooler: PoolerConfig | None = None
        self.matryoshka_dimensions: tuple[int, ...] | None = None
        if pooling:
            self.pooler = resolve_pooler_config(model_path, config.pooler_config)
            self.matryoshka_dimensions = matryoshka_dimensions(model_path, self.spec.hidden_size)
        self.draft = None  # speculative decoding's draft model or EAGLE head (methods draft_model, eagle)
        if method == "draft_model":
            self.draft = DraftModelProposer.load(config, self.spec, self.mesh, self.ladders, self.max_model_len)
        elif method in EAGLE_METHODS:
            self.draft = EagleProposer.load(config, head, self.mesh, self.ladders, self.max_model_len, self.runner)
        # The draft's pool has as many pages as the target's, so a page of each is sized together.
        self.num_pages = resolve_num_pages(config, self.max_model_len,
                                           [self.runner] + ([self.draft.runner] if self.draft else []))
        if self.group is not None:  # hosts may see different free memory: every process takes the smallest pool
            self.num_pages = runtime.agreed_minimum("num_pages", self.num_pages, self.group)
        host_pool = None
        if config.preemption_mode != "recompute":
            host_pool = PagePool(resolve_num_host_pages(config.swap_space, self.runner.page_bytes()))
        logger.info("KV cache: %d pages of %d tokens (%d tokens) in %s%s", self.num_pages, config.page_size,
                    self.num_pages * config.page_size, self.runner.cache_dtype.name,
                    fp8.tokens_note(config.kv_cache_dtype, dtype))
        self.runner.allocate_kv(self.num_pages)
        if config.skip_precompile:
            logger.info("skip_precompile: each bucket compiles at its first use")
        else:
            if config.background_compile and self.group is not None:  # every process must run the same buckets
                logger.info("background_compile: a multi-host engine compiles every bucket first")
            self.runner.warmup(show_progress, background=config.background_compile and self.group is None)
        if self.draft is not None:
            self.draft.allocate(self.num_pages, show_progress, precompile=not config.skip_precompile)
        if host_pool is not None:
            self.runner.allocate_host_kv(host_pool.num_pages, pages_for_tokens(self.max_model_len, config.page_size))
        self.kv = KVCacheManager(PagePool(self.num_pages), config.page_size, config.prefix_caching, host_pool)
        if isinstance(self.draft, EagleProposer):
            self.draft.target_kv = self.kv  # where the target keeps each request's features
        self.lora_slots = LoraSlots(self.spec, config.max_loras, config.max_lora_rank, kv_heads)
        self.weights = WeightControl(  # the weights version and source; sleep mode
            self.spec, kv_heads, self.mesh.devices.size, self.group is not None,
            model_path if config.load_format == "auto" and not is_checkpoint(model_path) else None)
        if config.enable_lora:
            self.runner.set_lora(0, {})  # compiles the slot writes now, not at the first adapter loaded later
            for index, (name, path) in enumerate((config.lora_modules or {}).items()):
                self.add_lora(LoRARequest(name, index + 1, path))
        self.timing = StepTiming()
        self.scheduler = Scheduler(config.scheduler_config(self.max_model_len), self.kv, self._make_proposer())
        self._compiles_after_warmup_base = CompileCounter.count()
        self.counters = collections.Counter()
        self._in_flight: collections.deque[_InFlight] = collections.deque()  # dispatched, samples not brought
        self._page_rows = PageRows()  # the running requests' page-table rows, kept between steps
        self.spec_stats = SpecDecodeStats(config.num_speculative_tokens)
        tune_garbage_collector()  # fewer collections in the step loop (engine/host_gc.py)
        if self.group is not None:  # nobody runs a step (a collective) before everybody can
            runtime.barrier("started")
        if isinstance(self.channel, LeaderChannel):  # every device call from here on is made by every process
            self.runner = Mirrored(self.runner, "runner", self.channel)
            if self.draft is not None:
                self.draft.runner = Mirrored(self.draft.runner, "draft", self.channel)

    def _open_step_channel(self) -> LeaderChannel | FollowerChannel | None:
        """The multi-host step channel (distributed/channel.py), or None in a one-process engine. A lost follower
        ends the leader soon after (distributed/mirror.py); the leader says stop to the followers at exit."""
        if self.group is None:
            return None
        timeout = self.config.distributed_timeout_s
        if not self.group.is_leader:
            return FollowerChannel(self.group, timeout)
        channel = LeaderChannel(self.group, timeout)
        channel.on_lost(exit_soon)
        runtime.before_leaving(channel.close)
        return channel

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
        if not speculative:
            return None
        if self.draft is not None:  # a draft model or an EAGLE head
            proposer = self.draft
        else:
            proposer = NgramProposer(speculative["num_speculative_tokens"], speculative["prompt_lookup_min"],
                                     speculative["prompt_lookup_max"])
        return _TimedProposer(proposer, self.timing)

    def add_request(self, request: Request) -> None:
        """Queue a validated request (ValueError while asleep)."""
        self.weights.check_awake("run requests")
        self.scheduler.add_request(request)

    def add_lora(self, request: LoRARequest) -> int:
        """Load a LoRA adapter into a free slot and return the slot (engine/lora_slots.py); ValueError when the
        engine serves no adapters, sleeps, or cannot load this one."""
        if not self.config.enable_lora:
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
        self.weights.check_can_sleep(self.config.enable_sleep_mode, level, len(self.scheduler.requests))
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
        keep = 1 if self.config.async_scheduling and launched and self.scheduler.proposer is None else 0
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
                self._record_prompt_logprobs(step.output, step.prompt_counts, result.prompt_logprobs)
            if step.pooled_spans:
                self._record_pooled(step.output, step.pooled_spans, result.pooled)
            return self.scheduler.update(step.output, self._sampled_tokens(step.output, result))

    def _build_inputs(self, output: SchedulerOutput):
        """The step's padded inputs: BatchDescriptor, SamplingBatch, (PromptLogprobBatch or None, counts),
        (PoolingBatch or None, counts), DecodeSteps or None, Proposals or None."""
        device_rows = {}  # request id -> its row in the step in flight, whose samples stay on the device
        if self._in_flight:
            device_rows = {item.request.request_id: row for row, item in enumerate(self._in_flight[-1].output.scheduled)}
        batch = build_batch(output, self.config.page_size, self.ladders, device_rows, self._page_rows)
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

    def _record_prompt_logprobs(self, output: SchedulerOutput, counts: list[int], scored: TokenLogprobs) -> None:
        """Append each row's newly scored prompt tokens to its request's prompt logprobs."""
        entry = 0
        for item, count in zip(output.scheduled, counts, strict=True):
            num_top = item.request.sampling_params.prompt_logprobs
            for index in range(entry, entry + count):
                target = item.request.prompt_token_ids[len(item.request.prompt_logprobs)]
                item.request.prompt_logprobs.append(_logprob_dict(scored, index, target, num_top))
            entry += count

    @staticmethod
    def _record_pooled(output: SchedulerOutput, spans: list[slice], pooled) -> None:
        """Add each pooling row's newly pooled positions' states to its pool: `pooled` (R, H) the rows' sums, or
        (T, H) the step tokens' states one by one (`spans`: each row's tokens)."""
        per_token = any(item.request.pooled is not None and item.request.pooled.per_token for item in output.scheduled)
        for row, (item, span) in enumerate(zip(output.scheduled, spans)):
            if span.stop > span.start:
                item.request.pooled.add(pooled[span] if per_token else pooled[row], span.stop - span.start)

    def _sampled_tokens(self, output: SchedulerOutput, result: StepOutput) -> list[list[SampledToken]]:
        """Each scheduled chunk's samples, in order (none for a chunk that stops mid-prompt), with their
        logprobs when the request asked."""
        sampled: list[list[SampledToken]] = []
        rows = result.token_ids.T.tolist()  # (num_seqs, S): each row's samples, as Python ints at once
        for row, item in enumerate(output.scheduled):
            if not item.samples:
                sampled.append([])
                continue
            if item.spec_token_ids:  # the accepted proposals and the token after them; -1 after
                token_ids = [t for t in rows[row][: item.num_samples] if t >= 0]
                self.spec_stats.observe(len(item.spec_token_ids), len(token_ids) - 1)
            else:
                token_ids = rows[row][: item.num_steps]
            num_logprobs = item.request.sampling_params.logprobs
            if num_logprobs is None:  # (multi-step decodes never have logprobs rows)
                sampled.append(list(map(SampledToken, token_ids)))
            else:
                first = row * result.logprobs_per_row
                sampled.append([SampledToken(t, _logprob_dict(result.sampled_logprobs, first + j, t, num_logprobs))
                                for j, t in enumerate(token_ids)])
        return sampled

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
                     if self.config.enable_lora else None),
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


def _logprob_dict(scored: TokenLogprobs, index: int, token_id: int, num_top: int) -> dict[int, Logprob]:
    """vLLM's per-token logprobs: the token itself (exact rank) plus the `num_top` most likely tokens."""
    top_ids = scored.top_token_ids[index, :num_top].tolist()
    top_lps = scored.top_logprobs[index, :num_top].tolist()
    entries = {tid: Logprob(lp, rank=rank + 1) for rank, (tid, lp) in enumerate(zip(top_ids, top_lps))}
    own = Logprob(float(scored.logprobs[index]), rank=int(scored.ranks[index]))
    return {token_id: own, **{tid: e for tid, e in entries.items() if tid != token_id}}
