"""`background_compile`: an engine ready after its largest buckets compile, its other buckets compiling on a
background thread while steps run in the largest ones; the same tokens as an engine that compiled everything first,
and nothing compiled on a step's path."""

import os
import subprocess
import sys
import threading

import pytest
from helpers import checkpoint, expected, small_engine_args

from jaxserve import LLM, SamplingParams
from jaxserve.runner.runner import Runner


@pytest.fixture
def held_background(monkeypatch):
    """Hold the background compiles until the test releases them, so the first steps surely run in the largest
    buckets."""
    release = threading.Event()
    compile_rest = Runner._compile_in_background

    def held(self, groups):
        release.wait(timeout=120)
        compile_rest(self, groups)

    monkeypatch.setattr(Runner, "_compile_in_background", held)
    yield release
    release.set()


def requests():
    """Prompts with what a step's buckets depend on: plain, penalties (aux tokens), prompt logprobs."""
    prompts = [{"prompt_token_ids": ids} for ids in expected("llama")["prompts"][:6]]
    params = [SamplingParams(max_tokens=8, temperature=0)] * 4 + [
        SamplingParams(max_tokens=8, temperature=0, presence_penalty=0.5, repetition_penalty=1.3),
        SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=2, logprobs=2)]
    return prompts, params


def outputs(llm: LLM) -> list:
    prompts, params = requests()
    results = llm.generate(prompts, params, use_tqdm=False)
    return [(r.outputs[0].token_ids, [sorted(p) for p in r.outputs[0].logprobs or []],
             [None if p is None else sorted(p) for p in r.prompt_logprobs or []]) for r in results]


def test_steps_run_in_the_largest_buckets_until_theirs_compile(held_background):
    reference = outputs(LLM(checkpoint("llama"), **small_engine_args()))
    llm = LLM(checkpoint("llama"), **small_engine_args(background_compile=True, skip_precompile=False))
    core = llm.engine.core
    assert core.runner.background_compiles_left() > 0  # ready before the rest compiled
    assert outputs(llm) == reference
    during = llm.stats()
    assert during["steps_in_the_largest_bucket"] == during["steps"] > 0  # every step so far ran in the largest
    held_background.set()
    assert core.runner.wait_for_background_compiles(timeout=300)
    assert outputs(llm) == reference
    after = llm.stats()
    assert after["steps_in_the_largest_bucket"] == during["steps_in_the_largest_bucket"]  # none since
    assert after["background_compiles_left"] == 0
    assert after["lazy_bucket_compilations"] == 0 and after["compilations_after_warmup"] == 0
    assert after["kv_pages_free"] == after["kv_pages_total"]


def test_a_failed_bucket_is_tried_again_and_one_that_keeps_failing_is_left_to_the_largest(held_background, caplog):
    """A failure does not end the background thread: the bucket is compiled once more; failing again, it is logged
    and its steps keep running in the largest buckets, with the same tokens, while the others compile."""
    reference = outputs(LLM(checkpoint("llama"), **small_engine_args()))
    llm = LLM(checkpoint("llama"), **small_engine_args(background_compile=True, skip_precompile=False))
    runner = llm.engine.core.runner
    pending = sorted(key for kind, key in runner._compiling if kind == "sampler")
    assert len(pending) >= 2
    flaky, broken = pending[0], pending[-1]
    compile_into, failures = runner._compile_into, []

    def failing(table, key, function, args):
        if key == broken or (key == flaky and not failures):
            failures.append(key)
            raise KeyError(f"a failure of {key}")
        return compile_into(table, key, function, args)

    runner._compile_into = failing
    held_background.set()
    assert not runner.wait_for_background_compiles(timeout=300)  # the thread ended, one bucket left out
    assert failures == [flaky, broken, broken] and runner._compiling == {("sampler", broken)}
    assert f"the sampler bucket {flaky} failed (KeyError" in caplog.text and "trying again" in caplog.text
    assert f"the sampler bucket {broken} failed" in caplog.text and "keep running in the largest" in caplog.text
    assert outputs(llm) == reference
    assert llm.stats()["lazy_bucket_compilations"] == 0


def test_a_compile_that_fails_while_the_process_exits_ends_the_thread_quietly(held_background, caplog):
    """At the process's exit (the atexit handler sets the stop event while a bucket compiles) a failing compile ends
    the thread without a retry or a warning: jax's lowering raised a KeyError in 15 of 71 such exits, and the process
    has nothing left to serve."""
    llm = LLM(checkpoint("llama"), **small_engine_args(background_compile=True, skip_precompile=False))
    runner = llm.engine.core.runner
    calls = []

    def failing_at_exit(table, key, function, args):
        calls.append(key)
        runner._stop_background.set()  # what _stop_background_compiles does at the exit, during this compile
        raise KeyError("a lowering during the exit")

    runner._compile_into = failing_at_exit
    held_background.set()
    assert not runner.wait_for_background_compiles(timeout=60)  # ended, its buckets left
    assert len(calls) == 1 and "background_compile" not in caplog.text


def test_multi_step_decoding_compiles_everything_first():
    llm = LLM(checkpoint("llama"), **small_engine_args(background_compile=True, num_scheduler_steps=4,
                                                       skip_precompile=False))
    assert llm.engine.core.runner.background_compiles_left() == 0


EXIT_WHILE_COMPILING = """
import time
from jaxserve import LLM
llm = LLM(compilation_cache_dir=None, show_progress=False, max_num_seqs=8, max_num_batched_tokens=64,
          max_model_len=256)  # the offline default: background compiles (of a short ladder)
runner = llm.engine.core.runner
assert runner.background_compiles_left() > 0
while runner.num_background_compiles < 1:
    time.sleep(0.01)
time.sleep(0.3)  # the script ends inside the next bucket's compile
"""


def test_the_offline_default_and_a_process_that_exits_while_its_buckets_compile(tmp_path):
    """LLM() compiles in the background by default, and a script that ends while those compiles run exits cleanly
    (XLA's default flags: a compile long enough to be inside; before the runner stopped its thread at exit, such a
    process aborted in 3 runs of 3)."""
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", EXIT_WHILE_COMPILING], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "background_compile" not in result.stderr  # no failure reported for a compile the exit cut short
