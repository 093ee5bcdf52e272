"""LLMEngine: prompts and SamplingParams in, RequestOutputs out; validation happens here, once."""

from __future__ import annotations

import gc
import os
import random
import time

from jaxserve.config import EngineConfig
from jaxserve.engine_core import MAX_STOP_TOKEN_IDS, EngineCore
from jaxserve.output_processor import OutputProcessor
from jaxserve.outputs import RequestOutput
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import load_tokenizer

ASSETS_DIR = os.path.join(os.path.dirname(__file__), "assets")
DEFAULT_MODEL_NAME = "tiny-stdlib-llama"

Prompt = str | list[int]


def default_model_path() -> str:
    """The small model that ships inside the package."""
    path = os.path.join(ASSETS_DIR, DEFAULT_MODEL_NAME)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"no model given and the bundled default model is missing at {path}; pass model=PATH")
    return path


class LLMEngine:
    """Tokenizes and validates requests, drives EngineCore, and detokenizes its results."""

    def __init__(self, config: EngineConfig, show_progress: bool = True):
        self.config = config
        self.model_path = config.model or default_model_path()
        if not os.path.isdir(self.model_path):
            raise ValueError(f"model folder {self.model_path!r} does not exist")
        self.core = EngineCore(config, self.model_path, show_progress)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._seed_rng = random.Random(config.seed)
        # Start-up leaves hundreds of thousands of long-lived objects (jax, transformers, executables);
        # freezing them keeps every later full garbage collection from walking them (pauses of
        # ~0.3 s mid-generation otherwise).
        gc.collect()
        gc.freeze()

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) a request may reach."""
        return self.core.max_model_len

    def tokenize_prompt(self, prompt: Prompt, tokenizer=None) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text or as token ids; ValueError when invalid.

        Text is encoded with `tokenizer` (default: the engine's), so another thread can bring its own.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, (tokenizer or self.tokenizer).encode(prompt)
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab_size = self.core.spec.vocab_size
        for token_id in token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
                raise ValueError(f"prompt token id {token_id!r} is outside the vocabulary [0, {vocab_size})")
        return None, token_ids

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, priority: int = 0
    ) -> None:
        """Validate and queue a request (its `n` samples become `n` engine requests)."""
        children = self.make_requests(request_id, prompt, params or SamplingParams(), priority)
        self.submit(request_id, children)

    def make_requests(
        self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0, tokenizer=None,
    ) -> tuple[str | None, list[Request]]:
        """Validate a request and build its engine requests without queueing them; returns (text, children).

        `tokenizer` encodes a text prompt (default: the engine's).
        """
        text, token_ids = self.tokenize_prompt(prompt, tokenizer)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}: it must be "
                f"shorter so at least one token can be generated"
            )
        self._check_stop_token_ids(params)
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival = time.monotonic()
        children = []
        for index in range(params.n):
            seed = params.seed + index if params.seed is not None else self._seed_rng.getrandbits(32)
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            children.append(Request(
                request_id=child_id, prompt_token_ids=token_ids, sampling_params=params,
                eos_token_ids=self._eos_ids(), seed=seed, max_tokens=max_tokens,
                arrival_time=arrival, priority=priority,
            ))
        return text, children

    def submit(self, request_id: str, made: tuple[str | None, list[Request]]) -> None:
        """Queue engine requests built by `make_requests`."""
        text, children = made
        self.output_processor.add_request(request_id, text, children)
        for child in children:
            self.core.add_request(child)

    def _check_stop_token_ids(self, params: SamplingParams) -> None:
        vocab_size = self.core.spec.vocab_size
        if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may name at most {MAX_STOP_TOKEN_IDS} ids")
        bad = [t for t in params.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")

    def _eos_ids(self) -> tuple[int, ...]:
        """EOS ids from the generation config, else the tokenizer's."""
        if self.core.spec.eos_token_ids:
            return self.core.spec.eos_token_ids
        eos = self.tokenizer.eos_token_id
        return () if eos is None else (eos,)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a user request: its pages return at once; returns its final output (or None if unknown)."""
        self.core.finish_requests(self.output_processor.child_ids(request_id), RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while anything waits or runs."""
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step; outputs for the user requests that moved."""
        changed = self.core.step()
        outputs, stopped = self.output_processor.process(changed)
        self.core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def stats(self) -> dict:
        """Engine counters (see EngineCore.stats)."""
        return self.core.stats()
