"""The LoRA part of the engine's config: adapters served with the base model (model/lora.py)."""

from __future__ import annotations

import dataclasses

from jaxserve.config.options import SERVE_ONLY, check_bools, check_positive_ints, option


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Adapter slots and the adapters loaded at start-up (vLLM's LoRAConfig and --lora-modules)."""

    enable_lora: bool = option(False, "serve LoRA adapters with the model (each request may name one)",
                               commands=SERVE_ONLY)
    max_loras: int = option(1, "LoRA adapters resident at once (slots)", commands=SERVE_ONLY)
    max_lora_rank: int = option(16, "largest LoRA rank served", commands=SERVE_ONLY)
    lora_modules: dict | None = option(
        None, 'LoRA adapters (PEFT folders) loaded at start-up, as NAME=PATH or vLLM\'s JSON \'{"name": ..., '
        '"path": ...}\'; a request\'s `model` names one', default_text="none", commands=SERVE_ONLY,
        metavar="NAME=PATH")

    def __post_init__(self):
        check_bools(self, "enable_lora")
        check_positive_ints(self, "max_loras", "max_lora_rank")
        modules = self.lora_modules
        if modules is None:
            return
        if not isinstance(modules, dict) or not all(isinstance(k, str) and k and isinstance(v, str)
                                                    for k, v in modules.items()):
            raise ValueError(f"lora_modules must map adapter names to PEFT folders, got {modules!r}")
        if modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora: true")
        if len(modules) > self.max_loras:
            raise ValueError(f"lora_modules names {len(modules)} adapters but max_loras is {self.max_loras}: raise "
                             f"max_loras (each adapter takes a resident slot)")
