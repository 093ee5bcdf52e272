"""The model's sampling defaults from its `generation_config.json`, applied as vLLM does.

vLLM's `--generation-config auto` (the default) reads `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty` and `max_new_tokens` (as `max_tokens`) from the model folder and uses them for
every field a request leaves unset; `vllm` ignores the file; a folder path reads that folder's file.
"""

from __future__ import annotations

import json
import os

from jaxserve.sampling_params import SamplingParams

# generation_config.json key -> SamplingParams field
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_generation_defaults(setting: str, model_path: str) -> dict[str, float | int]:
    """SamplingParams fields -> the model's defaults, for `setting` "auto", "vllm" or a folder.

    ValueError when the file holds a value SamplingParams would refuse.
    """
    if setting == "vllm":
        return {}
    folder = model_path if setting == "auto" else setting
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        config = json.load(f)
    defaults = {field: config[key] for key, field in _FIELDS.items() if config.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as error:
        raise ValueError(f"{path}: a sampling default is out of range: {error}") from error
    return defaults
