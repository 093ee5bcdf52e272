"""EngineCore: schedule -> build batch -> run -> update. Token ids in, token ids out (no tokenizer)."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Mapping

import jax

from jaxserve.attention import fp8
from jaxserve.batch.builder import (
    MAX_AUX_EXTRA,
    BucketLadders,
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
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.step_timing import StepTiming
from jaxserve.kv.cache_manager import KVCacheManager, pages_for_tokens
from jaxserve.kv.page_pool import PagePool
from jaxserve.kv.sizing import check_allocator_limit, device_memory_bytes, plan_kv_pages, reserve_device_memory
from jaxserve.lora_request import LoRARequest
from jaxserve.model.checkpoint import is_checkpoint, load_weights
from jaxserve.model.eagle import read_head_config
from jaxserve.model.loader import SafetensorsFolder, TensorMapping, check_source
from jaxserve.model.lora import lora_slot_structs, read_adapter, with_lora_slots
from jaxserve.model.registry import load_model_spec, model_for
from jaxserve.model_spec import ModelSpec
from jaxserve.pooling.params import PoolerConfig, matryoshka_dimensions, resolve_pooler_config
from jaxserve.request import Logprob, Request, RequestStatus
from jaxserve.runner.executables import CompileCounter, use_executable_store
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
        self.loras: dict[str, LoadedLora] = {}  # the LoRA adapters in the slots, by name
        self.weights_version = 0  # weight updates so far (update_weights); part of every request's prefix salt
        # Sleep mode: 0 awake, else the level slept at; the weights a wake-up reads (a folder or arrays that
        # update_weights gave while asleep); the folder the served weights came from, when they did from one.
        self.sleep_level = 0
        self._wake_source: str | TensorMapping | None = None
        self._weights_folder = model_path if config.load_format == "auto" and not is_checkpoint(model_path) else None
        self._lora_loads = itertools.count()
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
        self._check_awake("run requests")
        self.scheduler.add_request(request)

    def _check_awake(self, to: str) -> None:
        """ValueError while the engine sleeps, saying what it cannot do (`to`) and how to wake it."""
        if self.sleep_level:
            raise ValueError(f"the engine is asleep (sleep level {self.sleep_level}) and cannot {to}: call wake_up() "
                             "first")

    def add_lora(self, request: LoRARequest) -> int:
        """Load a LoRA adapter into a free slot (one loaded before under the same name and folder keeps its
        slot); returns the slot. ValueError when the engine serves no adapters, the name is taken by another
        folder, every slot holds one, or the adapter cannot be served (model/lora.py)."""
        if not self.config.enable_lora:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora")
        self._check_awake("load LoRA adapters")
        loaded = self.loras.get(request.lora_name)
        if loaded is not None:
            if loaded.request.lora_path != request.lora_path:
                raise ValueError(f"LoRA adapter name {request.lora_name!r} is taken by {loaded.request.lora_path}")
            return loaded.slot
        taken = {loaded.slot for loaded in self.loras.values()}
        free = [slot for slot in range(self.config.max_loras) if slot not in taken]
        if not free:
            raise ValueError(f"every one of the max_loras={self.config.max_loras} adapter slots holds an adapter "
                             f"({', '.join(self.loras)}): raise max_loras, or remove one")
        adapter = read_adapter(request.lora_path, self.spec, self.config.max_lora_rank,
                               cache_kv_heads(self.spec, self.config.tensor_parallel_size),
                               set(self.runner.params["layers"]["lora"]),
                               model_for(self.spec.architecture).fused_parts(self.spec))
        self.runner.set_lora(free[0], adapter)
        self.loras[request.lora_name] = LoadedLora(free[0], request, f"{request.lora_name}#{next(self._lora_loads)}")
        logger.info("LoRA adapter %r from %s in slot %d", request.lora_name, request.lora_path, free[0])
        return free[0]

    def remove_lora(self, name: str) -> None:
        """Free the slot of the adapter loaded as `name`; ValueError while a request that runs with it is
        unfinished. (Its cached prefix pages can never be taken again: a later load is keyed anew.)"""
        loaded = self.lora(name)
        users = [r.request_id for r in self.scheduler.requests.values() if r.lora_slot == loaded.slot]
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {len(users)} unfinished request(s)")
        self._check_awake("remove LoRA adapters")
        self.runner.set_lora(loaded.slot, {})
        del self.loras[name]

    def _lora_stats(self) -> dict | None:
        """The adapters running and waiting requests use, by name, and max_loras (None without enable_lora)."""
        if not self.config.enable_lora:
            return None
        names = {loaded.slot: name for name, loaded in self.loras.items()}

        def used(requests) -> list[str]:
            return sorted({names[r.lora_slot] for r in requests if r.lora_slot in names})

        return {"max_loras": self.config.max_loras, "running": used(self.scheduler.running),
                "waiting": used(self.scheduler.waiting)}

    def lora(self, name: str) -> LoadedLora:
        """The adapter loaded as `name`; ValueError naming the loaded ones otherwise."""
        if name not in self.loras:
            loaded = ", ".join(self.loras) or "none"
            raise ValueError(f"no LoRA adapter {name!r} is loaded (loaded: {loaded})")
        return self.loras[name]

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
        if isinstance(source, str):
            if is_checkpoint(source):
                raise ValueError(f"update_weights: {source!r} is a converted (orbax) folder; give the Hugging Face "
                                 "folder (safetensors) it was converted from")
            folder = SafetensorsFolder(source)
        elif not isinstance(source, Mapping):
            raise ValueError(f"update_weights takes a folder path or a mapping of Hugging Face tensor names to "
                             f"arrays, got {type(source).__name__}")
        elif self.group is not None:
            raise ValueError("a multi-host engine takes new weights from a folder every host can read, not from "
                             "arrays in this process's memory")
        else:
            folder = source = TensorMapping(source)
        try:  # once, here: before the runner's call, which a multi-host launch mirrors to every process
            check_source(folder, self.spec, cache_kv_heads(self.spec, self.config.tensor_parallel_size),
                         self.mesh.devices.size)
        except ValueError as error:
            raise ValueError(f"update_weights: these weights do not fit the served model: {error}") from error
        if self.sleep_level:
            self._wake_source = source
        else:
            self.runner.update_weights(source)
        self._weights_folder = source if isinstance(source, str) else None
        self.kv.pool.reset_cache()
        self.weights_version += 1
        logger.info("weights updated (version %d)", self.weights_version)
        return self.weights_version

    def sleep(self, level: int = 1) -> None:
        """Free the device memory the engine holds between uses (vLLM's sleep mode, for a trainer that shares the
        devices): the KV pool (the prefix cache is forgotten) and the weights, copied to host memory first at level
        1, discarded at level 2 (`wake_up` reads them again from their folder, or from what `update_weights` gives
        while asleep). LoRA slots, KV scales and a draft model's weights wait in host memory at either level.
        ValueError without enable_sleep_mode, with unfinished requests, on a multi-host engine, or asleep."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep needs an engine started with enable_sleep_mode (--enable-sleep-mode)")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (weights kept in host memory) or 2 (weights discarded), got "
                             f"{level!r}")
        if self.sleep_level:
            raise ValueError(f"the engine is already asleep (sleep level {self.sleep_level})")
        if self.group is not None:
            raise ValueError("a multi-host engine cannot sleep: its weights are spread over the hosts' memories")
        unfinished = len(self.scheduler.requests)
        if unfinished:
            raise ValueError(f"{unfinished} request(s) are unfinished: let them finish or abort them before sleep")
        while self._in_flight:  # steps of requests aborted since
            self._collect()
        self.reset_prefix_cache()
        self.runner.sleep(keep_weights=level == 1)
        if self.draft is not None:
            self.draft.runner.sleep(keep_weights=True)
        self.sleep_level = level
        logger.info("asleep (level %d): the KV pool and the weights left the devices", level)

    def wake_up(self) -> None:
        """Take the devices back after `sleep` (nothing happens awake): zeroed KV pools and the weights, from host
        memory, or read from what `update_weights` gave while asleep, or after level 2 from the folder they came
        from. ValueError, still asleep, after level 2 with no folder to read them from (the served weights came
        from arrays, a converted folder or random): give them with `update_weights` first."""
        if not self.sleep_level:
            return
        source = self._wake_source
        if source is None and self.sleep_level == 2:
            if self._weights_folder is None:
                raise ValueError("wake_up: the weights were discarded (sleep level 2) and came from no Hugging Face "
                                 "folder the engine can read again: give them with update_weights(...) first")
            source = self._weights_folder
        self.runner.wake_up(source)
        if self.draft is not None:
            self.draft.runner.wake_up()
        self.sleep_level, self._wake_source = 0, None
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
            "lora": self._lora_stats(),
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


@dataclasses.dataclass(frozen=True)
class LoadedLora:
    """A LoRA adapter in a slot of the params (model/lora.py)."""

    slot: int
    request: LoRARequest  # how it was asked for (its name and folder)
    key: str  # unique to this load: what the prefix cache keys the adapter's pages by


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


def enable_compilation_cache(cache_dir: str | None) -> None:
    """Turn on JAX's persistent compilation cache and jaxserve's executable store in `cache_dir`, so a restart
    skips compilation (and, for the step buckets, tracing and lowering)."""
    use_executable_store(cache_dir)
    if not cache_dir:
        return
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    """The configured length, bounded by what the model was trained for."""
    if config.max_model_len is None:
        length = spec.max_position_embeddings
    elif config.max_model_len > spec.max_position_embeddings:
        raise ValueError(
            f"max_model_len ({config.max_model_len}) exceeds the model's max_position_embeddings "
            f"({spec.max_position_embeddings})"
        )
    else:
        length = config.max_model_len
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < length:
        raise ValueError(
            f"without chunked prefill max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= "
            f"max_model_len ({length}); enable chunked prefill or lower max_model_len"
        )
    return length


def bucket_ladders(config: EngineConfig, spec: ModelSpec, max_model_len: int) -> BucketLadders:
    """The padded shapes an engine with this config compiles for."""
    return BucketLadders.build(
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        page_size=config.page_size,
        min_token_bucket=config.min_token_bucket,
        max_aux_extra=MAX_AUX_EXTRA + len(spec.eos_token_ids),
    )


def resolve_num_pages(config: EngineConfig, max_model_len: int, runners: list[Runner]) -> int:
    """Pages from `num_pages`, or what `gpu_memory_utilization` of the device leaves after the weights and the
    largest step's activations (kv/sizing.py), or the CPU's `cpu_kv_cache_gib`. `runners`: the target model's
    and, with a draft model, the draft's; each holds a pool of that many pages, and their steps run one after
    the other, so the peak activation is the largest of theirs."""
    per_page = sum(runner.page_bytes() for runner in runners)
    platform = device_platform()
    if config.num_pages is not None:
        num_pages = config.num_pages
    elif platform == "cpu":
        num_pages = int(config.cpu_kv_cache_gib * 2**30 // per_page)
    else:
        tp = config.tensor_parallel_size
        stats = device_memory_stats(tp)
        if platform == "gpu":
            check_allocator_limit(stats, config.gpu_memory_utilization)
        pool = pages_for_tokens(max_model_len, config.page_size) + 1
        plan = plan_kv_pages(
            device_bytes=device_memory_bytes(stats, platform),
            utilization=config.gpu_memory_utilization,
            used_bytes=int(stats.get("bytes_in_use", 0)),
            activation_bytes=max(runner.peak_activation_bytes(pool) for runner in runners),
            page_bytes=per_page // tp,
        )
        logger.info("KV cache sizing: %s", plan.describe())
        num_pages = plan.num_pages
    check_pool_holds_a_request(num_pages, max_model_len, config.page_size)
    return num_pages


def resolve_num_host_pages(swap_space_gib: float, page_bytes: int) -> int:
    """Pages of the host swap pool that `swap_space_gib` holds, page 0 (never handed out) included; a ValueError
    when that is not one usable page."""
    num_pages = int(swap_space_gib * 2**30 // page_bytes)
    if num_pages < 2:
        raise ValueError(
            f"swap_space={swap_space_gib} GiB does not hold one KV page of {page_bytes} bytes (plus the unused "
            f"page 0): raise swap_space to at least {2 * page_bytes / 2**30:.6g} GiB or use preemption_mode recompute"
        )
    return num_pages


def check_pool_holds_a_request(num_pages: int, max_model_len: int, page_size: int) -> None:
    """ValueError when a pool of `num_pages` cannot hold one request of `max_model_len` plus the null page."""
    needed = pages_for_tokens(max_model_len, page_size) + 1
    if num_pages < needed:
        raise ValueError(
            f"the KV pool of {num_pages} pages cannot hold one request of max_model_len={max_model_len} "
            f"({needed - 1} pages of {page_size} tokens plus the null page): raise num_pages or the "
            f"memory for the cache, or lower max_model_len"
        )


def device_platform() -> str:
    """The platform the engine runs on: 'cpu', 'gpu' or 'tpu'."""
    return jax.default_backend()


def device_memory_stats(num_devices: int) -> dict:
    """The memory stats of the most loaded of the engine's devices (the pool is the same size on each)."""
    stats = [device.memory_stats() or {} for device in jax.devices()[:num_devices]]
    return max(stats, key=lambda s: s.get("bytes_in_use", 0))
