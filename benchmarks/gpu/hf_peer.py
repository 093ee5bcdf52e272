"""Step 12: the Hugging Face peer: transformers on the same GPU, at the same model shape (Llama-3.1-8B's config from
jaxserve/bench/models.py, random bf16 weights made on the GPU) and the same request shape as step 13 (1000 prompt
and 1000 output tokens a request, EOS ignored: every request generates all its tokens), in output tokens/s of
- continuous: transformers' continuous batching, the manager `model.generate_batch` runs (paged attention; its
  cache sized by transformers from the free memory, its CUDA graphs captured first, as `generate_batch` does),
  used directly so the step can stop it at its deadline;
- generate B: plain `model.generate` on one static batch of B requests (greedy), for each batch size of the plan
  in turn; the best is the peer's figure.
Greedy, as `jaxserve bench throughput` samples. The model is built on the device (`torch.device`), so its weights
are drawn there (transformers' own init, normal with std 0.02): no host copy of 16 GB.

Each configuration runs twice untimed on its requests with few new tokens (its warm-up, then a calibration with
`calibration_tokens` more), which give its step time; from them the long run's time is estimated (prefill, then
output_len steps, each `growth` times the short runs' as the context doubles) and the run is skipped when that
does not fit in the time left (its estimate kept, marked as such). A run still going at the deadline is stopped
(generate: a stopping criterion; continuous: a hard stop) and reported as cut, its tokens/s not counted.

torch is used only here, in the step's own process (the engine never uses it, though transformers imports it to
load a tokenizer wherever it is installed). Without torch the step is skipped (ok); in the tiny plan it runs
llama-small on the CPU, whose numbers only show that the code runs.
"""

from __future__ import annotations

import gc
import inspect
import time
import traceback

import numpy as np

from benchmarks.gpu.step import Step, error_text

SHORT_TOKENS = 2  # new tokens of the warm-up run of each configuration
STOP_TIMEOUT_S = 15  # waiting for transformers' generation thread to stop
# ContinuousBatchingConfig fields kept in the result (as transformers resolved them for the workload)
CB_FIELDS = ("block_size", "page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch",
             "max_memory_percent", "use_cuda_graph", "use_async_batching", "allow_block_sharing", "scheduler_type")


def build_model(options: dict):
    """LlamaForCausalLM of the plan's shape, bf16, SDPA attention, made on the plan's device; EOS disabled."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from jaxserve.bench.models import SHAPES, hf_config

    config = LlamaConfig(**hf_config(SHAPES[options["model_shape"]]))
    with torch.device(options["device"]):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def synchronize(device: str) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Deadline:
    """A generate stopping criterion that stops every row once time.monotonic() passes `at`."""

    def __init__(self, at: float):
        self.at, self.hit = at, False

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        done = time.monotonic() > self.at
        self.hit = self.hit or done
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)  # (B,)


class Generate:
    """`model.generate` on one static batch of `requests` prompts: greedy, exactly the requested new tokens (min =
    max, EOS off)."""

    def __init__(self, model, requests: int, device: str):
        self.model, self.requests, self.device = model, requests, device
        self.name = f"generate {requests}"

    def run(self, prompts: np.ndarray, new_tokens: int, deadline: float) -> tuple[float, int, bool]:
        """(seconds, output tokens, whether the deadline cut it) of `prompts` (B, prompt) token ids."""
        import torch
        from transformers import StoppingCriteriaList

        input_ids = torch.as_tensor(prompts, dtype=torch.long, device=self.device)  # (B, prompt)
        stop = Deadline(deadline)
        synchronize(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                      do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      eos_token_id=None, pad_token_id=0, use_cache=True,
                                      stopping_criteria=StoppingCriteriaList([stop]))  # (B, prompt + new)
        synchronize(self.device)
        seconds = time.perf_counter() - start
        generated = out.shape[1] - input_ids.shape[1]
        if generated != new_tokens and not stop.hit:
            raise RuntimeError(f"generate made {generated} tokens a row, not {new_tokens} (EOS not disabled?)")
        return seconds, out.shape[0] * generated, stop.hit

    def close(self) -> None:
        """Nothing to release."""


class Continuous:
    """transformers' continuous batching: the manager `generate_batch` builds (same configs, workload hints and
    CUDA-graph warm-up), started once and kept running across runs, each run adding every request and waiting
    for all of them."""

    def __init__(self, model, requests: int, options: dict):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        self.model, self.requests = model, requests
        self.name = f"continuous {requests}"
        output_len = options["output_len"]
        generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=output_len)
        init = inspect.signature(model.init_continuous_batching).parameters
        kwargs = {"generation_config": generation_config}
        if "continuous_batching_config" in init:
            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(**cb_fields(options["continuous_config"]))
        if "workload_hints" in init:
            from transformers.generation.continuous_batching.utils import WorkloadHints

            kwargs["workload_hints"] = WorkloadHints(max_prompt_length=options["input_len"],
                                                     max_generated_length=output_len, num_requests=requests)
        self.manager = model.init_continuous_batching(**kwargs)
        self.warmup_s = None
        if options["continuous_warmup"] and hasattr(self.manager, "warmup"):
            start = time.perf_counter()
            self.manager.warmup()  # CUDA graph capture, as generate_batch(warmup=True) does
            self.warmup_s = time.perf_counter() - start
        self.manager.start()

    def run(self, prompts: np.ndarray, new_tokens: int, deadline: float) -> tuple[float, int, bool]:
        """(seconds from the first request added to the last result, output tokens, whether the deadline cut it)
        of `prompts` (N, prompt) token ids."""
        inputs = [list(map(int, row)) for row in prompts]
        start = time.perf_counter()
        ids = set(self.manager.add_requests(inputs=inputs, max_new_tokens=new_tokens))
        tokens = 0
        while ids:
            if time.monotonic() > deadline:
                self.manager.stop(block=True, timeout=STOP_TIMEOUT_S, hard_stop=True)
                return time.perf_counter() - start, tokens, True
            result = self.manager.get_result(timeout=0.5)
            if result is None:
                if not self.manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped before finishing")
            elif result.request_id in ids and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers' continuous batching failed a request: {result.error}")
                if len(result.generated_tokens) != new_tokens:
                    raise RuntimeError(f"a request got {len(result.generated_tokens)} tokens, not {new_tokens}")
                ids.discard(result.request_id)
                tokens += len(result.generated_tokens)
        return time.perf_counter() - start, tokens, False

    def config(self) -> dict:
        """The continuous batching settings transformers chose (CB_FIELDS), as text."""
        found = getattr(self.manager, "continuous_batching_config", None)
        return {name: str(getattr(found, name)) for name in CB_FIELDS if hasattr(found, name)}

    def close(self) -> None:
        """Stop the manager and free its cache."""
        if self.manager.is_running():
            self.manager.stop(block=True, timeout=STOP_TIMEOUT_S)
        self.manager.destroy()


def cb_fields(options: dict) -> dict:
    """ContinuousBatchingConfig arguments from the plan's, `page_size` named as this transformers names it (5.17:
    block_size; later: page_size)."""
    import dataclasses

    from transformers import ContinuousBatchingConfig

    names = {field.name for field in dataclasses.fields(ContinuousBatchingConfig)}
    fields = dict(options)
    if "page_size" in fields and "page_size" not in names:
        fields["block_size"] = fields.pop("page_size")
    return {name: value for name, value in fields.items() if name in names}


def continuous_unavailable(model) -> str | None:
    """Why this transformers has no continuous batching to run, or None."""
    import transformers

    try:
        getattr(transformers, "ContinuousBatchingConfig")  # (transformers imports its names lazily)
    except (AttributeError, ImportError) as exc:
        return f"no ContinuousBatchingConfig in transformers {transformers.__version__} ({error_text(exc)})"
    missing = [name for name in ("init_continuous_batching", "generate_batch") if not hasattr(model, name)]
    return f"the model has no {', '.join(missing)}" if missing else None


def measure(system, step: Step, options: dict, rng: np.random.Generator, vocab: int) -> dict:
    """Warm-up, calibration and (when it fits) the timed run of one configuration, each run on prompts of its own
    (transformers' continuous batching caches prefixes)."""
    output_len, short = options["output_len"], SHORT_TOKENS

    def prompts() -> np.ndarray:
        return rng.integers(4, vocab, (system.requests, options["input_len"]))  # (N, prompt) token ids

    row = {"system": system.name, "requests": system.requests}
    warm_s, _, warm_cut = system.run(prompts(), short, step.deadline)
    calibration_s, _, calibration_cut = system.run(prompts(), short + options["calibration_tokens"], step.deadline)
    if warm_cut or calibration_cut:
        row["skipped"] = "out of time in its short runs"
        return row
    step_s = max(calibration_s - warm_s, 0.0) / options["calibration_tokens"]
    prefill_s = max(warm_s - short * step_s, 0.0)
    estimate_s = prefill_s + output_len * step_s * options["growth"]
    row.update(warmup_s=warm_s, calibration_s=calibration_s, step_ms=1e3 * step_s, prefill_s=prefill_s,
               estimated_s=estimate_s,
               estimated_tokens_per_s=system.requests * output_len / estimate_s if estimate_s else None)
    left = step.deadline - time.monotonic()
    if estimate_s > left:
        row["skipped"] = f"estimated {estimate_s:.0f} s, {left:.0f} s left"
        return row
    seconds, tokens, cut = system.run(prompts(), output_len, step.deadline)
    row.update(seconds=seconds, output_tokens=tokens)
    if cut:
        row["cut"] = f"stopped at the step's deadline after {seconds:.0f} s ({tokens} tokens)"
    else:
        row["output_tokens_per_s"] = tokens / seconds
    return row


def describe(row: dict) -> str:
    """One log line for a configuration."""
    head = f"hf_peer {row['system']:<16}"
    if "error" in row:
        return f"{head} FAIL {row['error']}"
    if "step_ms" not in row:
        return f"{head} skipped: {row.get('skipped', '?')}"
    estimate = row["estimated_tokens_per_s"]
    calibration = (f"step {row['step_ms']:.1f} ms, prefill {row['prefill_s']:.2f} s, estimate "
                   f"{row['estimated_s']:.0f} s ({'-' if estimate is None else f'{estimate:.0f}'} tok/s)")
    if "output_tokens_per_s" in row:
        return f"{head} {row['output_tokens_per_s']:8.0f} output tok/s ({row['seconds']:.1f} s; {calibration})"
    return f"{head} {row.get('cut') or 'skipped: ' + row.get('skipped', '?')} ({calibration})"


def run(step: Step) -> dict:
    """Step 12: each configuration of the plan while time is left; the best output tokens/s is the peer's figure."""
    options = step.plan.hf_peer
    started = time.monotonic()
    try:
        import torch
        import transformers
    except Exception as exc:  # noqa: BLE001 - no torch here: nothing to compare with
        reason = f"torch / transformers not importable ({error_text(exc)})"
        print(f"hf_peer: skipped: {reason}", flush=True)
        return {"ok": True, "skipped": reason, "summary": f"skipped: {reason}"}
    device = options["device"]
    if device.startswith("cuda") and not torch.cuda.is_available():
        return {"ok": False, "summary": f"torch {torch.__version__} sees no CUDA device", "torch": torch.__version__}
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"}
    print(f"hf_peer: torch {versions['torch']}, transformers {versions['transformers']} on {versions['device_name']}",
          flush=True)
    if not device.startswith("cuda"):
        torch.set_num_threads(1)  # the tiny plan on a shared CPU: OpenMP threads can be many times slower there
    model = build_model(options)
    build_s = time.monotonic() - started
    print(f"hf_peer: {options['model_shape']} built on {device} in {build_s:.1f} s "
          f"(attention {model.config._attn_implementation})", flush=True)
    rng = np.random.default_rng(step.seed)
    unavailable = continuous_unavailable(model)
    makers = [("continuous", options["continuous_requests"])] + [("generate", b) for b in options["generate_batches"]]
    rows = []
    for kind, count in makers:
        name = f"{kind} {count}"
        if kind == "continuous" and unavailable:
            rows.append({"system": name, "skipped": unavailable})
        elif step.out_of_time():
            rows.append({"system": name, "skipped": "out of time"})
        else:
            system = None
            try:
                system = Continuous(model, count, options) if kind == "continuous" else Generate(model, count, device)
                rows.append(measure(system, step, options, rng, model.config.vocab_size))
                if kind == "continuous":
                    rows[-1].update(graph_warmup_s=system.warmup_s, config=system.config())
            except Exception as exc:  # noqa: BLE001 - one configuration failing must not hide the others
                traceback.print_exc(limit=-6)
                rows.append({"system": name, "error": error_text(exc)})
            finally:
                if system is not None:
                    try:
                        system.close()
                    except Exception as exc:  # noqa: BLE001 - report, go on
                        rows[-1]["close_error"] = error_text(exc)
                del system
                gc.collect()
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
        print(describe(rows[-1]), flush=True)
        step.save_partial("hf_peer", result(rows, options, versions, build_s, ok=False))
    return result(rows, options, versions, build_s, ok=True)


def result(rows: list[dict], options: dict, versions: dict, build_s: float, ok: bool) -> dict:
    """The step's result: every configuration, the best measured one, and what was run."""
    measured = [row for row in rows if "output_tokens_per_s" in row]
    best = max(measured, key=lambda row: row["output_tokens_per_s"], default=None)
    workload = {key: options[key] for key in ("model_shape", "input_len", "output_len")}
    found = {"rows": rows, "best": best, "workload": workload, "build_s": build_s, **versions,
             "sampling": "greedy, EOS ignored (min_new_tokens = max_new_tokens; continuous: eos_token_id -1)"}
    errors = [row for row in rows if "error" in row]
    if best:
        summary = (f"best {best['system']}: {best['output_tokens_per_s']:.0f} output tok/s "
                   f"({best['requests']} x {options['input_len']} in / {options['output_len']} out)")
    else:
        summary = "nothing measured"
    summary += "".join(f"; {row['system']} failed" for row in errors)
    return {"ok": ok and best is not None and not errors, "summary": summary, **found}
