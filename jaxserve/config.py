"""Engine configuration: one flat, frozen dataclass whose field names follow vLLM's engine arguments."""

from __future__ import annotations

import dataclasses
import json
import os

import yaml

from jaxserve.pooling.params import PoolerConfig

VALID_PAGE_SIZES = (8, 16, 32)
VALID_DTYPES = ("auto", "float32", "bfloat16", "float16")
VALID_QUANTIZATIONS = ("none", "int8", "fp8")  # weight-only quantization at load time (model/quantize.py)
# auto: the weights' dtype; fp8: e4m3 pages with per-head scales (attention/fp8.py)
VALID_KV_CACHE_DTYPES = ("auto", "fp8")
VALID_POLICIES = ("fcfs", "priority")
# How a preempted request gives its KV pages back: recompute (drop them; its tokens are computed again when it
# resumes), swap (copy them to a host-memory pool and back when it resumes), auto (swap long contexts).
VALID_PREEMPTION_MODES = ("recompute", "swap", "auto")
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")  # proposers of speculative_config's `method`
EAGLE_METHODS = ("eagle", "eagle3")  # the methods of EAGLE heads (EAGLE-1, EAGLE-3: spec_decode/eagle.py)
SPECULATIVE_DEFAULTS = {"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
VALID_ATTENTION_BACKENDS = ("auto", "xla", "pallas", "pallas-interpret", "pallas-tpu-interpret")
# continuous: requests join and leave the running batch at every step and hold only the pages they fill;
# static: a pre-paging server, the baseline of `jaxserve bench`: a batch is admitted only when the previous
# one has finished, and each sequence reserves pages for max_model_len when it is admitted.
VALID_BATCHING = ("continuous", "static")
# Reasoning models' parsers (vLLM's names; engine/reasoning.py): a constrained request's grammar applies after the
# thinking, and the server splits chat replies into reasoning and content.
VALID_REASONING_PARSERS = ("deepseek_r1", "qwen3", "mistral", "openai_gptoss")
# The server's tool call parsers (vLLM's names; server/tools.py's TOOL_PARSERS), named here for the CLI, which does
# not import the server.
VALID_TOOL_CALL_PARSERS = ("hermes", "llama3_json", "qwen3_coder", "mistral", "pythonic", "granite",
                           "phi4_mini_json", "openai")
# generate: the engine samples tokens; pooling: it also compiles the pooling buckets, and serves embeddings (a
# prompt's final hidden states pooled into one vector, pooling/) beside generation, or a sequence classifier's
# classes; auto: pooling for a sequence classifier, else generate (vLLM's `runner`).
VALID_RUNNERS = ("auto", "generate", "pooling")
# What sampled tokens' logprobs report (vLLM's logprobs_mode; sampling/sampler.py): the raw model distribution's
# log-probabilities or logits, or those of the processed distribution each row samples from (penalties, biases,
# bans, allowed tokens and a grammar's mask applied; for a sampled row also its temperature, min-p, top-k, top-p).
VALID_LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
VALID_LOAD_FORMATS = ("auto", "dummy")  # dummy: random weights made on the device (vLLM's name), for benchmarks
DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "xla")
CONFIGS_DIR = os.path.join(os.path.dirname(__file__), "configs")
DEFAULT_MODEL_CONFIG = os.path.join(CONFIGS_DIR, "tiny-cpu.yaml")  # settings for the bundled model


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs; plain values so the scheduler never imports jax."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    static_batching: bool = False
    num_scheduler_steps: int = 1  # decode iterations per step when every row is a plain decode
    preemption_mode: str = "recompute"  # auto: swap a victim with more computed tokens than the step budget
    # priority: a request preempted this many times in a row is not preempted by another again until it yields
    max_preemptions: int = 3
    num_speculative_tokens: int = 0  # most proposals a decode verifies per step (0: no speculative decoding)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every engine option. `model=None` means the small model that ships with jaxserve."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    page_size: int = 16
    num_pages: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 0.5
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    min_token_bucket: int = 8
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1
    # A mixture of experts: split the experts whole over the devices instead of each expert (vLLM's flag).
    enable_expert_parallel: bool = False
    # Requests may constrain their output (structured output): the sampler's buckets with a token bitmask are
    # compiled too. Off: fewer executables, and a constrained request is refused.
    enable_structured_outputs: bool = True
    # A reasoning model's parser (VALID_REASONING_PARSERS; None: the model does not think): structured output
    # constrains the text after the thinking, and chat replies carry the thinking in `reasoning`.
    reasoning_parser: str | None = None
    # Structured output constrains the thinking too, from the reply's first token (vLLM's structured outputs
    # option enable_in_reasoning): for a grammar that spells out the whole reply, a reasoning model's format included.
    structured_outputs_in_reasoning: bool = False
    # vLLM's reasoning config: {"reasoning_end_str": TEXT}, the text forced when a request's thinking_token_budget
    # runs out (a transition phrase, then the parser's end of thinking); default: the parser's end of thinking alone.
    reasoning_config: dict | None = None
    # What logprobs report (VALID_LOGPROBS_MODES): raw_logprobs (default), raw_logits, or the processed distribution
    # a token was sampled from (an RL trainer's importance ratios), as logprobs or logits. Prompt logprobs stay raw.
    logprobs_mode: str = "raw_logprobs"
    attention_backend: str = "auto"
    seed: int = 0
    compilation_cache_dir: str | None = DEFAULT_CACHE_DIR  # JAX's persistent cache; the executable store inside
    # Compile each bucket at its first use instead of all at start-up: a quick start for development and
    # tests; a request of a shape not yet compiled then waits for its compile (tpu-inference's
    # SKIP_JAX_PRECOMPILE). Off in serving: every step after start-up runs a compiled executable.
    skip_precompile: bool = False
    # Ready early: compile first the largest buckets (which serve any step), start serving, and compile the others on
    # a background thread, each step padded into the largest buckets until its own are ready (plain generation; with
    # multi-step decoding, speculation or pooling every bucket compiles first). `jaxserve serve`'s default.
    background_compile: bool = False
    generation_config: str = "auto"  # "auto" (the model's generation_config.json), "vllm" (none) or a folder
    batching: str = "continuous"
    load_format: str = "auto"
    # Plan step N + 1 while the device runs step N (its samples reach step N + 1 on the device).
    async_scheduling: bool = True
    # Multi-step decoding: a step whose rows all decode runs up to this many forward + sample iterations
    # in one device call (vLLM's old option name).
    num_scheduler_steps: int = 1
    # Preemption (vLLM's names): recompute, swap (to a host pool of swap_space GiB) or auto (swap the contexts
    # longer than max_num_batched_tokens, whose recompute would take more than one step's budget).
    preemption_mode: str = "recompute"
    swap_space: float = 4.0
    # scheduling_policy priority: a request preempted this many times in a row is not preempted by another
    # request again until it finishes or yields (preempts itself for lack of pages).
    max_preemptions: int = 3
    # Speculative decoding (vLLM's shape): {method: ngram | draft_model | eagle, model (the draft's or the EAGLE
    # head's folder), num_speculative_tokens, prompt_lookup_min, prompt_lookup_max (ngram)}; None: off. The missing
    # keys take SPECULATIVE_DEFAULTS; a config with a `model` and no `method` is draft_model.
    speculative_config: dict | None = None
    # Weight-only quantization of the linear layers at load time (model/quantize.py): none, int8 or fp8 (vLLM's
    # name; None means none).
    quantization: str | None = "none"
    # The KV pages' dtype (vLLM's field): auto (the weights' dtype) or fp8 (e4m3, one scale per layer and KV head:
    # the checkpoint's k_scale/v_scale, else 1.0; attention/fp8.py).
    kv_cache_dtype: str = "auto"
    # kv_cache_dtype fp8: compute the scales at start-up from a calibration pass over a bundled text
    # (model/kv_calibration.py) instead of taking the checkpoint's (or 1.0).
    calculate_kv_scales: bool = False
    # Multi-host (distributed/): one process per host on JAX's distributed runtime, process 0 the leader (scheduler,
    # tokenizer, HTTP) and the coordinator's host; "auto" lets jax.distributed.initialize() read what a cluster
    # launcher (SLURM, Open MPI, a TPU pod, Kubernetes) set. None: one process.
    distributed_coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    # Seconds a process waits for the others at start-up (the coordinator, every process's registration, the
    # leader's step channel); a lost process is noticed at once through the step channel.
    distributed_timeout_s: float = 60.0
    # Engine replicas over disjoint sets of tensor_parallel_size devices behind one front end (vLLM's name).
    data_parallel_size: int = 1
    # LoRA adapters served with the base model (model/lora.py; vLLM's names): max_loras resident at once (slots),
    # each of rank up to max_lora_rank; lora_modules {name: PEFT folder} loaded at start-up (a request names one).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: dict | None = None
    # What the engine runs for (VALID_RUNNERS) and, with pooling, how it pools (vLLM's names): {pooling_type: LAST |
    # MEAN | CLS, normalize}; None: what the model folder's sentence-transformers files say, else LAST, normalized.
    runner: str = "auto"
    pooler_config: dict | None = None
    # Sleep mode (vLLM's name): `sleep` frees the KV pool and the weights' device memory between uses (a trainer
    # sharing the devices), `wake_up` takes them back.
    enable_sleep_mode: bool = False

    def __post_init__(self):
        _check_choice("page_size", self.page_size, VALID_PAGE_SIZES)
        _check_choice("dtype", self.dtype, VALID_DTYPES)
        _check_choice("scheduling_policy", self.scheduling_policy, VALID_POLICIES)
        _check_choice("attention_backend", self.attention_backend, VALID_ATTENTION_BACKENDS)
        _check_choice("batching", self.batching, VALID_BATCHING)
        _check_choice("load_format", self.load_format, VALID_LOAD_FORMATS)
        _check_choice("preemption_mode", self.preemption_mode, VALID_PREEMPTION_MODES)
        _check_choice("runner", self.runner, VALID_RUNNERS)
        if self.pooler_config is not None:
            object.__setattr__(self, "pooler_config", _checked_pooler_config(self.pooler_config))
            if self.runner == "generate":  # (runner auto: checked against the model, runs_pooling)
                raise ValueError("pooler_config is for runner pooling: set runner pooling too")
        if self.quantization is None:
            object.__setattr__(self, "quantization", "none")
        _check_choice("quantization", self.quantization, VALID_QUANTIZATIONS)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, VALID_KV_CACHE_DTYPES)
        if self.reasoning_parser is not None:
            _check_choice("reasoning_parser", self.reasoning_parser, VALID_REASONING_PARSERS)
        if self.reasoning_config is not None:
            object.__setattr__(self, "reasoning_config", _checked_reasoning_config(self.reasoning_config))
        _check_choice("logprobs_mode", self.logprobs_mode, VALID_LOGPROBS_MODES)
        if not isinstance(self.calculate_kv_scales, bool):
            raise ValueError(f"calculate_kv_scales must be true or false, got {self.calculate_kv_scales!r}")
        if self.calculate_kv_scales and self.kv_cache_dtype != "fp8":
            raise ValueError("calculate_kv_scales computes the fp8 KV cache's scales: set kv_cache_dtype fp8 too")
        if not isinstance(self.swap_space, (int, float)) or not 0 <= self.swap_space < float("inf"):
            raise ValueError(f"swap_space must be a finite number of GiB >= 0, got {self.swap_space!r}")
        if self.preemption_mode != "recompute" and self.swap_space == 0:
            raise ValueError(f"preemption_mode {self.preemption_mode} needs swap_space > 0 (GiB of host memory)")
        if not isinstance(self.max_preemptions, int) or self.max_preemptions < 1:
            raise ValueError(f"max_preemptions must be an integer >= 1, got {self.max_preemptions!r}")
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", _checked_speculative_config(self.speculative_config))
            if self.num_scheduler_steps > 1:
                raise ValueError("speculative_config and num_scheduler_steps > 1 are alternatives: choose one")
            method = self.speculative_config["method"]
            if method in EAGLE_METHODS and self.kv_cache_dtype == "fp8":
                raise ValueError(f"speculative_config method {method} keeps the target's features beside its KV "
                                 f"pages, in their dtype: use kv_cache_dtype auto with it")
        for name in ("async_scheduling", "skip_precompile", "background_compile", "enable_lora", "enable_sleep_mode"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "min_token_bucket",
                     "num_scheduler_steps", "max_loras", "max_lora_rank"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise ValueError(
                f"generation_config must be auto, vllm or a folder holding generation_config.json; "
                f"got {self.generation_config!r}"
            )
        _check_distributed(self)
        _check_lora_modules(self)
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) must be <= max_num_batched_tokens "
                f"({self.max_num_batched_tokens}): every scheduled sequence takes at least one token"
            )

    @classmethod
    def from_yaml(cls, path: str, defaults: dict | None = None, /, **overrides) -> "EngineConfig":
        """Load a YAML file whose keys are this dataclass's fields; the file wins over `defaults`, `overrides` win
        over the file (positional-only parameters: an option named like one is still refused as unknown)."""
        with open(path) as f:
            values = yaml.safe_load(f) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{path}: a config file must be a mapping of option: value")
        return cls.from_dict({**(defaults or {}), **values, **overrides}, source=path)

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> "EngineConfig":
        """Build from a dict; unknown keys are an error that lists the valid ones."""
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise ValueError(f"{source}: unknown option(s) {', '.join(unknown)}; valid options: {', '.join(valid)}")
        return cls(**values)

    @classmethod
    def for_model(cls, model: str | None, config_path: str | None = None, defaults: dict | None = None, /,
                  **overrides) -> "EngineConfig":
        """The config a user asked for: a YAML file (the bundled model's when no model is given) over `defaults` (a
        command's own), with explicit options on top."""
        if model is not None:
            overrides["model"] = model
        if config_path is None and overrides.get("model") is None:
            config_path = DEFAULT_MODEL_CONFIG
        if config_path is None:
            return cls.from_dict({**(defaults or {}), **overrides})
        return cls.from_yaml(config_path, defaults, **overrides)

    @property
    def prefix_caching(self) -> bool:
        """Whether the KV pools (the target's and a draft model's) cache prefixes: enable_prefix_caching, under
        continuous batching (static batching is the pre-paging baseline: it shares no pages, so it caches none)."""
        return self.enable_prefix_caching and self.batching == "continuous"

    @property
    def num_speculative_tokens(self) -> int:
        """Tokens proposed per request and step (0 without speculative decoding)."""
        return self.speculative_config["num_speculative_tokens"] if self.speculative_config else 0

    def check_one_replica(self, where: str) -> None:
        """ValueError when `data_parallel_size` asks for replicas where only one engine runs (`where`)."""
        if self.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size > 1 is for `jaxserve serve` (replicas behind one front end); "
                             f"{where} runs one engine: run one per set of devices")

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's slice of the config, with the resolved max_model_len."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            policy=self.scheduling_policy,
            static_batching=self.batching == "static",
            num_scheduler_steps=self.num_scheduler_steps,
            preemption_mode=self.preemption_mode,
            max_preemptions=self.max_preemptions,
            num_speculative_tokens=self.num_speculative_tokens,
        )


def _mapping_option(name: str, value, valid: tuple[str, ...]) -> dict:
    """An option that is a mapping (or the command line's JSON of one) of the keys `valid`; a ValueError naming
    what to fix."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a mapping, got {value!r}")
    unknown = sorted(set(value) - set(valid))
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(valid)}")
    return value


def runs_pooling(config: EngineConfig, spec) -> bool:
    """Whether an engine of `config` over the model of `spec` (a ModelSpec) pools: runner pooling, or auto over a
    sequence classifier; a ValueError for runner generate over a classifier, which has no LM head, and for a
    pooler_config given to an engine that does not pool."""
    if spec.classifier is not None and config.runner == "generate":
        raise ValueError(f"the model is a sequence classifier ({spec.classifier.counted}, no LM head): it "
                         f"classifies and cannot generate; start it with runner pooling (or auto)")
    pooling = config.runner == "pooling" or spec.classifier is not None
    if config.pooler_config is not None and not pooling:
        raise ValueError("pooler_config is for runner pooling: set runner pooling too")
    return pooling


def _checked_reasoning_config(value) -> dict:
    """reasoning_config: its one key, reasoning_end_str, a non-empty string (the parser knows where the thinking
    starts)."""
    value = _mapping_option("reasoning_config", value, ("reasoning_end_str",))
    end = value.get("reasoning_end_str")
    if not isinstance(end, str) or not end:
        raise ValueError(f"reasoning_config reasoning_end_str must be a non-empty string, got {end!r}")
    return value


def _checked_pooler_config(value) -> dict:
    """pooler_config checked against PoolerConfig's keys and values (pooling/params.py)."""
    value = _mapping_option("pooler_config", value, tuple(f.name for f in dataclasses.fields(PoolerConfig)))
    PoolerConfig(**value)
    return value


def _checked_speculative_config(config) -> dict:
    """speculative_config with its defaults filled in; a ValueError naming what to fix."""
    config = {**SPECULATIVE_DEFAULTS, **_mapping_option("speculative_config", config,
                                                         ("method", "model", *SPECULATIVE_DEFAULTS))}
    if "method" not in config and "model" in config:
        config["method"] = "draft_model"
    _check_choice("speculative_config method", config.get("method"), SPECULATIVE_METHODS)
    if config["method"] == "draft_model" and not isinstance(config.get("model"), str):
        raise ValueError("speculative_config method draft_model needs `model`: the folder of a smaller model with "
                         "the target's tokenizer")
    if config["method"] in EAGLE_METHODS and not isinstance(config.get("model"), str):
        raise ValueError(f"speculative_config method {config['method']} needs `model`: the folder of an EAGLE head "
                         f"trained for the target")
    if config["method"] == "ngram" and "model" in config:
        raise ValueError("speculative_config method ngram takes no `model` (use method draft_model)")
    for key in SPECULATIVE_DEFAULTS:
        if not isinstance(config[key], int) or isinstance(config[key], bool) or config[key] < 1:
            raise ValueError(f"speculative_config {key} must be an integer >= 1, got {config[key]!r}")
    if config["prompt_lookup_min"] > config["prompt_lookup_max"]:
        raise ValueError(f"speculative_config prompt_lookup_min ({config['prompt_lookup_min']}) must be <= "
                         f"prompt_lookup_max ({config['prompt_lookup_max']})")
    return config


def _check_distributed(config: EngineConfig) -> None:
    """ValueError for launch arguments that do not fit together (multi-host, data parallel)."""
    for name in ("num_processes", "data_parallel_size"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not isinstance(config.process_id, int) or not 0 <= config.process_id < config.num_processes:
        raise ValueError(f"process_id must be in [0, num_processes) = [0, {config.num_processes}), "
                         f"got {config.process_id!r}")
    if not 0 < config.distributed_timeout_s < float("inf"):
        raise ValueError(f"distributed_timeout_s must be a positive number of seconds, got {config.distributed_timeout_s!r}")
    coordinator = config.distributed_coordinator
    if coordinator is None:
        if config.num_processes > 1:
            raise ValueError(f"num_processes {config.num_processes} needs distributed_coordinator: process 0's "
                             f"HOST:PORT (or auto, from the cluster launcher's environment)")
        return
    if coordinator != "auto":
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"distributed_coordinator must be HOST:PORT (process 0's address) or auto, "
                             f"got {coordinator!r}")
        if config.num_processes == 1:
            raise ValueError("distributed_coordinator is set but num_processes is 1: give every process "
                             "--num-processes N and its own --process-id")
    if config.data_parallel_size > 1:
        raise ValueError("data_parallel_size > 1 runs replicas in one process: for replicas of a multi-host "
                         "engine, launch one multi-host engine per replica behind a router (docs/deployment.md)")
    if config.preemption_mode != "recompute":
        raise ValueError(f"preemption_mode {config.preemption_mode} keeps swapped pages in one host's memory: "
                         f"a multi-host engine preempts by recompute")


def _check_lora_modules(config: EngineConfig) -> None:
    """ValueError when lora_modules is malformed or does not fit the LoRA options."""
    modules = config.lora_modules
    if modules is None:
        return
    if not isinstance(modules, dict) or not all(isinstance(k, str) and k and isinstance(v, str)
                                                for k, v in modules.items()):
        raise ValueError(f"lora_modules must map adapter names to PEFT folders, got {modules!r}")
    if modules and not config.enable_lora:
        raise ValueError("lora_modules needs enable_lora: true")
    if len(modules) > config.max_loras:
        raise ValueError(f"lora_modules names {len(modules)} adapters but max_loras is {config.max_loras}: raise "
                         f"max_loras (each adapter takes a resident slot)")


def _check_choice(name: str, value, choices: tuple) -> None:
    """ValueError naming the option and its valid values."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")
