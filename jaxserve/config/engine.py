"""EngineConfig: every engine option, composed of typed parts that each check themselves.

Users name options flat, as vLLM's engine arguments (`LLM(max_num_seqs=8)`, a YAML key, `--max-num-seqs`); the
engine reads them by part (`config.scheduler_config.max_num_seqs`):

    EngineConfig(page_size=32, max_num_seqs=8, speculative_config={"method": "ngram"})
      .model_config              ModelConfig             model, dtype, quantization, runner, ...
      .cache_config              CacheConfig             page_size, num_pages, kv_cache_dtype, ...
      .scheduler_config          SchedulerConfig         max_num_seqs, max_num_batched_tokens, ...
      .parallel_config           ParallelConfig          tensor_parallel_size, multi-host, ...
      .speculative_config        SpeculativeConfig|None  method, num_speculative_tokens, ...
      .lora_config               LoraConfig              enable_lora, max_loras, ...
      .structured_outputs_config StructuredOutputsConfig enable_structured_outputs, reasoning_parser, ...
      .compilation_config        CompilationConfig       attention_backend, skip_precompile, ...
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, NamedTuple

import yaml

from jaxserve.config.cache import CacheConfig
from jaxserve.config.compilation import CompilationConfig
from jaxserve.config.lora import LoraConfig
from jaxserve.config.model import ModelConfig
from jaxserve.config.options import OptionDoc, doc_of
from jaxserve.config.parallel import ParallelConfig
from jaxserve.config.scheduler import SchedulerConfig, SchedulerSettings
from jaxserve.config.speculative import SPECULATIVE_HELP, SpeculativeConfig
from jaxserve.config.structured_outputs import StructuredOutputsConfig

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")
DEFAULT_MODEL_CONFIG = os.path.join(CONFIGS_DIR, "tiny-cpu.yaml")  # settings for the bundled model


def shipped_configs() -> list[str]:
    """The names of the launch configs that ship with jaxserve (configs/*.yaml, without the extension)."""
    return sorted(name.removesuffix(".yaml") for name in os.listdir(CONFIGS_DIR) if name.endswith(".yaml"))


def resolve_config_path(path: str) -> str:
    """`path` when it names a file; else the shipped config it names (`tiny-cpu`, `tiny-cpu.yaml`,
    `configs/tiny-cpu.yaml`: reachable from any install); ValueError listing the shipped ones when neither."""
    if os.path.isfile(path):
        return path
    shipped = os.path.join(CONFIGS_DIR, os.path.basename(path).removesuffix(".yaml") + ".yaml")
    if os.path.isfile(shipped):
        return shipped
    raise ValueError(f"no config file {path}; the shipped configs, named without a path (`jaxserve check-config "
                     f"--list` says what each is for): {', '.join(shipped_configs())}")
# the parts whose fields are options, by attribute; speculative_config is one option whose value is a mapping
PARTS = {"model_config": ModelConfig, "cache_config": CacheConfig, "scheduler_config": SchedulerConfig,
         "parallel_config": ParallelConfig, "lora_config": LoraConfig,
         "structured_outputs_config": StructuredOutputsConfig, "compilation_config": CompilationConfig}
SPECULATIVE_OPTION = "speculative_config"
_PART_OF = {field.name: part for part, cls in PARTS.items() for field in dataclasses.fields(cls)}
OPTION_NAMES = (*_PART_OF, SPECULATIVE_OPTION)  # every option, each once


class EngineOption(NamedTuple):
    """One option as the command line shows it."""

    name: str
    part: str  # the EngineConfig attribute of its part
    doc: OptionDoc
    default: Any
    annotation: str  # its type, as the part's source spells it


@dataclasses.dataclass(frozen=True, init=False)
class EngineConfig:
    """Every engine option (OPTION_NAMES), given flat by keyword; `model=None` means the bundled small model."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    speculative_config: SpeculativeConfig | None
    lora_config: LoraConfig
    structured_outputs_config: StructuredOutputsConfig
    compilation_config: CompilationConfig

    def __init__(self, **options: Any):
        _check_names(options, "EngineConfig")
        for part, cls in PARTS.items():
            values = {name: value for name, value in options.items() if _PART_OF.get(name) == part}
            object.__setattr__(self, part, cls(**values))
        object.__setattr__(self, SPECULATIVE_OPTION, SpeculativeConfig.from_option(options.get(SPECULATIVE_OPTION)))
        self._check_across_parts()

    def _check_across_parts(self) -> None:
        """ValueError for options of different parts that do not fit together."""
        cache, scheduler, speculative = self.cache_config, self.scheduler_config, self.speculative_config
        if scheduler.preemption_mode != "recompute" and cache.swap_space == 0:
            raise ValueError(f"preemption_mode {scheduler.preemption_mode} needs swap_space > 0 (GiB of host memory)")
        if self.parallel_config.distributed_coordinator is not None and scheduler.preemption_mode != "recompute":
            raise ValueError(f"preemption_mode {scheduler.preemption_mode} keeps swapped pages in one host's memory: "
                             f"a multi-host engine preempts by recompute")
        if speculative is not None:
            if scheduler.num_scheduler_steps > 1:
                raise ValueError("speculative_config and num_scheduler_steps > 1 are alternatives: choose one")
            if speculative.uses_eagle and cache.kv_cache_dtype == "fp8":
                raise ValueError(f"speculative_config method {speculative.method} keeps the target's features beside "
                                 f"its KV pages, in their dtype: use kv_cache_dtype auto with it")

    def options(self) -> dict[str, Any]:
        """Every option's value by its flat name (what `EngineConfig(**options)` takes back)."""
        values = {name: getattr(getattr(self, part), name) for name, part in _PART_OF.items()}
        values[SPECULATIVE_OPTION] = None if self.speculative_config is None else self.speculative_config.as_option()
        return values

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with the options `changes` (flat names) changed, checked again."""
        _check_names(changes, "EngineConfig.replace")
        return EngineConfig(**{**self.options(), **changes})

    @staticmethod
    def option_docs() -> list[EngineOption]:
        """Every option with its documentation, part by part: what the command line is made of."""
        docs = [EngineOption(field.name, part, doc_of(field), field.default, field.type)
                for part, cls in PARTS.items() for field in dataclasses.fields(cls)]
        speculative = OptionDoc(SPECULATIVE_HELP, default_text="off")
        return docs + [EngineOption(SPECULATIVE_OPTION, SPECULATIVE_OPTION, speculative, None, "dict | None")]

    @classmethod
    def from_yaml(cls, path: str, defaults: dict | None = None, /, **overrides) -> EngineConfig:
        """Load a YAML file whose keys are options (a path, or a shipped config's name: `tiny-cpu`); the file wins
        over `defaults`, `overrides` win over the file (positional-only parameters: an option named like one is still
        refused as unknown). ValueError, in one line, for a file that is missing or not YAML."""
        path = resolve_config_path(path)
        try:
            with open(path) as f:
                values = yaml.safe_load(f) or {}
        except OSError as error:
            raise ValueError(f"cannot read the config file {path}: {error.strerror}") from error
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(error, "problem", None) or str(error)
            raise ValueError(f"the config file {path} is not valid YAML{where}: {problem}") from error
        if not isinstance(values, dict):
            raise ValueError(f"{path}: a config file must be a mapping of option: value")
        return cls.from_dict({**(defaults or {}), **values, **overrides}, source=path)

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> EngineConfig:
        """Build from a dict of options; unknown keys are an error that names the nearest valid ones."""
        _check_names(values, source)
        return cls(**values)

    @classmethod
    def for_model(cls, model: str | None, config_path: str | None = None, defaults: dict | None = None, /,
                  **overrides) -> EngineConfig:
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
        return self.cache_config.enable_prefix_caching and self.scheduler_config.batching == "continuous"

    @property
    def num_speculative_tokens(self) -> int:
        """Tokens proposed per request and step (0 without speculative decoding)."""
        return 0 if self.speculative_config is None else self.speculative_config.num_speculative_tokens

    def scheduler_settings(self, max_model_len: int) -> SchedulerSettings:
        """What the scheduler reads, with the resolved max_model_len."""
        scheduler = self.scheduler_config
        return SchedulerSettings(
            max_num_seqs=scheduler.max_num_seqs,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=scheduler.enable_chunked_prefill,
            policy=scheduler.scheduling_policy,
            static_batching=scheduler.batching == "static",
            num_scheduler_steps=scheduler.num_scheduler_steps,
            preemption_mode=scheduler.preemption_mode,
            max_preemptions=scheduler.max_preemptions,
            num_speculative_tokens=self.num_speculative_tokens,
        )


def _check_names(options: dict, source: str) -> None:
    """ValueError for names that are no option: the nearest valid ones, then all of them."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if not unknown:
        return
    hints = [f"{name} (did you mean {', '.join(close)}?)" if (close := difflib.get_close_matches(name, OPTION_NAMES, 2))
             else name for name in unknown]
    raise ValueError(f"{source}: unknown option(s) {', '.join(hints)}; valid options: {', '.join(OPTION_NAMES)}")
