"""The speculative decoding part of the engine's config (vLLM's speculative_config, a mapping on the command line and
in YAML)."""

from __future__ import annotations

import dataclasses

from jaxserve.config.options import check_choice, mapping_option

SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")  # the proposers
EAGLE_METHODS = ("eagle", "eagle3")  # the methods of EAGLE heads (EAGLE-1, EAGLE-3: spec_decode/eagle.py)
# The option as a user writes it: a mapping (JSON on the command line) of SpeculativeConfig's fields.
SPECULATIVE_HELP = ('speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                    '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' or \'{"method": "draft_model", '
                    '"model": "DRAFT_FOLDER", "num_speculative_tokens": 3}\' (methods: '
                    + ", ".join(SPECULATIVE_METHODS) + ")")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How decodes are speculated: a proposer (`method`) and how many tokens it proposes per step."""

    method: str
    model: str | None = None  # the draft's or the EAGLE head's folder (draft_model, eagle, eagle3)
    num_speculative_tokens: int = 3  # tokens proposed per request and step
    prompt_lookup_min: int = 2  # ngram: the shortest n-gram matched against the context
    prompt_lookup_max: int = 4  # ngram: the longest

    def __post_init__(self):
        check_choice("speculative_config method", self.method, SPECULATIVE_METHODS)
        if self.method == "draft_model" and not isinstance(self.model, str):
            raise ValueError("speculative_config method draft_model needs `model`: the folder of a smaller model with "
                             "the target's tokenizer")
        if self.method in EAGLE_METHODS and not isinstance(self.model, str):
            raise ValueError(f"speculative_config method {self.method} needs `model`: the folder of an EAGLE head "
                             f"trained for the target")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config method ngram takes no `model` (use method draft_model)")
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {key} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def from_option(cls, value) -> SpeculativeConfig | None:
        """The part from the speculative_config option: a mapping, its JSON, or None (off). A mapping with a `model`
        and no `method` is draft_model."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = mapping_option("speculative_config", value, tuple(f.name for f in dataclasses.fields(cls)))
        if "method" not in value:
            if "model" not in value:
                raise ValueError(f"speculative_config needs a method: one of {', '.join(SPECULATIVE_METHODS)}")
            value = {**value, "method": "draft_model"}
        return cls(**value)

    @property
    def uses_eagle(self) -> bool:
        """Whether the proposer is an EAGLE head (which reads the target's hidden states)."""
        return self.method in EAGLE_METHODS

    def as_option(self) -> dict:
        """The option's mapping form (what a YAML file would say)."""
        return {name: value for name, value in dataclasses.asdict(self).items() if value is not None}
