"""CTranslate2 as a `jaxserve bench throughput` system, run in its own process (CTranslate2 and torch fight
over OpenMP threads when they share one).

Two sides in one module:

- the worker, `python -m jaxserve.bench.ct2_worker {convert,run} ...`: `convert` turns a Hugging Face folder
  into a CTranslate2 model with ctranslate2's transformers converter; `run` loads it with the fastest of the
  --threads intra_threads counts (os.cpu_count() and 1 by default, timed on a short generate: on a shared
  machine CTranslate2's OpenMP threads can be a thousand times slower when another process holds a core),
  gives it the untimed warm-up, then times --repeats runs of the whole workload per batch size and prints one
  JSON line: {"ctranslate2", "threads", "thread_calibration_s", "batch_sizes": {"B": {"runs_s",
  "generated_tokens"}}, "output_token_ids": {"B": [[...], ...]}}. Generation is static batches in request
  order: `Generator.generate_batch` with the prompts' token strings, greedy (sampling_topk=1), prompt not in
  the result, max_length = min_length = the batch's longest requested output (so EOS cannot end a row
  early: every row generates that many tokens, and the useful ones are each request's requested tokens).
- the parent's system, `CTranslate2` (offline.py's system protocol): converts once (cached under
  <cache-dir>/ct2/), then runs one worker per timed run (repeats 1), so CTranslate2 takes its turn in each
  round like every other system; each worker gets the same warm-up first.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

from jaxserve.bench.workloads import BenchRequest, Workload

DTYPES = ("float32", "bfloat16", "float16")  # CTranslate2 quantization / compute type of each jaxserve dtype
STDERR_TAIL = 2000  # characters of a failed worker's stderr kept in the error


# ---- worker (child process) -----------------------------------------------------------------------------

def convert(model_folder: str, output: str, dtype: str) -> None:
    """Convert a Hugging Face folder to a CTranslate2 model in `output` (written elsewhere, then renamed)."""
    from ctranslate2.converters import TransformersConverter

    building = f"{output}.building-{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    TransformersConverter(model_folder, low_cpu_mem_usage=True).convert(building, quantization=dtype, force=True)
    shutil.rmtree(output, ignore_errors=True)
    os.rename(building, output)


def generate_static(generator, vocabulary: list[str], prompts: Sequence[Sequence[int]],
                    output_lens: Sequence[int], batch_size: int) -> tuple[list[list[int]], int]:
    """Greedy static batches in order; returns each prompt's first output_lens[i] generated ids, and the tokens
    generated in all (each batch's rows all generate its longest output)."""
    outputs, generated = [], 0
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        lens = output_lens[start:start + batch_size]
        longest = max(lens)
        results = generator.generate_batch(
            [[vocabulary[token] for token in prompt] for prompt in batch], max_length=longest, min_length=longest,
            sampling_topk=1, include_prompt_in_result=False)
        for result, length in zip(results, lens):
            ids = result.sequences_ids[0]
            if len(ids) != longest:
                raise RuntimeError(f"CTranslate2 generated {len(ids)} tokens, expected {longest}")
            outputs.append(ids[:length])
        generated += len(batch) * longest
    return outputs, generated


def load_fastest(converted: str, dtype: str, threads: Sequence[int], vocabulary: list[str],
                 trial_prompts: Sequence[Sequence[int]], trial_tokens: int) -> tuple[object, int, dict[int, float]]:
    """(a Generator, its intra_threads, the trial's seconds per candidate): the fastest of `threads` on a greedy
    generate of `trial_tokens` tokens for `trial_prompts` (run once to settle, then timed); no trial with a
    single candidate."""
    import ctranslate2

    def load(count: int):
        return ctranslate2.Generator(converted, device="cpu", compute_type=dtype, intra_threads=count)

    if len(threads) == 1:
        return load(threads[0]), threads[0], {}
    seconds = {}
    lens = [trial_tokens] * len(trial_prompts)
    for count in threads:
        generator = load(count)
        generate_static(generator, vocabulary, trial_prompts, lens, len(trial_prompts))
        start = time.perf_counter()
        generate_static(generator, vocabulary, trial_prompts, lens, len(trial_prompts))
        seconds[count] = time.perf_counter() - start
        del generator
    best = min(seconds, key=seconds.get)
    return load(best), best, seconds


def run_worker(converted: str, requests_path: str, dtype: str, batch_sizes: Sequence[int], repeats: int,
               threads: Sequence[int], calibration_tokens: int) -> dict:
    """Load the converted model (fastest thread count), warm up, time `repeats` runs per batch size; the
    JSON-able result."""
    import ctranslate2

    with open(requests_path) as f:
        spec = json.load(f)  # {"prompts", "output_lens", "warmup_prompts", "warmup_tokens"}
    with open(os.path.join(converted, "vocabulary.json")) as f:
        vocabulary = json.load(f)  # token strings in id order (the tokenizer's, as the converter wrote them)
    prompts, output_lens = spec["prompts"], spec["output_lens"]
    warm = spec["warmup_prompts"]
    generator, chosen, calibration = load_fastest(converted, dtype, threads, vocabulary, prompts[:max(batch_sizes)],
                                                  calibration_tokens)
    result = {"ctranslate2": ctranslate2.__version__, "threads": chosen, "thread_calibration_s": calibration,
              "batch_sizes": {}, "output_token_ids": {}}
    for batch_size in batch_sizes:
        generate_static(generator, vocabulary, warm, [spec["warmup_tokens"]] * len(warm), batch_size)
    for batch_size in batch_sizes:
        runs_s = []
        for _ in range(repeats):
            start = time.perf_counter()
            outputs, generated = generate_static(generator, vocabulary, prompts, output_lens, batch_size)
            runs_s.append(time.perf_counter() - start)
        result["batch_sizes"][str(batch_size)] = {"runs_s": runs_s, "generated_tokens": generated}
        result["output_token_ids"][str(batch_size)] = outputs
    return result


def main(argv: Sequence[str] | None = None) -> None:
    """The worker's command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description="CTranslate2 worker of `jaxserve bench throughput`")
    commands = parser.add_subparsers(dest="command", required=True)
    converting = commands.add_parser("convert", help="convert a Hugging Face folder")
    converting.add_argument("--model", required=True, help="the Hugging Face folder")
    converting.add_argument("--output", required=True, help="the CTranslate2 model folder to write")
    converting.add_argument("--dtype", choices=DTYPES, default="float32")
    running = commands.add_parser("run", help="time static-batch generation; prints one JSON line")
    running.add_argument("--converted", required=True, help="the CTranslate2 model folder")
    running.add_argument("--requests", required=True,
                         help="JSON file: prompts (token ids), output_lens, warmup_prompts, warmup_tokens")
    running.add_argument("--dtype", choices=DTYPES, default="float32")
    running.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    running.add_argument("--repeats", type=int, default=1)
    running.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 1],
                         help="intra_threads counts to try; the fastest on a short generate is used")
    running.add_argument("--calibration-tokens", type=int, default=8, help="tokens of the thread trial")
    args = parser.parse_args(argv)
    if args.command == "convert":
        convert(args.model, args.output, args.dtype)
    else:
        result = run_worker(args.converted, args.requests, args.dtype, args.batch_sizes, args.repeats, args.threads,
                            args.calibration_tokens)
        print(json.dumps(result), flush=True)


# ---- the parent's system ----------------------------------------------------------------------------------

def unavailable_reason() -> str | None:
    """Why CTranslate2 cannot run here; None when it can (checked without importing it into this process)."""
    if importlib.util.find_spec("ctranslate2") is None:
        return "ctranslate2 is not installed; pip install 'jaxserve[bench]'"
    return None


def _worker(arguments: list[str]) -> str:
    """Run the worker with `arguments`; its stdout, or RuntimeError with its stderr's tail."""
    process = subprocess.run([sys.executable, "-m", "jaxserve.bench.ct2_worker", *arguments],
                             capture_output=True, text=True)
    if process.returncode != 0:
        raise RuntimeError(f"the CTranslate2 worker failed ({' '.join(arguments[:1])}): "
                           f"{process.stderr[-STDERR_TAIL:]}")
    return process.stdout


def converted_folder(model_folder: str, cache_dir: str, dtype: str) -> str:
    """Where the CTranslate2 copy of `model_folder` in `dtype` is cached: named by the folder's path, its
    config and the sizes and times of its files."""
    folder = os.path.abspath(model_folder)
    with open(os.path.join(folder, "config.json")) as f:
        key = [folder, dtype, f.read()]
    for name in sorted(os.listdir(folder)):
        status = os.stat(os.path.join(folder, name))
        key.append(f"{name}:{status.st_size}:{status.st_mtime_ns}")
    digest = hashlib.sha1("\n".join(key).encode()).hexdigest()[:10]
    return os.path.join(cache_dir, "ct2", f"{os.path.basename(folder)}-{dtype}-{digest}")


class CTranslate2:
    """CTranslate2 in static batches (best of `batch_sizes`), one worker process per timed run, each using the
    fastest of `threads` (intra_threads counts) on a `calibration_tokens`-token trial."""

    name = "ctranslate2"

    def __init__(self, model_folder: str, cache_dir: str, dtype: str, batch_sizes: Sequence[int],
                 threads: Sequence[int], calibration_tokens: int, log: Callable[[str], None]):
        if dtype not in DTYPES:
            raise ValueError(f"CTranslate2 runs {', '.join(DTYPES)}, not {dtype}")
        self.dtype, self.batch_sizes, self.log = dtype, list(batch_sizes), log
        self.threads, self.calibration_tokens = list(threads), calibration_tokens
        self.converted = converted_folder(model_folder, cache_dir, dtype)
        if os.path.isfile(os.path.join(self.converted, "model.bin")):
            log(f"  ctranslate2: reusing {self.converted}")
        else:
            start = time.perf_counter()
            os.makedirs(os.path.dirname(self.converted), exist_ok=True)
            _worker(["convert", "--model", model_folder, "--output", self.converted, "--dtype", dtype])
            log(f"  ctranslate2: converted to {self.converted} in {time.perf_counter() - start:.1f}s")
        self.workdir = tempfile.mkdtemp(prefix="jaxserve-bench-ct2-")
        self.requests_path = os.path.join(self.workdir, "requests.json")
        self.warmup: dict = {"warmup_prompts": [], "warmup_tokens": 1}
        self.runs: list[dict] = []  # each worker's JSON result

    def warm_up(self, requests: Sequence[BenchRequest], tokens: int) -> None:
        """Remember the warm-up: each worker runs it (untimed) before its timed run."""
        self.warmup = {"warmup_prompts": [list(r.prompt_token_ids) for r in requests], "warmup_tokens": tokens}

    def timed_run(self, workload: Workload) -> None:
        """One worker: the warm-up, then one timed run of the whole workload per batch size."""
        with open(self.requests_path, "w") as f:
            json.dump({"prompts": [list(r.prompt_token_ids) for r in workload.requests],
                       "output_lens": [r.output_len for r in workload.requests], **self.warmup}, f)
        stdout = _worker(["run", "--converted", self.converted, "--requests", self.requests_path, "--dtype", self.dtype,
                          "--batch-sizes", *map(str, self.batch_sizes), "--repeats", "1",
                          "--threads", *map(str, self.threads), "--calibration-tokens", str(self.calibration_tokens)])
        run = json.loads(stdout.strip().splitlines()[-1])
        self.runs.append(run)
        if run["thread_calibration_s"]:
            self.log(f"  ctranslate2 intra_threads ({self.calibration_tokens}-token generate): "
                     + ", ".join(f"{t}: {s:.2f}s" for t, s in run["thread_calibration_s"].items())
                     + f" -> {run['threads']}")
        for batch_size, timing in run["batch_sizes"].items():
            seconds = timing["runs_s"][0]
            self.log(f"  ctranslate2 bs{batch_size} ({run['threads']} threads): {seconds:.2f}s, "
                     f"{workload.num_output_tokens / seconds:.1f} output tok/s ({timing['generated_tokens']} tokens "
                     f"generated for {workload.num_output_tokens} requested)")

    def result(self) -> dict:
        """{"runs_s", "output_token_ids", "details"} of the batch size with the best mean run."""
        runs_s = {str(b): [run["batch_sizes"][str(b)]["runs_s"][0] for run in self.runs] for b in self.batch_sizes}
        best = min(runs_s, key=lambda b: sum(runs_s[b]) / len(runs_s[b]))
        first = self.runs[0]
        details = {"batch_size": int(best), "threads": [run["threads"] for run in self.runs],
                   "thread_calibration_s": [run["thread_calibration_s"] for run in self.runs],
                   "version": first["ctranslate2"], "converted": self.converted, "batch_sizes": {
                       b: {"runs_s": runs_s[b], "generated_tokens": first["batch_sizes"][b]["generated_tokens"]}
                       for b in runs_s}}
        return {"runs_s": runs_s[best], "output_token_ids": first["output_token_ids"][best], "details": details}

    def close(self) -> None:
        """Remove the worker's scratch folder."""
        shutil.rmtree(self.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
