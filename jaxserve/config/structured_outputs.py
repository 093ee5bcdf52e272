"""The structured output part of the engine's config: constrained decoding, and the reasoning parser whose thinking
it leaves free."""

from __future__ import annotations

import dataclasses

from jaxserve.config.options import SERVE_ONLY, check_bools, check_choice, mapping_option, option

# Reasoning models' parsers (vLLM's names; engine/reasoning.py): a constrained request's grammar applies after the
# thinking, and the server splits chat replies into reasoning and content.
VALID_REASONING_PARSERS = ("deepseek_r1", "qwen3", "mistral", "openai_gptoss")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsConfig:
    """Structured output and reasoning (vLLM's StructuredOutputsConfig and ReasoningConfig)."""

    enable_structured_outputs: bool = option(
        True, "compile the sampler for constrained requests too; off: fewer executables, and a constrained request "
        "is refused", commands=SERVE_ONLY)
    reasoning_parser: str | None = option(
        None, "a reasoning model's markers (<think> ... </think>; mistral: [THINK] ... [/THINK]; openai_gptoss: "
        "harmony's channels): structured output constrains the answer after the thinking, and chat replies carry "
        "the thinking in `reasoning`", choices=VALID_REASONING_PARSERS, default_text="none",
        commands=SERVE_ONLY)
    structured_outputs_in_reasoning: bool = option(
        False, "with a reasoning parser, constrain the whole reply, thinking included (vLLM's structured outputs "
        "enable_in_reasoning)", commands=SERVE_ONLY)
    reasoning_config: dict | None = option(
        None, 'vLLM\'s reasoning config as JSON: \'{"reasoning_end_str": "TEXT"}\', the text forced when a '
        'request\'s thinking_token_budget runs out (a transition phrase, then the end of thinking)',
        default_text="the parser's end of thinking alone", commands=SERVE_ONLY)

    def __post_init__(self):
        check_bools(self, "enable_structured_outputs", "structured_outputs_in_reasoning")
        if self.reasoning_parser is not None:
            check_choice("reasoning_parser", self.reasoning_parser, VALID_REASONING_PARSERS)
        if self.reasoning_config is not None:
            value = mapping_option("reasoning_config", self.reasoning_config, ("reasoning_end_str",))
            end = value.get("reasoning_end_str")
            if not isinstance(end, str) or not end:
                raise ValueError(f"reasoning_config reasoning_end_str must be a non-empty string, got {end!r}")
            object.__setattr__(self, "reasoning_config", value)

    @property
    def reasoning_end_str(self) -> str | None:
        """The text forced when a request's thinking budget runs out (None: the parser's end of thinking)."""
        return None if self.reasoning_config is None else self.reasoning_config["reasoning_end_str"]
