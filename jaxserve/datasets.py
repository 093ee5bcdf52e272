"""Prompt datasets the engine reads itself: the ShareGPT sample bundled with jaxserve.bench (for KV-scale
calibration and the benchmarks' workloads) or a ShareGPT JSON file of the user's."""

from __future__ import annotations

import json
import os
from importlib import resources

_BUNDLED_SHAREGPT = "data/sharegpt_sample.json"  # inside the jaxserve.bench package


def load_sharegpt(path: str | None) -> tuple[str, list]:
    """(a name for messages, the conversations) of a ShareGPT JSON file; the bundled sample when `path` is
    None."""
    if path is None:
        name = f"the bundled {os.path.basename(_BUNDLED_SHAREGPT)}"
        text = resources.files("jaxserve.bench").joinpath(_BUNDLED_SHAREGPT).read_text(encoding="utf-8")
    else:
        name = path
        with open(path, encoding="utf-8") as f:
            text = f.read()
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError(f"{name} is not in the ShareGPT format: expected a JSON list of conversations")
    return name, data
