"""The pieces every config part is made of: `option`, a dataclass field that carries its own documentation (the
command line's help is made from it), and the checks the parts run on their values."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# where an option applies: "generate" (`jaxserve generate`, one prompt streamed) and "serve" (the server, and the
# offline LLM, which serve many requests); an option that only matters to many requests is hidden from generate's help
ALL_COMMANDS = ("generate", "serve")
SERVE_ONLY = ("serve",)


@dataclasses.dataclass(frozen=True)
class OptionDoc:
    """What the command line shows of an option.

    Args:
        help: one or two sentences: what the option does, and why one would change it.
        choices: the valid values, when they are few.
        default_text: the default as a person reads it, when the field's default (often None) says less.
        commands: the commands whose `--help` shows it (all accept it).
        metavar: the flag's value as usage shows it.
    """

    help: str
    choices: tuple | None = None
    default_text: str | None = None
    commands: tuple[str, ...] = ALL_COMMANDS
    metavar: str | None = None


def option(default: Any, help: str, *, choices: tuple | None = None, default_text: str | None = None,
           commands: tuple[str, ...] = ALL_COMMANDS, metavar: str | None = None) -> Any:
    """A dataclass field with its default and its documentation (OptionDoc's fields)."""
    doc = OptionDoc(help, choices, default_text, commands, metavar)
    return dataclasses.field(default=default, metadata={"doc": doc})


def doc_of(field: dataclasses.Field) -> OptionDoc:
    """The OptionDoc of a part's field."""
    return field.metadata["doc"]


def check_choice(name: str, value, choices: tuple) -> None:
    """ValueError naming the option and its valid values."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")


def check_bools(part, *names: str) -> None:
    """ValueError for any of `names` on `part` that is not true or false."""
    for name in names:
        if not isinstance(getattr(part, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(part, name)!r}")


def check_positive_ints(part, *names: str) -> None:
    """ValueError for any of `names` on `part` that is not an integer >= 1."""
    for name in names:
        value = getattr(part, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def mapping_option(name: str, value, valid: tuple[str, ...]) -> dict:
    """An option that is a mapping (or the command line's JSON of one) of the keys `valid`; a ValueError naming what
    to fix."""
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
