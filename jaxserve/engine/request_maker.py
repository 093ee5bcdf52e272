"""RequestMaker: a request's prompt tokenized and its options checked against the model, then built into the engine
`Request`s of its samples. The in-process engine and the front end of an engine-core process (engine/core_client.py)
each hold one: the front end answers a bad request before it leaves the process, and the core process builds the
requests it runs again from the same arguments (with its own LoRA slots and weights version)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import logging
import random
import time
from collections.abc import Callable

from jaxserve.config import EngineConfig
from jaxserve.engine.generation_config import load_generation_defaults
from jaxserve.engine.harmony import HarmonyReasoning
from jaxserve.engine.reasoning import ReasoningParser, with_budget_end
from jaxserve.model_spec import ClassifierHead
from jaxserve.pooling.params import CLASSIFIER_TASKS, POOLING_TASKS, PoolerConfig, PoolingParams, check_dimensions
from jaxserve.pooling.pooled import PER_TOKEN, PooledPrompt
from jaxserve.request import Request
from jaxserve.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from jaxserve.structured.constraint import ReplyConstraint, ThinkingSection

logger = logging.getLogger("jaxserve")

Prompt = str | list[int]
# An embedding request runs its prompt and samples nothing (its one sampler row is dropped).
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=0, temperature=0.0, detokenize=False)
_TASK_NAMES = {"classify": "classification", "score": "scoring a pair", "token_classify": "token classification"}
# (the user's cache salt, the LoRA adapter's name) -> (the prefix-cache salt, the adapter's slot or -1)
Placement = Callable[[str | None, str | None], tuple[str | None, int]]


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What checking and building a request needs of the loaded model, fixed once the engine has started."""

    vocab_size: int
    classifier: ClassifierHead | None  # a sequence classifier's head: it classifies and cannot generate
    eos_token_ids: tuple[int, ...]  # from the generation config (empty: the tokenizer's)
    reasoning_parser: str | None  # the architecture's own reasoning parser (ModelSpec.reasoning_parser)
    max_model_len: int
    pooler: PoolerConfig | None  # runner pooling: how prompts are pooled (None: the engine generates)
    matryoshka_dimensions: tuple[int, ...] | None  # the sizes a Matryoshka model may cut embeddings to


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


def reasoning_parser(name: str, tokenizer) -> ReasoningParser | HarmonyReasoning:
    """The reasoning parser `name` (config's VALID_REASONING_PARSERS) for `tokenizer`; ValueError when the tokenizer
    lacks its markers."""
    return HarmonyReasoning.load(tokenizer) if name == "openai_gptoss" else ReasoningParser.load(name, tokenizer)


def load_reasoning(config: EngineConfig, tokenizer, model_default: str | None
                   ) -> ReasoningParser | HarmonyReasoning | None:
    """The engine's reasoning parser: the one `config` names, else the architecture's own (`model_default`, when the
    tokenizer has its markers, with a warning when not), with reasoning_config's end string; ValueError for a
    reasoning_config without a parser."""
    named = config.structured_outputs_config.reasoning_parser
    parser = None
    if named is not None:
        parser = reasoning_parser(named, tokenizer)
    elif model_default is not None:
        try:
            parser = reasoning_parser(model_default, tokenizer)
            logger.info("reasoning parser %s (the model's own; set reasoning_parser to choose another)", model_default)
        except ValueError as error:
            logger.warning("no reasoning parser: %s", error)
    reasoning_end = config.structured_outputs_config.reasoning_end_str
    if reasoning_end is not None:
        if parser is None:
            raise ValueError("reasoning_config is for a reasoning model: set reasoning_parser too")
        parser = with_budget_end(parser, reasoning_end, tokenizer)
    return parser


class RequestMaker:
    """Checks requests against the model and the engine's options and builds their samples' `Request`s."""

    def __init__(self, config: EngineConfig, model_path: str, tokenizer, facts: ModelFacts, placement: Placement):
        """`placement(cache_salt, lora_name)` gives a request's prefix-cache salt and LoRA slot (ValueError for an
        adapter that is not loaded)."""
        self.config = config
        self.tokenizer = tokenizer
        self.facts = facts
        self.placement = placement
        self.reasoning = load_reasoning(config, tokenizer, facts.reasoning_parser)
        # SamplingParams field -> the model's default, for the fields a request leaves unset (vLLM's rule).
        self.generation_defaults = load_generation_defaults(config.model_config.generation_config, model_path)
        self._seed_rng = random.Random(config.model_config.seed)

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
        vocab_size = self.facts.vocab_size
        for token_id in token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
                raise ValueError(f"prompt token id {token_id!r} is outside the vocabulary [0, {vocab_size})")
        return None, token_ids

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
        classifier = self.facts.classifier
        if classifier is not None:
            raise ValueError(f"the model is a sequence classifier ({classifier.counted}, no LM head): it "
                             f"cannot generate text; classify with LLM.classify or POST /classify")
        tokenizer = tokenizer or self.tokenizer
        text, token_ids = self._prompt_tokens(prompt, params.truncate_prompt_tokens, tokenizer, params.truncation_side)
        if len(token_ids) >= self.facts.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {self.facts.max_model_len}: it must be "
                f"shorter so at least one token can be generated"
            )
        self._check_vocabulary(params)
        salt, lora_slot = self._placement(priority, cache_salt, lora_name)
        bad_words = bad_words_token_ids(tokenizer, params.bad_words or [])
        room = self.facts.max_model_len - len(token_ids)
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
                cache_salt=salt, lora_slot=lora_slot,
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
        classifier = self.facts.classifier
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
        pooler = self.facts.pooler
        if pooler is None:
            raise ValueError("embeddings need an engine started with runner pooling (--runner pooling); this one "
                             "runs generate")
        params = params or PoolingParams()
        params.check_task(task)
        check_dimensions(params.dimensions, self.facts.matryoshka_dimensions)
        text, token_ids = self._prompt_tokens(prompt, params.truncate_prompt_tokens, tokenizer or self.tokenizer)
        if len(token_ids) > self.facts.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is {self.facts.max_model_len}: "
                             f"shorten it, or set truncate_prompt_tokens")
        salt, lora_slot = self._placement(priority, cache_salt, lora_name)
        normalize = pooler.normalize if params.normalize is None else params.normalize
        activation = None  # an embedding
        if classifier is not None:
            activation = classifier.score_activation if task == "score" else classifier.activation
            if params.use_activation is False:
                activation = "identity"
        request = Request(
            request_id=request_id, prompt_token_ids=token_ids, sampling_params=POOLING_SAMPLING_PARAMS,
            eos_token_ids=(), seed=0, max_tokens=0, priority=priority, cache_salt=salt,
            lora_slot=lora_slot,
            pooled=PooledPrompt(PER_TOKEN if task.startswith("token_") else pooler.pooling_type, normalize,
                                params.dimensions, activation),
        )
        return text, [request]

    def _prompt_tokens(self, prompt: Prompt, truncate_prompt_tokens: int | None, tokenizer, side: str = "left"
                       ) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt, only `truncate_prompt_tokens` ids when that is set: its last (`side`
        "left") or its first ("right")."""
        text, token_ids = self.tokenize_prompt(prompt, tokenizer)
        if truncate_prompt_tokens is not None:
            token_ids = token_ids[-truncate_prompt_tokens:] if side == "left" else token_ids[:truncate_prompt_tokens]
        return text, token_ids

    def _placement(self, priority: int, cache_salt: str | None, lora_name: str | None):
        """(the prefix-cache salt, the LoRA slot or -1) of a request, its priority, salt and adapter checked: a
        ValueError naming what to fix."""
        if isinstance(priority, bool) or not isinstance(priority, int) or not INT64_MIN <= priority <= INT64_MAX:
            raise ValueError(f"priority must be an int in [{INT64_MIN}, {INT64_MAX}], got {priority!r}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt or cache_salt[0] == "\0"):
            raise ValueError(f"cache_salt must be a non-empty string not starting with NUL when given, got "
                             f"{cache_salt!r}")
        return self.placement(cache_salt, lora_name)

    @functools.cached_property
    def grammars(self):
        """The structured-output compiler (structured/grammar.py) for this tokenizer, made on the first constrained
        request: the grammar engine is imported only by engines that serve one."""
        from jaxserve.structured.grammar import GrammarCompiler

        return GrammarCompiler(self.tokenizer, self.facts.vocab_size)

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

    def _check_vocabulary(self, params: SamplingParams) -> None:
        """ValueError naming the field when a token id of `params` is outside the vocabulary."""
        vocab_size = self.facts.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} names token ids {bad[:8]} outside the vocabulary [0, {vocab_size})")

    def _eos_ids(self) -> tuple[int, ...]:
        """EOS ids from the generation config, else the tokenizer's."""
        if self.facts.eos_token_ids:
            return self.facts.eos_token_ids
        eos = self.tokenizer.eos_token_id
        return () if eos is None else (eos,)
