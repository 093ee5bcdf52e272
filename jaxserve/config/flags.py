"""The engine's command-line flags, made from its options' own documentation (options.py's OptionDoc): one
`--kebab-case` flag per option, grouped by part, its help ending in the command's default."""

from __future__ import annotations

import argparse
import json

from jaxserve.config.engine import PARTS, EngineConfig

CONFIG_HELP = "YAML file whose keys are engine options; flags override it"


def add_engine_flags(parser: argparse.ArgumentParser, command: str, command_defaults: dict | None = None) -> None:
    """Add `--config` and a flag per engine option to `parser`, one group per part of EngineConfig.

    Args:
        parser: the command's parser.
        command: "generate" or "serve": `--help` shows the options that apply to it (every flag is accepted).
        command_defaults: the command's own defaults, shown instead of the options' (the command applies them).
    """
    parser.add_argument("--config", help=CONFIG_HELP)
    command_defaults = command_defaults or {}
    groups = {}
    for option in EngineConfig.option_docs():
        doc = option.doc
        if command not in doc.commands:
            parser.add_argument(_flag(option.name), default=None, help=argparse.SUPPRESS,
                                **_kind(option.name, option.annotation))
            continue
        if option.part not in groups:
            groups[option.part] = parser.add_argument_group(_group_title(option.part), _group_description(option.part))
        if option.name in command_defaults:
            default = _shown(command_defaults[option.name])
        else:
            default = doc.default_text if doc.default_text is not None else _shown(option.default)
        extra = {"metavar": doc.metavar} if doc.metavar else {}
        if doc.choices:
            extra["choices"] = list(doc.choices)
        groups[option.part].add_argument(_flag(option.name), default=None,
                                         help=f"{doc.help} (default: {default})".replace("%", "%%"), **extra,
                                         **_kind(option.name, option.annotation))


def given_engine_options(args: argparse.Namespace) -> dict:
    """The engine options whose flags `args` were given (a flag left out leaves the config file's value)."""
    return {option.name: getattr(args, option.name) for option in EngineConfig.option_docs()
            if getattr(args, option.name) is not None}


def _flag(name: str) -> str:
    """An option's flag: max_num_seqs -> --max-num-seqs."""
    return f"--{name.replace('_', '-')}"


def _group_title(part: str) -> str:
    """A part's heading in --help: structured_outputs_config -> structured outputs options."""
    return part.removesuffix("_config").replace("_", " ") + " options"


def _group_description(part: str) -> str | None:
    """A part's description in --help: the first line of its class's docstring."""
    cls = PARTS.get(part)
    return cls.__doc__.splitlines()[0] if cls is not None and cls.__doc__ else None


def _kind(name: str, annotation: str) -> dict:
    """argparse's type or action for an option of type `annotation` (a string: the parts' annotations)."""
    if name == "lora_modules":
        return dict(nargs="+", action=LoraModulesAction)
    if annotation.startswith("bool"):
        return dict(action=argparse.BooleanOptionalAction)
    if annotation.startswith("int"):
        return dict(type=int)
    if annotation.startswith("float"):
        return dict(type=float)
    return {}  # strings, and mappings as JSON text (each part parses and checks its own)


def _shown(value) -> str:
    """A default as help shows it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


class LoraModulesAction(argparse.Action):
    """--lora-modules NAME=PATH or '{"name": NAME, "path": PATH}' ... (vLLM's two forms) -> {name: path}."""

    def __call__(self, parser, namespace, values, option_string=None):
        modules = {}
        for value in values:
            if value.lstrip().startswith("{"):
                try:
                    entry = json.loads(value)
                except json.JSONDecodeError as error:
                    parser.error(f"{option_string}: not JSON: {error}")
                if not isinstance(entry, dict) or not {"name", "path"} <= set(entry):
                    parser.error(f"{option_string}: a JSON entry needs name and path, got {value!r}")
                name, path = entry["name"], entry["path"]
            elif "=" in value:
                name, path = value.split("=", 1)
            else:
                parser.error(f"{option_string}: expected NAME=PATH or JSON, got {value!r}")
            modules[name] = path
        setattr(namespace, self.dest, modules)
