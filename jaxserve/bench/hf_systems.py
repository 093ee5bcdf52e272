"""Hugging Face transformers as `jaxserve bench throughput` systems: `generate` in static batches, and
transformers' own continuous batching (the manager behind `generate_batch`).

torch and transformers' model classes are imported only here, lazily; `unavailable_reason()` says why these
systems cannot run (the caller reports them as skipped). Both systems follow offline.py's system protocol:
`warm_up(requests, tokens)`, `timed_run(workload)`, `result() -> dict`, `close()`.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Sequence

from jaxserve.bench.workloads import BenchRequest, Workload

TORCH_DTYPES = ("float32", "bfloat16", "float16")


def unavailable_reason() -> str | None:
    """Why the Hugging Face systems cannot run here (torch or transformers' Llama missing); None when they can."""
    try:
        importlib.import_module("torch")
        transformers = importlib.import_module("transformers")
        for name in ("AutoModelForCausalLM", "ContinuousBatchingConfig"):
            getattr(transformers, name)
    except Exception as error:  # ImportError, or a broken install raising anything else
        return (f"torch / transformers models unavailable ({type(error).__name__}: {error}); "
                "pip install 'jaxserve[bench]'")
    return None


def load_model(folder: str, dtype: str):
    """The folder's causal LM on the CPU in `dtype` (one of TORCH_DTYPES), eval mode, SDPA attention, EOS
    disabled in its generation config (every row runs to its token budget)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def calibrate_threads(candidates: Sequence[int], trial: Callable[[], None]) -> tuple[int, dict[int, float]]:
    """Set torch to the fastest of `candidates` thread counts for `trial` (each runs it once to settle the
    thread pool, then once timed) and return it with the timed seconds of each; no trial with a single
    candidate. On a shared machine torch's OpenMP threads can be many times slower when another process holds
    a core, so the systems below calibrate just before every run."""
    import torch

    seconds = {}
    if len(candidates) > 1:
        for threads in candidates:
            torch.set_num_threads(threads)
            trial()
            start = time.perf_counter()
            trial()
            seconds[threads] = time.perf_counter() - start
    best = min(seconds, key=seconds.get) if seconds else candidates[0]
    torch.set_num_threads(best)
    return best, seconds


def describe_calibration(seconds: dict[int, float], best: int) -> str:
    """"threads 2: 0.31s, 1: 0.49s -> 2; " for a log line; "" without a trial."""
    if not seconds:
        return ""
    return "threads " + ", ".join(f"{t}: {s:.2f}s" for t, s in seconds.items()) + f" -> {best}; "


def generate_static(model, prompts: Sequence[Sequence[int]], new_tokens: int, pad_id: int):
    """Greedy `model.generate` of exactly `new_tokens` tokens for each prompt, as one left-padded batch;
    returns the new token ids, a (len(prompts), new_tokens) int64 tensor."""
    import torch

    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # (B, width)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (B, width), 1 on real tokens
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, use_cache=True,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                             pad_token_id=pad_id)
    generated = out[:, width:]  # (B, new_tokens)
    if generated.shape[1] != new_tokens:
        raise RuntimeError(f"HF generated {generated.shape[1]} tokens, expected {new_tokens} (EOS not disabled?)")
    return generated


def static_batches(requests: Sequence[BenchRequest], batch_size: int) -> list[Sequence[BenchRequest]]:
    """The requests in order, cut into batches of `batch_size` (the last may be smaller)."""
    return [requests[start:start + batch_size] for start in range(0, len(requests), batch_size)]


class HFGenerate:
    """`model.generate` in static batches, in request order, left padded, EOS disabled; each batch generates
    its longest requested output (the rest of its rows is static-batching waste). Every batch size of
    `batch_sizes` is timed in every run; the result is the one with the best mean. Before each run of a batch
    size, torch takes the fastest of the `threads` counts on a `calibration_tokens`-token generate of its
    first batch."""

    name = "hf-generate"

    def __init__(self, model, pad_id: int, batch_sizes: Sequence[int], threads: Sequence[int],
                 calibration_tokens: int, log: Callable[[str], None]):
        self.model, self.pad_id, self.log = model, pad_id, log
        self.threads, self.calibration_tokens = list(threads), calibration_tokens
        # batch size -> {"runs_s", "threads", "thread_calibration_s" (one per run), "generated_tokens"}
        self.configs = {batch_size: {"runs_s": [], "threads": [], "thread_calibration_s": [], "generated_tokens": 0}
                        for batch_size in batch_sizes}
        self.output_token_ids: dict[int, list[list[int]]] = {}  # batch size -> first run's requested tokens

    def _generate_all(self, requests: Sequence[BenchRequest], batch_size: int) -> tuple[list[list[int]], int]:
        """Every request's requested tokens, in static batches; and the tokens generated, waste included."""
        outputs, generated = [], 0
        for batch in static_batches(requests, batch_size):
            ids = generate_static(self.model, [r.prompt_token_ids for r in batch], max(r.output_len for r in batch),
                                  self.pad_id)  # (rows, longest output)
            generated += ids.shape[0] * ids.shape[1]
            outputs += [ids[row, :r.output_len].tolist() for row, r in enumerate(batch)]
        return outputs, generated

    def _calibrate(self, requests: Sequence[BenchRequest], batch_size: int) -> tuple[int, dict[int, float]]:
        """Set torch's threads for this batch size (see calibrate_threads)."""
        prompts = [r.prompt_token_ids for r in requests[:batch_size]]
        return calibrate_threads(self.threads,
                                 lambda: generate_static(self.model, prompts, self.calibration_tokens, self.pad_id))

    def warm_up(self, requests: Sequence[BenchRequest], tokens: int) -> None:
        """Generate `tokens` tokens for each request, in static batches of every batch size."""
        warm = [BenchRequest(r.prompt_token_ids, tokens) for r in requests]
        for batch_size in self.configs:
            self._calibrate(requests, batch_size)
            self._generate_all(warm, batch_size)

    def timed_run(self, workload: Workload) -> None:
        """One timed run of the whole workload per batch size (each after its thread calibration)."""
        for batch_size, config in self.configs.items():
            threads, calibration = self._calibrate(workload.requests, batch_size)
            start = time.perf_counter()
            outputs, generated = self._generate_all(workload.requests, batch_size)
            seconds = time.perf_counter() - start
            config["runs_s"].append(seconds)
            config["threads"].append(threads)
            config["thread_calibration_s"].append(calibration)
            config["generated_tokens"] = generated
            self.output_token_ids.setdefault(batch_size, outputs)
            self.log(f"  hf-generate bs{batch_size}: {describe_calibration(calibration, threads)}{seconds:.2f}s, "
                     f"{workload.num_output_tokens / seconds:.1f} output tok/s ({generated} tokens generated for "
                     f"{workload.num_output_tokens} requested)")

    def result(self) -> dict:
        """{"runs_s", "output_token_ids", "details"} of the batch size with the best mean run."""
        best = min(self.configs, key=lambda b: sum(self.configs[b]["runs_s"]) / len(self.configs[b]["runs_s"]))
        return {"runs_s": self.configs[best]["runs_s"], "output_token_ids": self.output_token_ids[best],
                "details": {"batch_size": best, "batch_sizes": {str(b): c for b, c in self.configs.items()}}}

    def close(self) -> None:
        """Nothing to release (the model is shared)."""


class HFContinuous:
    """transformers' continuous batching: one ContinuousBatchingManager (what `model.generate_batch` builds)
    with the same limits as jaxserve: `page_size`-token pages, `num_pages` of them (the same KV budget), at most
    `max_num_seqs` requests and `max_num_batched_tokens` tokens per step. Each request gets its own
    max_new_tokens and no EOS, so it generates exactly its requested tokens. The manager is started for each
    run and stopped (kept) after it; the timer runs from the first request added to the last result. Before
    each run, torch takes the fastest of the `threads` counts on a `calibration_tokens`-token run of the first
    max_num_seqs requests."""

    name = "hf-continuous"

    def __init__(self, model, page_size: int, num_pages: int, max_num_seqs: int, max_num_batched_tokens: int,
                 seed: int, threads: Sequence[int], calibration_tokens: int, log: Callable[[str], None]):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        self.model, self.log = model, log
        self.threads, self.calibration_tokens, self.max_num_seqs = list(threads), calibration_tokens, max_num_seqs
        generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=calibration_tokens)
        cb_config = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_pages,
                                             max_batch_tokens=max_num_batched_tokens,
                                             max_requests_per_batch=max_num_seqs, seed=seed)
        self.manager = model.init_continuous_batching(generation_config=generation_config,
                                                      continuous_batching_config=cb_config)
        self.num_calls = 0  # request ids must be unique across calls
        self.runs_s: list[float] = []
        self.run_threads: list[int] = []
        self.thread_calibration_s: list[dict[int, float]] = []  # one per run
        self.output_token_ids: list[list[int]] | None = None

    def _generate(self, requests: Sequence[BenchRequest]) -> tuple[float, list[list[int]]]:
        """(seconds from the first add to the last result, each request's generated tokens)."""
        self.num_calls += 1
        ids = [f"call{self.num_calls}-{i}" for i in range(len(requests))]
        self.manager.start()
        try:
            start = time.perf_counter()
            for request_id, request in zip(ids, requests):
                self.manager.add_request(list(request.prompt_token_ids), request_id=request_id,
                                         max_new_tokens=request.output_len, eos_token_id=-1)
            results = {}
            while len(results) < len(ids):
                result = self.manager.get_result(timeout=1.0)
                if result is None:
                    if not self.manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread stopped before finishing")
                elif result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"transformers' continuous batching failed a request: {result.error}")
                    results[result.request_id] = result
            seconds = time.perf_counter() - start
        finally:
            self.manager.stop(block=True, keep_for_next_session=True)
        return seconds, [list(results[request_id].generated_tokens) for request_id in ids]

    def _calibrate(self, requests: Sequence[BenchRequest]) -> tuple[int, dict[int, float]]:
        """Set torch's threads (see calibrate_threads)."""
        trial = [BenchRequest(r.prompt_token_ids, self.calibration_tokens) for r in requests[:self.max_num_seqs]]
        return calibrate_threads(self.threads, lambda: self._generate(trial))

    def warm_up(self, requests: Sequence[BenchRequest], tokens: int) -> None:
        """Generate `tokens` tokens for each request."""
        self._calibrate(requests)
        self._generate([BenchRequest(r.prompt_token_ids, tokens) for r in requests])

    def timed_run(self, workload: Workload) -> None:
        """One timed run of the whole workload (after the thread calibration)."""
        threads, calibration = self._calibrate(workload.requests)
        seconds, outputs = self._generate(workload.requests)
        wrong = sum(len(out) != r.output_len for out, r in zip(outputs, workload.requests))
        if wrong:
            raise RuntimeError(f"transformers' continuous batching gave {wrong} requests the wrong number of tokens")
        self.runs_s.append(seconds)
        self.run_threads.append(threads)
        self.thread_calibration_s.append(calibration)
        if self.output_token_ids is None:
            self.output_token_ids = outputs
        self.log(f"  hf-continuous: {describe_calibration(calibration, threads)}{seconds:.2f}s, "
                 f"{workload.num_output_tokens / seconds:.1f} output tok/s")

    def result(self) -> dict:
        """{"runs_s", "output_token_ids", "details"}."""
        return {"runs_s": self.runs_s, "output_token_ids": self.output_token_ids,
                "details": {"threads": self.run_threads, "thread_calibration_s": self.thread_calibration_s}}

    def close(self) -> None:
        """Stop and release the manager (and its KV cache)."""
        self.manager.destroy()
        self.model.destroy_cached_continuous_batching_manager()
