"""LLM: the offline batch API, shaped like vLLM's so code can switch between the two."""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence

from tqdm.auto import tqdm

from jaxserve.config import EngineConfig
from jaxserve.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, run_beam_search
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.request_maker import Prompt
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import PoolingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput
from jaxserve.pooling.params import PoolingParams
from jaxserve.pooling.score import cosine_scores, score_pairs
from jaxserve.request import Request
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.tokenizer import encode_text_pair, load_chat_template, render_chat

PromptInput = str | list[int] | dict
# The offline engine's defaults for options neither a keyword nor the model's config file sets: ready once its largest
# buckets compile (any step fits them), the others compiling on a background thread while it generates.
OFFLINE_DEFAULTS = {"background_compile": True}


class LLM:
    """The offline engine (vLLM's `LLM`): batches of prompts run with continuous batching, results in input order.

    Args:
        model: a Hugging Face model folder or a `jaxserve convert` checkpoint; None runs the bundled tiny model with
            the settings of `configs/tiny-cpu.yaml`.
        show_progress: progress bars while the step buckets compile.
        The engine is ready once its largest step buckets compile; the others compile on a background thread while
        it generates, each step padded into the largest until its own are ready (`background_compile=False`
        compiles them all first, `skip_precompile=True` each at its first use).
        **engine_args: engine options (EngineConfig), named as vLLM's engine arguments: `max_num_seqs`,
            `max_model_len`, `page_size`, `tensor_parallel_size`, `dtype`, `seed`, ... (docs/configuration.md).

    Multi-host (`distributed_coordinator`, `num_processes`, `process_id`): run the same script on every host; on
    the followers the constructor serves the leader's steps and ends the process when the leader is done, so what
    follows it runs on the leader (process 0) only.
    """

    def __init__(self, model: str | None = None, *, show_progress: bool = True, **engine_args):
        config = EngineConfig.for_model(model, None, OFFLINE_DEFAULTS, **engine_args)
        config.parallel_config.check_one_replica("the offline LLM")
        self.engine = LLMEngine(config, show_progress=show_progress)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's rule; plain defaults
        under generation_config="vllm"); `generate` uses them when given no sampling params."""
        return self.engine.default_sampling_params()

    def get_tokenizer(self):
        """The Hugging Face tokenizer of the model."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion.

        Args:
            prompts: one prompt or a list: text, token ids, or {'prompt' | 'prompt_token_ids': ...} with an optional
                'cache_salt' (vLLM's key: only requests with equal salts share cached pages).
            sampling_params: one for all prompts or one per prompt; None: the model's generation defaults.
            use_tqdm: a progress bar over the prompts.
            lora_request: a LoRA adapter for all prompts, or one (or None) per prompt, loaded into a free slot when
                it is not yet (the engine needs enable_lora).
        Returns:
            One RequestOutput per prompt, in input order. A bad prompt raises ValueError before anything runs.
        """
        params = sampling_params or self.get_default_sampling_params()
        return self._run_all(self._make_final_only, prompts, params, SamplingParams, lora_request, use_tqdm)

    def _make_final_only(self, request_id: str, prompt: Prompt, params: SamplingParams, **options
                         ) -> tuple[str | None, list[Request]]:
        """LLMEngine.make_requests with the params' output_kind FINAL_ONLY, as vLLM's LLM runs them: `_run` reads
        only final outputs, so no step builds one before. (A shallow copy: the caller's params stay as they are, and
        are checked where they always were.)"""
        if isinstance(params, SamplingParams):
            params = copy.copy(params)
            params.output_kind = RequestOutputKind.FINAL_ONLY
        return self.engine.make_requests(request_id, prompt, params, **options)

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.embed`: each prompt's final hidden states pooled into one vector (the engine needs runner
        pooling).

        Args:
            prompts, use_tqdm, lora_request: as for `generate`.
            pooling_params: one for all prompts or one per prompt (`dimensions`, `normalize`, ...); None: the
                defaults, L2-normalized.
        Returns:
            One PoolingRequestOutput per prompt; `output.outputs.embedding` pooled as the engine's pooler says
            (LAST, MEAN or CLS; pooling/params.py).
        """
        return self._pool("embed", prompts, pooling_params, use_tqdm, lora_request)

    def classify(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.classify` for a sequence classifier: each prompt's class probabilities.

        Args:
            prompts, use_tqdm, lora_request: as for `generate`.
            pooling_params: `PoolingParams(use_activation=False)` gives the raw logits (a reward model's score).
        Returns:
            One PoolingRequestOutput per prompt; `output.outputs.probs` is the model's activation (softmax, or
            sigmoid for one label or multi-label models) of its score head over the last prompt token.
        """
        return self._pool("classify", prompts, pooling_params, use_tqdm, lora_request)

    def encode(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.encode`: each prompt pooled for `pooling_task`.

        Args:
            prompts, pooling_params, use_tqdm, lora_request: as for `embed`.
            pooling_task: required, one of pooling/params.POOLING_TASKS: embed and classify as `embed` and
                `classify` give them; token_embed (each prompt token's final state, cut and normalized as an
                embedding is) and token_classify (each token's class probabilities) are token-wise, and compute
                every prompt token (the prefix cache is not read for them).
        Returns:
            One PoolingRequestOutput per prompt; token-wise tasks give one entry per prompt token in
            `output.outputs.data`.
        """
        return self._pool(pooling_task, prompts, pooling_params, use_tqdm, lora_request)

    def reward(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.reward`: `encode` with pooling_task token_classify, a reward model's per-token scores."""
        return self._pool("token_classify", prompts, pooling_params, use_tqdm, lora_request)

    def score(
        self,
        data_1: PromptInput | Sequence[PromptInput],
        data_2: PromptInput | Sequence[PromptInput],
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score`: the score of each pair of texts (the engine needs runner pooling).

        Args:
            data_1: one text, scored against every text of `data_2`, or as many texts as `data_2`, paired in order
                (the forms `generate` takes; a cross-encoder's: strings).
            data_2: the other side of the pairs.
            use_tqdm, lora_request: as for `generate`.
        Returns:
            One ScoringRequestOutput per pair: for an embedding model the cosine similarity of the two embeddings;
            for a cross-encoder (a one-label sequence classifier) its score of the pair tokenized together.
        """
        first, second = _as_prompt_list(data_1), _as_prompt_list(data_2)
        pairs = score_pairs(len(first), len(second))
        if self.engine.core.spec.classifier is not None:
            token_ids = [encode_text_pair(self.engine.tokenizer, first[i], second[j]) for i, j in pairs]
            outputs = self._pool("score", token_ids, None, use_tqdm, lora_request)
            return [ScoringRequestOutput(str(index), ScoringOutput(output.outputs.probs[0]), output.prompt_token_ids)
                    for index, output in enumerate(outputs)]
        outputs = self.embed(first + second, PoolingParams(normalize=True), use_tqdm, lora_request)
        embeddings = [output.outputs.embedding for output in outputs]
        scores = cosine_scores(embeddings[: len(first)], embeddings[len(first):], pairs)
        return [ScoringRequestOutput(str(index), ScoringOutput(score),
                                     outputs[i].prompt_token_ids + outputs[len(first) + j].prompt_token_ids)
                for index, ((i, j), score) in enumerate(zip(pairs, scores))]

    def _pool(self, task: str, prompts, pooling_params, use_tqdm: bool, lora_request) -> list[PoolingRequestOutput]:
        """Run every prompt as a pooling request of `task` (pooling/params.POOLING_TASKS) with its params (one for
        all, one per prompt, or None: the defaults)."""
        make = functools.partial(self.engine.make_pooling_requests, task=task)
        return self._run_all(make, prompts, pooling_params or PoolingParams(), PoolingParams, lora_request, use_tqdm)

    def _run_all(self, make: Callable, prompts, params, params_type: type, lora_request, use_tqdm: bool) -> list:
        """Build every prompt's request with `make` (LLMEngine.make_requests or make_pooling_requests) and its
        params (one for all, or one per prompt), validating everything before queueing anything, so a bad prompt
        leaves no half-run batch; then run them to completion."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _per_prompt(params, len(prompt_list), params_type)
        loras = _per_prompt(lora_request, len(prompt_list), LoRARequest)
        names = [None if lora is None else self.engine.add_lora(lora) for lora in loras]
        made = []
        for prompt, prompt_params, name in zip(prompt_list, params_list, names):
            request_id = str(next(self._ids))
            made.append((request_id, make(request_id, _prompt_of(prompt), prompt_params,
                                          cache_salt=_cache_salt_of(prompt), lora_name=name)))
        for request_id, requests in made:
            self.engine.submit(request_id, requests)
        return self._run([request_id for request_id, _ in made], use_tqdm)

    def beam_search(self, prompts: PromptInput | Sequence[PromptInput],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's offline beam search: each step runs every live beam as a one-token request (engine/beam_search.py).

        Args:
            prompts: as for `generate` (every prompt is validated before any step runs).
            params: beam width, max tokens, length penalty, ...
        Returns:
            One BeamSearchOutput per prompt: its best `params.beam_width` beams, best first.
        """
        step_params = params.step_params()
        searches = []
        for prompt in _as_prompt_list(prompts):
            salt = _cache_salt_of(prompt)
            text, (request,) = self.engine.make_requests("beam-search", _prompt_of(prompt), step_params,
                                                         cache_salt=salt)
            searches.append(BeamSearch(request.prompt_token_ids, params, request.eos_token_ids,
                                       self.engine.max_model_len, prompt=text, cache_salt=salt))
        run_beam_search(searches, lambda batch: self.generate(batch, step_params, use_tqdm=False))
        return [search.output(self.engine.tokenizer) for search in searches]

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template, then `generate`.

        Args:
            messages: one conversation (a list of OpenAI-shaped messages) or a list of them.
            sampling_params, use_tqdm: as for `generate`.
            add_generation_prompt: end the prompt where the assistant's reply starts.
            chat_template_kwargs: extra variables for the template (e.g. enable_thinking).
            tools: the tools the model may call, OpenAI's shape.
            chat_template: a Jinja template or its file, used instead of the tokenizer's.
        Returns:
            One RequestOutput per conversation, in input order.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = None if chat_template is None else load_chat_template(chat_template)
        prompts = [self.render_chat(c, add_generation_prompt, chat_template_kwargs, tools, template)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def render_chat(self, conversation: list[dict], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
                    chat_template: str | None = None) -> list[int]:
        """Token ids of one conversation (and its tools) under the chat template (the tokenizer's unless given)."""
        return render_chat(self.engine.tokenizer, conversation, add_generation_prompt,
                           chat_template_kwargs=chat_template_kwargs, tools=tools, chat_template=chat_template)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV page, as vLLM's `LLM.reset_prefix_cache` (pages in use stay in use)."""
        self.engine.reset_prefix_cache()
        return True

    def update_weights(self, source: str | Mapping[str, object]) -> int:
        """Generate with new weights of the same model from now on, without a restart or a recompile (an RL
        trainer's rollouts).

        Args:
            source: a Hugging Face folder, or arrays (numpy or JAX) by their Hugging Face tensor names; every
                tensor the model has must be there, in its shape (ValueError otherwise, the weights untouched).
        Returns:
            The weights version: updates so far.
        """
        return self.engine.update_weights(source)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (the engine needs enable_sleep_mode): free the devices' memory between uses, for a
        trainer that shares them: the KV pool (the prefix cache is forgotten) and the weights, kept in host memory
        at level 1, discarded at level 2 (read again at `wake_up` from their folder, or from what `update_weights`
        gives meanwhile). Nothing may be running; generating while asleep is a ValueError."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        """Take the devices back after `sleep`: the weights and a zeroed KV pool, on the same executables."""
        self.engine.wake_up()

    def is_sleeping(self) -> bool:
        """True between `sleep` and `wake_up`."""
        return self.engine.is_sleeping()

    def stats(self) -> dict:
        """Engine counters: steps, scheduled tokens, preemptions, KV pages total/free, compilations after warm-up."""
        return self.engine.stats()

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput | PoolingRequestOutput]:
        """Step until every request finished; whatever interrupts the run (an exception, Ctrl-C) aborts
        the requests still pending, so none stays queued and their pages go back."""
        pending = set(request_ids)
        results: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(request_ids), desc="generating", disable=not use_tqdm) as bar:
                while pending:
                    for output in self.engine.step():
                        if output.finished and output.request_id in pending:
                            results[output.request_id] = output
                            pending.discard(output.request_id)
                            bar.update()
        finally:
            for request_id in pending:
                self.engine.abort_request(request_id)
        return [results[request_id] for request_id in request_ids]


def _as_prompt_list(prompts) -> list[PromptInput]:
    """One prompt or a list of prompts; a flat list of ints is one tokenized prompt."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]
    return prompts


def _per_prompt(value, count: int, single: type) -> list:
    """One item per prompt: `value` for every prompt when it is None or a `single`, else its items, one per
    prompt (a ValueError for another number)."""
    if value is None or isinstance(value, single):
        return [value] * count
    items = list(value)
    if len(items) != count:
        raise ValueError(f"got {len(items)} {single.__name__} for {count} prompts; pass one, or one per prompt")
    return items


def _prompt_of(prompt: PromptInput) -> Prompt:
    """Text or token ids out of vLLM's prompt forms."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError("a dict prompt needs a 'prompt' or 'prompt_token_ids' key")
    if isinstance(prompt, (str, list, tuple)):
        return prompt if isinstance(prompt, str) else list(prompt)
    raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")


def _cache_salt_of(prompt: PromptInput) -> str | None:
    """The 'cache_salt' of a dict prompt (vLLM's key), else None."""
    return prompt.get("cache_salt") if isinstance(prompt, dict) else None
