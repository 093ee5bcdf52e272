"""Prefix caching and copy-on-write on the real engine (CPU), for every fixture architecture.

Caching must change no output: greedy and seeded samples are identical with prefix caching on and
off, on random workloads whose prompts share prefixes of random lengths, with a KV pool small enough
to force eviction and preemption, arrivals over time and aborts mid-run (driven through LLMEngine).
n > 1 samples share their prompt's pages and give exactly the tokens of n independent requests
seeded seed + i, holding fewer pages at peak. Different cache salts never hit each other's pages; a
request asking for prompt logprobs takes no hits and gets the exact logprobs; nothing compiles after
warm-up and every page is free at the end.

One module-scoped pair of engines per architecture, prefix caching on and off (the second engine
has the same shapes, so it compiles nothing new); every run starts from an empty prefix cache.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import checkpoint, small_engine_args
from jaxserve import LLM, SamplingParams

PAGE_SIZE = 8
# 20 usable pages of 8 tokens: a request of up to 64 tokens takes 8, so a few in flight preempt.
ENGINE_ARGS = dict(page_size=PAGE_SIZE, num_pages=21, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
                   skip_precompile=False)
VOCAB = 512  # every fixture checkpoint's vocabulary
_ids = itertools.count()


# Prefix caching is the same for every architecture; these three cover plain attention, a sliding window
# (Mistral) and q/k norms (Qwen3). The others differ only in RoPE scaling and biases (test_engine_vs_hf.py).
PREFIX_ARCHITECTURES = ("llama", "mistral", "qwen3")


@pytest.fixture(scope="module", params=PREFIX_ARCHITECTURES)
def arch(request):
    """(architecture name, engine with prefix caching on (the default), engine with it off)."""
    # The compilation counter is process-wide, so the engine built last sees no other engine's warm-up.
    off = LLM(checkpoint(request.param), **small_engine_args(**ENGINE_ARGS, enable_prefix_caching=False))
    on = LLM(checkpoint(request.param), **small_engine_args(**ENGINE_ARGS))
    assert on.engine.core.kv.enable_prefix_caching and not off.engine.core.kv.enable_prefix_caching
    yield request.param, on, off
    assert on.stats()["compilations_after_warmup"] == 0, "shared pages made the engine compile after warm-up"


# ---- driving LLMEngine step by step -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Job:
    prompt: tuple[int, ...]
    params: SamplingParams
    salt: str | None = None
    arrival_step: int = 0
    abort_step: int | None = None  # engine steps after arrival at which the request is aborted


@dataclasses.dataclass
class Run:
    outputs: list[list[list[int]]]  # per job, per sample: token ids
    reasons: list[list[str | None]]  # per job, per sample: finish reason
    num_cached: list[int]  # per job: RequestOutput.num_cached_tokens
    prompt_logprobs: list
    peak_pages: int  # most pages held at once (kv_pages_total - kv_pages_free after any step)
    stats_before: dict
    stats_after: dict

    def delta(self, key: str) -> int:
        return self.stats_after[key] - self.stats_before[key]


def drive(llm: LLM, jobs: list[Job]) -> Run:
    """Add each job at its arrival step, abort at its abort step, step LLMEngine until all end."""
    engine = llm.engine
    llm.reset_prefix_cache()  # every run starts from an empty prefix cache
    before = engine.stats()
    ids = [f"pc{next(_ids)}" for _ in jobs]
    final: dict[str, object] = {}
    peak = 0
    step = 0
    last_arrival = max(job.arrival_step for job in jobs)
    while step <= last_arrival or engine.has_unfinished_requests():
        assert step < 2000, "the engine made no progress"
        for request_id, job in zip(ids, jobs):
            if job.arrival_step == step:
                engine.submit(request_id, engine.make_requests(request_id, list(job.prompt), job.params,
                                                               cache_salt=job.salt))
            if job.abort_step is not None and job.arrival_step + job.abort_step == step and request_id not in final:
                output = engine.abort_request(request_id)
                if output is not None:
                    final[request_id] = output
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
        stats = engine.stats()
        peak = max(peak, stats["kv_pages_total"] - stats["kv_pages_free"])
        step += 1
    after = engine.stats()
    assert after["kv_pages_free"] == after["kv_pages_total"], "pages are still held after every request ended"
    assert after["num_requests_running"] == after["num_requests_waiting"] == 0
    # The compilation counter is process-wide (a second engine's warm-up counts too): compare the run's.
    assert after["compilations_after_warmup"] == before["compilations_after_warmup"], "a run compiled"
    assert after["lazy_bucket_compilations"] == before["lazy_bucket_compilations"]
    results = [final[request_id] for request_id in ids]
    return Run(
        outputs=[[sample.token_ids for sample in out.outputs] for out in results],
        reasons=[[sample.finish_reason for sample in out.outputs] for out in results],
        num_cached=[out.num_cached_tokens for out in results],
        prompt_logprobs=[out.prompt_logprobs for out in results],
        peak_pages=peak, stats_before=before, stats_after=after,
    )


def assert_same_outputs(jobs: list[Job], on: Run, off: Run) -> None:
    """Identical tokens and finish reasons; an aborted request's shorter output is a prefix of the other."""
    for index, job in enumerate(jobs):
        for sample, (a, b) in enumerate(zip(on.outputs[index], off.outputs[index], strict=True)):
            reasons = (on.reasons[index][sample], off.reasons[index][sample])
            if job.abort_step is not None and "abort" in reasons:
                shorter, longer = sorted((a, b), key=len)
                assert longer[: len(shorter)] == shorter, f"job {index} sample {sample}: {a} vs {b}"
            else:
                assert a == b, f"job {index} sample {sample}: caching on gives {a}, off gives {b}"
                assert reasons[0] == reasons[1]


def run_on_and_off(arch, jobs: list[Job]) -> tuple[Run, Run]:
    _, on_engine, off_engine = arch
    on, off = drive(on_engine, jobs), drive(off_engine, jobs)
    assert off.delta("prefix_cache_queries") == off.delta("prefix_cache_hits") == 0
    assert_same_outputs(jobs, on, off)
    return on, off


def random_tokens(rng: random.Random, count: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB) for _ in range(count))


# ---- random workloads ---------------------------------------------------------------------------


@st.composite
def workloads(draw):
    """Up to 9 requests whose prompts share prefixes of random lengths (two families), random salts,
    greedy or seeded samples (some with n = 2), arrivals over 5 steps and some aborts."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    families = [random_tokens(rng, 40), random_tokens(rng, 40)]
    jobs = []
    for _ in range(draw(st.integers(3, 9))):
        family = draw(st.sampled_from(families))
        prompt = family[: draw(st.integers(0, 40))] + random_tokens(rng, draw(st.integers(1, 16)))
        max_tokens = draw(st.integers(1, 16))
        if draw(st.booleans()):
            params = SamplingParams(temperature=0, max_tokens=max_tokens)
        else:
            params = SamplingParams(temperature=1.0, seed=draw(st.integers(0, 1000)), max_tokens=max_tokens,
                                    n=draw(st.sampled_from([1, 1, 2])))
        jobs.append(Job(prompt, params, salt=draw(st.sampled_from([None, None, None, "s"])),
                        arrival_step=draw(st.integers(0, 4)),
                        abort_step=draw(st.one_of(st.none(), st.none(), st.none(), st.integers(1, 12)))))
    return jobs


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(jobs=workloads())
def test_random_shared_prefix_workloads_same_on_and_off(arch, jobs):
    run_on_and_off(arch, jobs)


def test_shared_system_prompt_with_eviction_and_preemption(arch):
    """A fixed heavy workload: a 32-token system prompt shared by 10 requests arriving over time, two
    other prefixes, n = 2, aborts; the pool preempts and evicts, the cache hits, outputs are the same."""
    rng = random.Random(7)
    system, other = random_tokens(rng, 32), random_tokens(rng, 24)
    jobs = []
    for index in range(10):
        prefix = system if index % 3 else other[: rng.randrange(8, 25)]
        params = (SamplingParams(temperature=0, max_tokens=8, ignore_eos=True) if index % 2 else
                  SamplingParams(temperature=0.9, seed=100 + index, max_tokens=8, n=2, ignore_eos=True))
        jobs.append(Job(prefix + random_tokens(rng, rng.randrange(1, 12)), params, arrival_step=index // 2,
                        abort_step=5 if index in (3, 8) else None))
    on, off = run_on_and_off(arch, jobs)
    assert on.delta("prefix_cache_hits") > 0
    assert on.delta("preemptions") > 0 and off.delta("preemptions") > 0, "the pool was sized to preempt"
    assert on.delta("prefix_cache_hits") <= on.delta("prefix_cache_queries")


# ---- seeded samples and n > 1 --------------------------------------------------------------------


def test_seeded_samples_same_on_and_off(arch):
    rng = random.Random(11)
    shared = random_tokens(rng, 24)
    jobs = [Job(shared + random_tokens(rng, 3 + i), SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=8),
                arrival_step=i) for i in range(6)]
    on, _ = run_on_and_off(arch, jobs)
    assert on.delta("prefix_cache_hits") > 0
    assert sum(on.num_cached) > 0


@pytest.mark.parametrize("prompt_len", [33, 32])  # the last prompt page partly filled, and full
def test_n_samples_share_pages_and_equal_independent_seeded_requests(arch, prompt_len):
    _, on, off = arch
    prompt = random_tokens(random.Random(prompt_len), prompt_len)
    n, seed = 4, 1234
    shared_params = SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=6, ignore_eos=True)
    shared = drive(on, [Job(prompt, shared_params)])
    # Independent: n requests seeded seed + i that share nothing (caching off).
    independent = drive(off, [Job(prompt, dataclasses.replace(shared_params, n=1, seed=seed + i)) for i in range(n)])
    assert shared.delta("prefix_cache_hits") == 0  # what is shared is forked, not found in the cache
    assert shared.outputs[0] == [out[0] for out in independent.outputs]
    assert len({tuple(tokens) for tokens in shared.outputs[0]}) > 1, "the samples should differ"
    assert shared.peak_pages < independent.peak_pages, (shared.peak_pages, independent.peak_pages)
    # The prompt's pages are held once; each sample privately holds at most the pages from the one its
    # first write goes to (its copy of the prompt's last page) on.
    pages_each = -(-(prompt_len + 6) // PAGE_SIZE)
    read_only = (prompt_len - 1) // PAGE_SIZE
    assert shared.peak_pages <= -(-prompt_len // PAGE_SIZE) + n * (pages_each - read_only)


# ---- salts, prompt logprobs ----------------------------------------------------------------------


def test_different_cache_salts_never_hit_each_other(arch):
    _, llm, _ = arch
    llm.reset_prefix_cache()
    rng = random.Random(5)
    # Small enough that "alice"'s cached pages outlive the other runs (the pool holds 20 pages).
    prompts = [random_tokens(rng, 20) for _ in range(2)]
    greedy = SamplingParams(temperature=0, max_tokens=4)

    def generate(salt):
        before = llm.stats()["prefix_cache_hits"]
        prompt_dicts = [{"prompt_token_ids": list(p), **({} if salt is None else {"cache_salt": salt})}
                        for p in prompts]
        outputs = llm.generate(prompt_dicts, greedy, use_tqdm=False)
        return outputs, llm.stats()["prefix_cache_hits"] - before

    first, hits = generate("alice")
    assert hits == 0
    for salt in ("bob", None):
        outputs, hits = generate(salt)
        assert hits == 0 and all(out.num_cached_tokens == 0 for out in outputs), salt
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in first]
    again, hits = generate("alice")  # alice's pages were cached all along
    assert hits > 0 and all(out.num_cached_tokens > 0 for out in again)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_prompt_logprobs_take_no_hits_and_are_exact(arch):
    _, llm, off = arch
    prompt = random_tokens(random.Random(3), 40)
    scoring = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    (reference,) = off.generate([{"prompt_token_ids": list(prompt)}], scoring, use_tqdm=False)
    llm.reset_prefix_cache()
    (plain,) = llm.generate([{"prompt_token_ids": list(prompt)}], SamplingParams(temperature=0, max_tokens=2),
                            use_tqdm=False)  # the prompt's pages are now cached
    before = llm.stats()
    (scored,) = llm.generate([{"prompt_token_ids": list(prompt)}], scoring, use_tqdm=False)
    after = llm.stats()
    (hit,) = llm.generate([{"prompt_token_ids": list(prompt)}], SamplingParams(temperature=0, max_tokens=2),
                          use_tqdm=False)
    assert hit.num_cached_tokens > 0, "the prompt's pages were cached"
    assert after["prefix_cache_hits"] == before["prefix_cache_hits"]
    assert scored.num_cached_tokens == 0
    assert scored.outputs[0].token_ids == reference.outputs[0].token_ids == plain.outputs[0].token_ids
    assert len(scored.prompt_logprobs) == len(prompt) and scored.prompt_logprobs[0] is None
    for got, want in zip(scored.prompt_logprobs[1:], reference.prompt_logprobs[1:], strict=True):
        assert got.keys() == want.keys()
        for token_id, logprob in got.items():
            assert logprob.rank == want[token_id].rank
            assert logprob.logprob == pytest.approx(want[token_id].logprob, abs=1e-5)
    assert after["kv_pages_free"] == after["kv_pages_total"]
    assert after["compilations_after_warmup"] == before["compilations_after_warmup"]
