"""Where a bench command's results go besides its printed report."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable


def command_args(args: argparse.Namespace) -> dict:
    """A command's parsed options for its JSON result (the CLI's handler function left out)."""
    return {key: value for key, value in vars(args).items() if not callable(value)}


def write_json(path: str, result: dict | list, log: Callable[[str], None] = print) -> None:
    """Write `result` (JSON-able) to `path`, making its folder, and say so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {path}")
