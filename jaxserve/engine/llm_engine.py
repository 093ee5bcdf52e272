"""LLMEngine: prompts and SamplingParams in, RequestOutputs out; validation happens here, once."""

from __future__ import annotations

import concurrent.futures
import functools
import gc
import json
import logging
import os
import random
import time
from collections.abc import Mapping

from jaxserve.config import EngineConfig
from jaxserve.engine.core import EngineCore
from jaxserve.engine.generation_config import load_generation_defaults
from jaxserve.engine.harmony import HarmonyReasoning
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.reasoning import ReasoningParser, with_budget_end
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import PoolingRequestOutput, RequestOutput
from jaxserve.pooling.params import CLASSIFIER_TASKS, POOLING_TASKS, PoolingParams, check_dimensions
from jaxserve.pooling.pooled import PER_TOKEN, PooledPrompt
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from jaxserve.structured.constraint import ReplyConstraint, ThinkingSection
from jaxserve.tokenizer import load_tokenizer

logger = logging.getLogger("jaxserve")
ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets")
DEFAULT_MODEL_NAME = "tiny-stdlib-llama"

Prompt = str | list[int]
# An embedding request runs its prompt and samples nothing (its one sampler row is dropped).
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=0, temperature=0.0, detokenize=False)
_TASK_NAMES = {"classify": "classification", "score": "scoring a pair", "token_classify": "token classification"}


def default_model_path() -> str:
    """The small model that ships inside the package."""
    path = os.path.join(ASSETS_DIR, DEFAULT_MODEL_NAME)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"no model given and the bundled default model is missing at {path}; pass model=PATH")
    return path


def prefix_salt(cache_salt: str | None, lora_key: str | None, weights_version: int) -> str | None:
    """The prefix-cache salt of a request: its pages hold the KV of the weights and the LoRA adapter it runs with,
    so they are shared only with requests of the same salt, adapter (`lora_key`: that load of it) and weights
    (`weights_version`: updates so far). The user's salt as it is on the base model's first weights; a user's
    salt never starts with NUL, so it never takes an adapter's or earlier weights' pages."""
    if lora_key is None and weights_version == 0:
        return cache_salt
    return "\0" + json.dumps([lora_key, weights_version, cache_salt])


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word tokenized as it would appear at the start of the text and after a space (vLLM's
    two spellings), without special tokens; duplicates dropped."""
    sequences: list[list[int]] = []
    for word in words:
        for spelling in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(spelling, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def _reasoning_parser(name: str, tokenizer) -> ReasoningParser | HarmonyReasoning:
    """The reasoning parser `name` (config's VALID_REASONING_PARSERS) for `tokenizer`; ValueError when the tokenizer
    lacks its markers."""
    return HarmonyReasoning.load(tokenizer) if name == "openai_gptoss" else ReasoningParser.load(name, tokenizer)


def _default_reasoning_parser(name: str, tokenizer) -> ReasoningParser | HarmonyReasoning | None:
    """The parser an architecture's replies need (ModelSpec.reasoning_parser) when the engine names none; None, and a
    warning, when the tokenizer lacks its markers."""
    try:
        parser = _reasoning_parser(name, tokenizer)
    except ValueError as error:
        logger.warning("no reasoning parser: %s", error)
        return None
    logger.info("reasoning parser %s (the model's own; set reasoning_parser to choose another)", name)
    return parser


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
        parser = config.structured_outputs_config.reasoning_parser
        self.reasoning = None if parser is None else _reasoning_parser(parser, self.tokenizer)
        self.core = EngineCore(config, self.model_path, show_progress, first_device)
        if not self.core.is_leader:
            self.core.follow_leader()
            raise SystemExit(0)
        if self.reasoning is None and self.core.spec.reasoning_parser is not None:
            self.reasoning = _default_reasoning_parser(self.core.spec.reasoning_parser, self.tokenizer)
        reasoning_end = config.structured_outputs_config.reasoning_end_str
        if reasoning_end is not None:
            if self.reasoning is None:
                raise ValueError("reasoning_config is for a reasoning model: set reasoning_parser too")
            self.reasoning = with_budget_end(self.reasoning, reasoning_end, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        # SamplingParams field -> the model's default, for the fields a request leaves unset (vLLM's rule).
        self.generation_defaults = load_generation_defaults(config.model_config.generation_config, self.model_path)
        self._seed_rng = random.Random(config.model_config.seed)
        # Start-up leaves hundreds of thousands of long-lived objects (jax, transformers, executables);
        # freezing them keeps every later full garbage collection from walking them (pauses of
        # ~0.3 s mid-generation otherwise).
        gc.collect()
        gc.freeze()

    def on_peer_lost(self, callback) -> None:
        """Call `callback(reason)` when a process of this multi-host launch goes (never in one process)."""
        self.core.on_peer_lost(callback)

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) a request may reach."""
        return self.core.max_model_len

    def tokenize_prompt(self, prompt: Prompt, tokenizer=None) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text or as token ids; ValueError when invalid.

        Text is encoded with `tokenizer` (default: the engine's), so another thread can bring its own.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, (tokenizer or self.tokenizer).encode(prompt)
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab_size = self.core.spec.vocab_size
        for token_id in token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
                raise ValueError(f"prompt token id {token_id!r} is outside the vocabulary [0, {vocab_size})")
        return None, token_ids

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

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults in the fields it sets."""
        return SamplingParams(**self.generation_defaults)

    def make_requests(
        self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0, tokenizer=None,
        cache_salt: str | None = None, lora_name: str | None = None,
    ) -> tuple[str | None, list[Request]]:
        """Validate a request and build its engine requests without queueing them; returns (text, children).

        `tokenizer` encodes a text prompt and bad words (default: the engine's). Requests share cached
        prefix pages only when their `cache_salt`s are equal (vLLM's field) and they run with the same LoRA
        adapter (`lora_name`, one the engine has loaded; None: the base model).
        """
        classifier = self.core.spec.classifier
        if classifier is not None:
            raise ValueError(f"the model is a sequence classifier ({classifier.counted}, no LM head): it "
                             f"cannot generate text; classify with LLM.classify or POST /classify")
        tokenizer = tokenizer or self.tokenizer
        text, token_ids = self._prompt_tokens(prompt, params.truncate_prompt_tokens, tokenizer)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}: it must be "
                f"shorter so at least one token can be generated"
            )
        self._check_vocabulary(params)
        salt, lora = self._placement(priority, cache_salt, lora_name)
        bad_words = bad_words_token_ids(tokenizer, params.bad_words or [])
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival = time.monotonic()
        # best_of samples (n when unset); with best_of > n they also compute their tokens' logprobs, to be ranked.
        num_samples, sample_params = params.num_samples, params.engine_params()
        compiled = self._grammar_compile(params)
        self._check_thinking_budget(params)
        children = []
        for index in range(num_samples):
            seed = params.seed + index if params.seed is not None else self._seed_rng.getrandbits(64)
            child_id = request_id if num_samples == 1 else f"{index}_{request_id}"
            children.append(Request(
                request_id=child_id, prompt_token_ids=token_ids, sampling_params=sample_params,
                eos_token_ids=self._eos_ids(), seed=seed, max_tokens=max_tokens,
                arrival_time=arrival, priority=priority, bad_words_token_ids=bad_words,
                # The samples share their prompt, so only the first computes its logprobs, and the
                # others fork from it once it has computed the prompt.
                prompt_logprobs=[None] if index == 0 and params.prompt_logprobs is not None else None,
                fork_source=None if index == 0 else children[0].request_id,
                cache_salt=salt, lora_slot=-1 if lora is None else lora.slot,
                constraint=self._reply_constraint(token_ids, params, compiled),
            ))
        return text, children

    def make_pooling_requests(
        self, request_id: str, prompt: Prompt, params: PoolingParams | None = None, priority: int = 0,
        tokenizer=None, cache_salt: str | None = None, lora_name: str | None = None, task: str = "embed",
    ) -> tuple[str | None, list[Request]]:
        """Validate a pooling request and build its engine request without queueing it; returns (text, [it]).
        It computes its prompt (up to max_model_len tokens), pools the final hidden states as the engine's pooler
        says (pooling/) and samples nothing: into an embedding (`task` embed) or, on a sequence classifier, into
        class probabilities (classify); token-wise (token_embed, token_classify), every prompt token's. ValueError
        on an engine not started with runner pooling, or for a task the model does not do."""
        classifier = self.core.spec.classifier
        if task not in POOLING_TASKS:
            raise ValueError(f"the pooling task must be one of {', '.join(POOLING_TASKS)}; got {task!r}")
        if task in CLASSIFIER_TASKS and classifier is None:
            raise ValueError(f"{_TASK_NAMES[task]} needs a sequence classifier (an XForSequenceClassification "
                             f"checkpoint); this model gives embeddings: use embed or token_embed")
        if task not in CLASSIFIER_TASKS and classifier is not None:
            raise ValueError(f"the model is a sequence classifier ({classifier.counted}): it pools into "
                             f"class probabilities, not embeddings; use classify or token_classify")
        if classifier is not None and classifier.per_token and task != "token_classify":
            raise ValueError(f"the model is a token classifier (XForTokenClassification, {classifier.counted}): it "
                             f"classifies every token; use token_classify (LLM.reward, or /pooling's default task)")
        if task == "score" and classifier.num_labels != 1:
            raise ValueError(f"scoring a pair needs a cross-encoder (a classifier of one label); this model has "
                             f"{classifier.num_labels} labels: use classify")
        pooler = self.core.pooler
        if pooler is None:
            raise ValueError("embeddings need an engine started with runner pooling (--runner pooling); this one "
                             "runs generate")
        params = params or PoolingParams()
        params.check_task(task)
        check_dimensions(params.dimensions, self.core.matryoshka_dimensions)
        text, token_ids = self._prompt_tokens(prompt, params.truncate_prompt_tokens, tokenizer or self.tokenizer)
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}: "
                             f"shorten it, or set truncate_prompt_tokens")
        salt, lora = self._placement(priority, cache_salt, lora_name)
        normalize = pooler.normalize if params.normalize is None else params.normalize
        activation = None  # an embedding
        if classifier is not None:
            activation = classifier.score_activation if task == "score" else classifier.activation
            if params.use_activation is False:
                activation = "identity"
        request = Request(
            request_id=request_id, prompt_token_ids=token_ids, sampling_params=POOLING_SAMPLING_PARAMS,
            eos_token_ids=(), seed=0, max_tokens=0, priority=priority, cache_salt=salt,
            lora_slot=-1 if lora is None else lora.slot,
            pooled=PooledPrompt(PER_TOKEN if task.startswith("token_") else pooler.pooling_type, normalize,
                                params.dimensions, activation),
        )
        return text, [request]

    def _prompt_tokens(self, prompt: Prompt, truncate_prompt_tokens: int | None, tokenizer
                       ) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt, only its last `truncate_prompt_tokens` ids when that is set."""
        text, token_ids = self.tokenize_prompt(prompt, tokenizer)
        if truncate_prompt_tokens is not None:
            token_ids = token_ids[-truncate_prompt_tokens:]
        return text, token_ids

    def _placement(self, priority: int, cache_salt: str | None, lora_name: str | None):
        """(the prefix-cache salt, the loaded LoRA adapter or None) of a request, its priority, salt and adapter
        checked: a ValueError naming what to fix."""
        if isinstance(priority, bool) or not isinstance(priority, int) or not INT64_MIN <= priority <= INT64_MAX:
            raise ValueError(f"priority must be an int in [{INT64_MIN}, {INT64_MAX}], got {priority!r}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt or cache_salt[0] == "\0"):
            raise ValueError(f"cache_salt must be a non-empty string not starting with NUL when given, got "
                             f"{cache_salt!r}")
        lora = None if lora_name is None else self.core.lora_slots.get(lora_name)
        return prefix_salt(cache_salt, None if lora is None else lora.key, self.core.weights.version), lora

    @functools.cached_property
    def grammars(self):
        """The structured-output compiler (structured/grammar.py) for this engine's tokenizer, made on the first
        constrained request: the grammar engine is imported only by engines that serve one."""
        from jaxserve.structured.grammar import GrammarCompiler

        return GrammarCompiler(self.tokenizer, self.core.spec.vocab_size)

    def _grammar_compile(self, params: SamplingParams) -> concurrent.futures.Future | None:
        """The compile of the request's constraint, started on the compiler's threads (cached: a constraint seen
        before is ready at once); None without one."""
        if params.structured_outputs is None:
            return None
        if not self.config.structured_outputs_config.enable_structured_outputs:
            raise ValueError("structured_outputs: this engine runs with enable_structured_outputs off; start it with "
                             "it on to constrain outputs")
        return self.grammars.submit(params.structured_outputs)

    def _check_thinking_budget(self, params: SamplingParams) -> None:
        """ValueError for a thinking_token_budget this engine cannot keep."""
        if params.thinking_token_budget is None:
            return
        if self.reasoning is None:
            raise ValueError("thinking_token_budget bounds a reasoning model's thinking: start the engine with "
                             "reasoning_parser set to the model's (the markers its thinking ends at)")
        if not self.config.structured_outputs_config.enable_structured_outputs:
            raise ValueError("thinking_token_budget forces the end of thinking through the structured-output token "
                             "mask: start the engine with enable_structured_outputs on")
        in_reasoning = self.config.structured_outputs_config.structured_outputs_in_reasoning
        if params.structured_outputs is not None and in_reasoning:
            raise ValueError("thinking_token_budget cannot bound a thinking that the request's grammar spells out "
                             "(structured_outputs_in_reasoning): bound it in the grammar")

    def _reply_constraint(self, prompt_token_ids: list[int], params: SamplingParams,
                          compiled: concurrent.futures.Future | None) -> ReplyConstraint | None:
        """A new sample's constraint (structured/constraint.py), None when nothing constrains it: its grammar
        (`compiled`) constrains the answer, after a reasoning model's thinking (vLLM's rule, unless
        structured_outputs_in_reasoning: then from the first token), and the thinking's end is forced once its
        thinking_token_budget is spent; a prompt that closed the thinking leaves the reply none."""
        grammar = None if compiled is None else self.grammars.request_grammar(compiled)
        budget = params.thinking_token_budget
        ends_with = opens_with = None
        in_reasoning = self.config.structured_outputs_config.structured_outputs_in_reasoning
        if self.reasoning is not None and (budget is not None or (grammar is not None and not in_reasoning)):
            ends_with, opens_with = self.reasoning.thinking_markers(prompt_token_ids)
        thinking = None if ends_with is None else ThinkingSection(ends_with, opens_with, budget,
                                                                  self.reasoning.budget_end, prompt_token_ids)
        return None if grammar is None and thinking is None else ReplyConstraint(grammar, thinking)

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

    def _check_vocabulary(self, params: SamplingParams) -> None:
        """ValueError naming the field when a token id of `params` is outside the vocabulary."""
        vocab_size = self.core.spec.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} names token ids {bad[:8]} outside the vocabulary [0, {vocab_size})")

    def _eos_ids(self) -> tuple[int, ...]:
        """EOS ids from the generation config, else the tokenizer's."""
        if self.core.spec.eos_token_ids:
            return self.core.spec.eos_token_ids
        eos = self.tokenizer.eos_token_id
        return () if eos is None else (eos,)

    def abort_request(self, request_id: str) -> RequestOutput | PoolingRequestOutput | None:
        """Abort a user request: its pages return at once; returns its final output (or None if unknown)."""
        self.core.finish_requests(self.output_processor.child_ids(request_id), RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort(request_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV page (pages in use stay in use); returns how many were forgotten."""
        return self.core.reset_prefix_cache()

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
