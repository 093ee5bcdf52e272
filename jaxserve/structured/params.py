"""`StructuredOutputsParams`: what a request's output must match, in vLLM's shape (exactly one of `json`, `regex`,
`choice`, `grammar`, `json_object`)."""

from __future__ import annotations

import dataclasses
import json

MAX_SPEC_CHARS = 100_000  # a schema, regex or grammar longer than this is refused (compile time and memory)
MAX_CHOICES = 1024
MAX_PATTERN_CHARS = 1000  # a whitespace_pattern longer than this is refused


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams` (formerly `GuidedDecodingParams`): the output is a JSON value matching
    the `json` schema (a dict or its JSON text), a full match of `regex`, one of the `choice` strings, a sentence
    of the Lark `grammar` (llguidance's dialect; GBNF is converted), or any JSON object (`json_object`)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON without whitespace between tokens beyond ", " and ": " (vLLM's flag; jaxserve's default is True, where
    # vLLM's is False: a model's answer then cannot wander into whitespace before max_tokens)
    disable_any_whitespace: bool = True
    # JSON only: a regex of the whitespace allowed between JSON tokens, where there is any (vLLM's
    # `whitespace_pattern`, formerly `guided_whitespace_pattern`); given, it replaces disable_any_whitespace's rule
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError("structured outputs take exactly one of json, regex, choice, grammar or json_object; "
                             f"got {', '.join(kinds) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"json must be a JSON schema (an object or its JSON text), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string")
        if self.choice is not None:
            if not 0 < len(self.choice) <= MAX_CHOICES or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"choice must be 1 to {MAX_CHOICES} non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"the {self.kind} constraint is longer than {MAX_SPEC_CHARS} characters")
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str) or len(self.whitespace_pattern) > MAX_PATTERN_CHARS:
                raise ValueError(f"whitespace_pattern must be a regex of at most {MAX_PATTERN_CHARS} characters")
            if self.kind not in ("json", "json_object"):
                raise ValueError(f"whitespace_pattern is for JSON constraints (json, json_object), not {self.kind}")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice, grammar or json_object."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)

    @property
    def spec(self) -> str:
        """The constraint as text: the schema's canonical JSON, the regex, the choices' JSON list, the grammar."""
        value = getattr(self, self.kind) if self.kind != "json_object" else True
        if self.kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"json is not valid JSON: {error}") from None
        if self.kind in ("regex", "grammar"):
            return value
        return json.dumps(value if self.kind != "choice" else list(value), sort_keys=True)

    @property
    def key(self) -> tuple[str, str, bool | str]:
        """(kind, spec, whitespace rule): equal for constraints that compile to the same grammar (the compile
        cache's key)."""
        whitespace = self.disable_any_whitespace if self.whitespace_pattern is None else self.whitespace_pattern
        return self.kind, self.spec, whitespace
