"""LLMEngine: prompts and SamplingParams in, RequestOutputs out; validation happens here, once."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping

from jaxserve.config import EngineConfig
from jaxserve.engine.core import EngineCore
from jaxserve.engine.host_gc import freeze_start_up_objects
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.request_maker import ModelFacts, Prompt, RequestMaker, prefix_salt, reasoning_parser
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import PoolingRequestOutput, RequestOutput
from jaxserve.pooling.params import PoolingParams
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import load_tokenizer

logger = logging.getLogger("jaxserve")
ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets")
DEFAULT_MODEL_NAME = "tiny-stdlib-llama"


def default_model_path() -> str:
    """The small model that ships inside the package."""
    path = os.path.join(ASSETS_DIR, DEFAULT_MODEL_NAME)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"no model given and the bundled default model is missing at {path}; pass model=PATH")
    return path


def model_facts(core: EngineCore) -> ModelFacts:
    """What checking and building requests needs of `core`'s model."""
    spec = core.spec
    return ModelFacts(vocab_size=spec.vocab_size, classifier=spec.classifier, eos_token_ids=tuple(spec.eos_token_ids),
                      reasoning_parser=spec.reasoning_parser, max_model_len=core.max_model_len, pooler=core.pooler,
                      matryoshka_dimensions=core.matryoshka_dimensions)


def core_placement(core: EngineCore, cache_salt: str | None, lora_name: str | None) -> tuple[str | None, int]:
    """A request's prefix-cache salt and LoRA slot (-1: the base model) under the adapters and weights `core` has
    loaded now; ValueError for an adapter that is not loaded."""
    lora = None if lora_name is None else core.lora_slots.get(lora_name)
    salt = prefix_salt(cache_salt, None if lora is None else lora.key, core.weights.version)
    return salt, -1 if lora is None else lora.slot


class LLMEngine:
    """Tokenizes and validates requests, drives EngineCore, and detokenizes its results."""

    def __init__(self, config: EngineConfig, show_progress: bool = True, first_device: int = 0):
        """The engine of `config` (over devices from `first_device` on: a data-parallel replica's). On a follower
        of a multi-host launch (`process_id` > 0) this serves the leader's steps and ends the process when the
        leader stops (SystemExit(0)): a script run on every host goes past it on the leader only."""
        self.config = config
        self.model_path = config.model_config.model or default_model_path()
        if not os.path.isdir(self.model_path):
            raise ValueError(f"model folder {self.model_path!r} does not exist")
        self.tokenizer = load_tokenizer(config.model_config.tokenizer or self.model_path)
        # A reasoning model's markers (engine/reasoning.py), checked against the tokenizer before anything loads.
        if config.structured_outputs_config.reasoning_parser is not None:
            reasoning_parser(config.structured_outputs_config.reasoning_parser, self.tokenizer)
        self.core = EngineCore(config, self.model_path, show_progress, first_device)
        if not self.core.is_leader:
            self.core.follow_leader()
            raise SystemExit(0)
        # (placed by a function of the core alone: a cycle back to this engine would outlive it, frozen below)
        self.requests = RequestMaker(config, self.model_path, self.tokenizer, model_facts(self.core),
                                     functools.partial(core_placement, self.core))
        self.reasoning = self.requests.reasoning  # how replies split into thinking and answer (None: they do not)
        self.output_processor = OutputProcessor(self.tokenizer)
        freeze_start_up_objects()  # no later full garbage collection walks them (engine/host_gc.py)

    @property
    def generation_defaults(self) -> dict:
        """SamplingParams field -> the model's default, for the fields a request leaves unset."""
        return self.requests.generation_defaults

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults in the fields it sets."""
        return self.requests.default_sampling_params()

    def tokenize_prompt(self, prompt: Prompt, tokenizer=None) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text or as token ids (RequestMaker.tokenize_prompt)."""
        return self.requests.tokenize_prompt(prompt, tokenizer)

    def make_requests(
        self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0, tokenizer=None,
        cache_salt: str | None = None, lora_name: str | None = None,
    ) -> tuple[str | None, list[Request]]:
        """Validate a request and build its engine requests without queueing them (RequestMaker.make_requests)."""
        return self.requests.make_requests(request_id, prompt, params, priority, tokenizer, cache_salt, lora_name)

    def make_pooling_requests(
        self, request_id: str, prompt: Prompt, params: PoolingParams | None = None, priority: int = 0,
        tokenizer=None, cache_salt: str | None = None, lora_name: str | None = None, task: str = "embed",
    ) -> tuple[str | None, list[Request]]:
        """Validate a pooling request and build its engine request without queueing it
        (RequestMaker.make_pooling_requests)."""
        return self.requests.make_pooling_requests(request_id, prompt, params, priority, tokenizer, cache_salt,
                                                   lora_name, task)

    @property
    def grammars(self):
        """The structured-output compiler for this engine's tokenizer (RequestMaker.grammars)."""
        return self.requests.grammars

    def on_peer_lost(self, callback) -> None:
        """Call `callback(reason)` when a process of this multi-host launch goes (never in one process)."""
        self.core.on_peer_lost(callback)

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) a request may reach."""
        return self.core.max_model_len

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request (its `best_of` samples, `n` unless set, become as many engine requests),
        run with the LoRA adapter of `lora_request` (loaded first if it is not yet)."""
        lora_name = None if lora_request is None else self.add_lora(lora_request)
        children = self.make_requests(request_id, prompt, params or self.default_sampling_params(), priority,
                                      lora_name=lora_name)
        self.submit(request_id, children)

    def add_lora(self, lora_request: LoRARequest) -> str:
        """Load a LoRA adapter into a free slot (vLLM's `add_lora`; nothing happens for one already loaded);
        returns its name. ValueError when it cannot be (see EngineCore.add_lora)."""
        self.core.add_lora(lora_request)
        return lora_request.lora_name

    def remove_lora(self, name: str) -> None:
        """Free the slot of the LoRA adapter loaded as `name` (vLLM's `remove_lora`, by name); ValueError while an
        unfinished request runs with it."""
        self.core.remove_lora(name)

    def list_loras(self) -> dict[str, str]:
        """The loaded LoRA adapters: name -> PEFT folder."""
        return {name: loaded.request.lora_path for name, loaded in self.core.lora_slots.loaded.items()}

    def submit(self, request_id: str, made: tuple[str | None, list[Request]]) -> None:
        """Queue engine requests built by `make_requests`."""
        text, children = made
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        self.output_processor.add_request(request_id, text, children)
        try:
            for child in children:
                self.core.add_request(child)
        except Exception:
            self.abort_request(request_id)  # nothing of a request that could not be queued stays behind
            raise

    def abort_request(self, request_id: str) -> RequestOutput | PoolingRequestOutput | None:
        """Abort a user request: its pages return at once; returns its final output (or None if unknown)."""
        self.core.finish_requests(self.output_processor.child_ids(request_id), RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort(request_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV page (pages in use stay in use); returns how many were forgotten."""
        return self.core.reset_prefix_cache()

    def kv_page_states(self) -> list[list[int]]:
        """The KV pool's map, run-length encoded (EngineCore.kv_page_states)."""
        return self.core.kv_page_states()

    def update_weights(self, source: str | Mapping[str, object]) -> int:
        """Serve new weights of the same model from now on (EngineCore.update_weights); returns the weights
        version (updates so far)."""
        return self.core.update_weights(source)

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool's and the weights' device memory until `wake_up` (EngineCore.sleep)."""
        self.core.sleep(level)

    def wake_up(self) -> None:
        """Take the devices back after `sleep` (EngineCore.wake_up)."""
        self.core.wake_up()

    def is_sleeping(self) -> bool:
        """True between `sleep` and `wake_up`."""
        return bool(self.core.weights.sleep_level)

    def has_unfinished_requests(self) -> bool:
        """True while anything waits or runs."""
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """One engine step; outputs for the user requests that moved."""
        timing = self.core.timing
        with timing.measure("step"):
            changed = self.core.step()
        with timing.measure("output"):
            outputs, to_finish = self.output_processor.process(changed)
            for request_id, status in to_finish:
                self.core.finish_requests([request_id], status)
        return outputs

    def stats(self) -> dict:
        """Engine counters (see EngineCore.stats)."""
        return self.core.stats()
