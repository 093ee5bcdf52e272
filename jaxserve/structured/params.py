"""`StructuredOutputsParams`: what a request's output must match, in vLLM's shape (exactly one of `json`, `regex`,
`choice`, `grammar`, `json_object`, `structural_tag`)."""

from __future__ import annotations

import dataclasses
import json

MAX_SPEC_CHARS = 100_000  # a schema, regex or grammar longer than this is refused (compile time and memory)
MAX_CHOICES = 1024
MAX_PATTERN_CHARS = 1000  # a whitespace_pattern longer than this is refused
KINDS = ("json", "regex", "choice", "grammar", "structural_tag")  # with json_object, the kinds of constraint
JSON_KINDS = ("json", "json_object", "structural_tag")  # the kinds whose JSON the whitespace rules shape
STRUCTURAL_TAG_FORM = ('{"type": "structural_tag", "structures": [{"begin": "<function=f>", "schema": {...}, '
                       '"end": "</function>"}, ...], "triggers": ["<function=", ...]}')


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams` (formerly `GuidedDecodingParams`): the output is a JSON value matching
    the `json` schema (a dict or its JSON text), a full match of `regex`, one of the `choice` strings, a sentence
    of the Lark `grammar` (llguidance's dialect; GBNF is converted), any JSON object (`json_object`), or free text
    in which each structure of the `structural_tag` (vLLM's JSON text, or its object) is entered when the text
    reaches one of its triggers: its `begin`, JSON matching its `schema`, its `end`, then free text again."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # a list is taken too (kept as a tuple)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None  # kept as its canonical JSON text
    # JSON (a structural tag's too) without whitespace between tokens beyond ", " and ": " (vLLM's flag; jaxserve's
    # default is True, where vLLM's is False: a model's answer then cannot wander into whitespace before max_tokens)
    disable_any_whitespace: bool = True
    # JSON only (a structural tag's too): a regex of the whitespace allowed between JSON tokens, where there is any
    # (vLLM's `whitespace_pattern`, formerly `guided_whitespace_pattern`); given, it replaces disable_any_whitespace's
    # rule
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        kinds = [name for name in KINDS if getattr(self, name) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError("structured outputs take exactly one of json, regex, choice, grammar, json_object or "
                             f"structural_tag; got {', '.join(kinds) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"json must be a JSON schema (an object or its JSON text), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string")
        if self.choice is not None:
            if not 0 < len(self.choice) <= MAX_CHOICES or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"choice must be 1 to {MAX_CHOICES} non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.structural_tag is not None:
            object.__setattr__(self, "structural_tag", _canonical_structural_tag(self.structural_tag))
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"the {self.kind} constraint is longer than {MAX_SPEC_CHARS} characters")
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str) or len(self.whitespace_pattern) > MAX_PATTERN_CHARS:
                raise ValueError(f"whitespace_pattern must be a regex of at most {MAX_PATTERN_CHARS} characters")
            if self.kind not in JSON_KINDS:
                raise ValueError(f"whitespace_pattern is for JSON constraints ({', '.join(JSON_KINDS)}), not "
                                 f"{self.kind}")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice, grammar, json_object or structural_tag."""
        if self.json_object:
            return "json_object"
        return next(name for name in KINDS if getattr(self, name) is not None)

    @property
    def spec(self) -> str:
        """The constraint as text: the schema's canonical JSON, the regex, the choices' JSON list, the grammar, the
        structural tag's canonical JSON."""
        value = getattr(self, self.kind) if self.kind != "json_object" else True
        if self.kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"json is not valid JSON: {error}") from None
        if self.kind in ("regex", "grammar", "structural_tag"):
            return value
        return json.dumps(value if self.kind != "choice" else list(value), sort_keys=True)

    @property
    def key(self) -> tuple[str, str, bool | str]:
        """(kind, spec, whitespace rule): equal for constraints that compile to the same grammar (the compile
        cache's key)."""
        whitespace = self.disable_any_whitespace if self.whitespace_pattern is None else self.whitespace_pattern
        return self.kind, self.spec, whitespace

    @property
    def structures(self) -> list[tuple[str, str, dict, str]]:
        """A structural tag's structures as (trigger, begin, schema, end), the trigger of each the first of the
        tag's triggers its begin starts with (vLLM's rule)."""
        tag = json.loads(self.structural_tag)
        return [(next(t for t in tag["triggers"] if s["begin"].startswith(t)), s["begin"], s["schema"], s["end"])
                for s in tag["structures"]]


def _canonical_structural_tag(value: str | dict) -> str:
    """The canonical JSON text of a structural tag in vLLM's form (`STRUCTURAL_TAG_FORM`, its JSON text or the
    object); ValueError that says what to send for anything else."""
    send = f"send {STRUCTURAL_TAG_FORM}"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"structural_tag is not valid JSON ({error}); {send}") from None
    if not isinstance(value, dict):
        raise ValueError(f"structural_tag must be a JSON object, got {type(value).__name__}; {send}")
    if "format" in value:
        raise ValueError("structural_tag: xgrammar's {\"type\": \"structural_tag\", \"format\": ...} form is not "
                         f"supported (the grammar engine is llguidance); {send}")
    if value.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"structural_tag: type must be \"structural_tag\", got {value['type']!r:.40}; {send}")
    _known_keys("structural_tag", value, ("type", "structures", "triggers"), send)
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"structural_tag: triggers must be a list of non-empty strings; {send}")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"structural_tag: structures must be a non-empty list; {send}")
    for index, structure in enumerate(structures):
        where = f"structural_tag: structures[{index}]"
        if not isinstance(structure, dict):
            raise ValueError(f"{where} must be an object; {send}")
        _known_keys(where, structure, ("begin", "schema", "end"), send)
        if not all(isinstance(structure.get(key), str) for key in ("begin", "end")) or not structure["begin"]:
            raise ValueError(f"{where} needs a non-empty string begin and a string end; {send}")
        if not isinstance(structure.get("schema"), dict):
            raise ValueError(f"{where} needs a schema, a JSON schema object; {send}")
        if not any(structure["begin"].startswith(trigger) for trigger in triggers):
            raise ValueError(f"{where}: the trigger of begin {structure['begin']!r:.80} is not found in triggers "
                             f"{triggers!r:.200} (a begin must start with one of them)")
    return json.dumps({"type": "structural_tag", "structures": structures, "triggers": triggers}, sort_keys=True)


def _known_keys(where: str, value: dict, known: tuple[str, ...], send: str) -> None:
    """ValueError for keys of `value` not among `known`."""
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{where} has unknown keys {', '.join(map(repr, unknown))}; {send}")
