"""The compilation part of the engine's config: the attention kernels, the step buckets, and when they compile."""

from __future__ import annotations

import dataclasses
import os

from jaxserve.config.options import SERVE_ONLY, check_bools, check_choice, check_positive_ints, option

VALID_ATTENTION_BACKENDS = ("auto", "xla", "pallas", "pallas-interpret", "pallas-tpu-interpret")
DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "xla")


@dataclasses.dataclass(frozen=True)
class CompilationConfig:
    """How the step functions are built and compiled (vLLM's CompilationConfig and attention backend)."""

    attention_backend: str = option(
        "auto", "xla (plain jnp), pallas (the platform's Pallas kernels), pallas-interpret / pallas-tpu-interpret "
        "(interpreted on the CPU, for tests), auto (pallas where the kernels take the shape, else xla)",
        choices=VALID_ATTENTION_BACKENDS)
    compilation_cache_dir: str | None = option(
        DEFAULT_CACHE_DIR, "JAX's persistent compilation cache folder, with jaxserve's executable store inside "
        "(empty: neither)", default_text="~/.cache/jaxserve/xla")
    skip_precompile: bool = option(
        False, "compile each bucket at its first use instead of all at start-up (a quick start: the first request "
        "of each new shape waits for its compile)")
    background_compile: bool = option(
        False, "compile the largest buckets first and serve, the others on a background thread, each step padded "
        "into the largest until its own are ready", commands=SERVE_ONLY)
    min_token_bucket: int = option(8, "smallest padded token count of a step")
    min_page_bucket: int = option(
        1, "smallest padded page-table width of a step, in pages (widths are x4 rungs from it up to max_model_len's "
        "pages, at most those; larger: fewer programs to compile, more pages gathered per row)")

    def __post_init__(self):
        check_choice("attention_backend", self.attention_backend, VALID_ATTENTION_BACKENDS)
        check_bools(self, "skip_precompile", "background_compile")
        check_positive_ints(self, "min_token_bucket", "min_page_bucket")
