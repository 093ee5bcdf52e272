"""Speculative decoding with the n-gram proposer on the real engine (issue 15).

Greedy outputs must be identical with and without speculation, on prompts that repeat themselves (so
many proposals are made, some accepted, some rejected), under preemption and chunked prefill (the
long workload overflows a 31-page pool, and its prompts are longer than the 32-token budget), and
with requests that cannot speculate (min_tokens, a grammar) in the same batch; penalised requests and requests with
logprobs speculate (with the plain engine's logprobs), and decodes verify beside prompt chunks. Seeded
sampling gives the plain engine's tokens.
Nothing compiles after warm-up and every page comes back. Distribution exactness of the verifier is
tests/test_spec_verify.py's.

Engines have the shapes of test_async_and_multistep's (8 rows, token buckets 16 and 32, 31 usable pages).
"""

from __future__ import annotations

import random
import types

import pytest

from helpers import (
    check_same_tokens_under_preemption, check_seeded_runs_give_plain_tokens, checkpoint, small_engine_args,
    spec_generate,
)
from jaxserve import LLM, SamplingParams
from jaxserve.structured.params import StructuredOutputsParams

ENGINE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=32, num_pages=32, skip_precompile=False)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def engines():
    return {"plain": LLM(checkpoint("llama"), **small_engine_args(**ENGINE_ARGS)),
            "spec": LLM(checkpoint("llama"), **small_engine_args(**ENGINE_ARGS, speculative_config=SPEC,
                                                                 enable_structured_outputs=True))}


def _recorded_steps(llm, monkeypatch) -> list:
    """The list the engine's scheduler appends each step's SchedulerOutput to, from now on."""
    scheduler, outputs = llm.engine.core.scheduler, []

    def recorded(schedule=scheduler.schedule):
        outputs.append(schedule())
        return outputs[-1]

    monkeypatch.setattr(scheduler, "schedule", recorded)
    return outputs


def _always_proposing(llm, monkeypatch) -> None:
    """Make the engine's n-gram proposer guess k tokens whenever it is asked: its own guess, padded with the
    request's last token, so a decode verifies whenever the step leaves budget, whatever the model writes."""
    timed = llm.engine.core.scheduler.proposer
    ngram, k = timed.proposer, SPEC["num_speculative_tokens"]

    def propose(requests):
        last = [r.token_ids(r.num_known_tokens - 1, r.num_known_tokens) for r in requests]
        return [(guess + tail * k)[:k] for guess, tail in zip(ngram.propose(requests), last)]

    monkeypatch.setattr(timed, "proposer", types.SimpleNamespace(propose=propose, release=ngram.release))


def _is_prompt_chunk(item) -> bool:
    """True for a scheduled chunk of a request's prompt (a prompt's last chunk leaves budget for proposals)."""
    return item.num_computed_tokens < len(item.request.prompt_token_ids)


def _repetitive_prompts() -> list[list[int]]:
    rng = random.Random(3)
    prompts = []
    for index in range(6):
        motif = [rng.randrange(4, 500) for _ in range(rng.randint(2, 6))]
        prompts.append((motif * 20)[: 12 + 3 * index])
    return prompts


def test_greedy_outputs_are_identical_with_speculation(engines):
    prompts = _repetitive_prompts()
    want, _ = spec_generate(engines["plain"], prompts, GREEDY)
    got, moved = spec_generate(engines["spec"], prompts, GREEDY)
    assert got == want
    assert moved["num_draft_tokens"] > 20, f"too few proposals to mean anything: {moved}"
    assert 0 < moved["num_accepted_tokens"] < moved["num_draft_tokens"], f"want accepts and rejects: {moved}"


def test_greedy_outputs_are_identical_under_preemption_and_chunked_prefill(engines, monkeypatch):
    """Ten requests of 40-100 prompt tokens (chunked: the budget is 32) and 60 outputs for 31 pages. Decodes
    verify their proposals in the steps that also carry other requests' prompt chunks."""
    steps = _recorded_steps(engines["spec"], monkeypatch)
    _always_proposing(engines["spec"], monkeypatch)
    rng = random.Random(9)
    prompts = [([rng.randrange(4, 500) for _ in range(rng.randint(3, 8))] * 30)[: rng.randint(40, 100)]
               for _ in range(10)]
    moved = check_same_tokens_under_preemption(engines["plain"], engines["spec"], prompts, GREEDY.clone(max_tokens=60))
    assert moved["num_accepted_tokens"] > 0
    mixed = [o for o in steps if any(i.spec_token_ids for i in o.scheduled) and any(map(_is_prompt_chunk, o.scheduled))]
    assert mixed, "no step verified proposals beside a prompt chunk"


def test_requests_that_cannot_speculate_share_the_batch(engines, monkeypatch):
    """min_tokens still banning stop ids, or prompt logprobs still to score, keep a request from proposing, not
    the others: the long prompt's chunks are scored in steps where the others verify. Every output (and the
    prompt logprobs) equals the plain engine's."""
    prompts = _repetitive_prompts()[:4] + [([5, 9, 14] * 40)[:90]]
    params = [GREEDY, GREEDY.clone(logprobs=2), GREEDY.clone(max_tokens=5, min_tokens=4, stop_token_ids=[7]),
              GREEDY.clone(max_tokens=1), GREEDY.clone(max_tokens=8, prompt_logprobs=1)]
    want = engines["plain"].generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    steps = _recorded_steps(engines["spec"], monkeypatch)
    _always_proposing(engines["spec"], monkeypatch)
    got = engines["spec"].generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [len(o.outputs[0].token_ids) for o in got] == [48, 48, 5, 1, 8]
    for expected, actual in zip(want[4].prompt_logprobs[1:], got[4].prompt_logprobs[1:], strict=True):
        assert expected.keys() == actual.keys()
        assert all(actual[t].logprob == pytest.approx(e.logprob, abs=1e-4) for t, e in expected.items())
    scored = lambda item: item.request.sampling_params.prompt_logprobs and _is_prompt_chunk(item)  # noqa: E731
    assert any(any(i.spec_token_ids for i in o.scheduled) and any(map(scored, o.scheduled)) for o in steps), (
        "no prompt chunk was scored in a verifying step")


def test_a_constrained_request_shares_the_verifying_steps(engines, monkeypatch):
    """A request with a grammar proposes nothing (its mask is known for one position) but is sampled under its
    mask in the steps where the others verify: its output is one of its choices and theirs the plain engine's."""
    prompts = _repetitive_prompts()
    choices = ["alpha beta", "gamma"]
    constrained = SamplingParams(temperature=0.0, max_tokens=16,
                                 structured_outputs=StructuredOutputsParams(choice=choices))
    want, _ = spec_generate(engines["plain"], prompts[1:], GREEDY)
    steps = _recorded_steps(engines["spec"], monkeypatch)
    got, _ = spec_generate(engines["spec"], prompts, [constrained] + [GREEDY] * (len(prompts) - 1))
    assert got[1:] == want
    assert engines["spec"].get_tokenizer().decode(got[0][0]) in choices
    assert any(any(i.spec_token_ids for i in o.scheduled)
               and any(i.request.constraint and i.samples for i in o.scheduled)
               for o in steps), "no step verified proposals beside the constrained request's sample"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_requests_with_logprobs_speculate_and_get_the_plain_logprobs(engines, temperature):
    """Each emitted token's logprobs come from the target's logits at its verified position: the same tokens,
    ranks and (to float tolerance) logprobs as the plain engine's."""
    prompts = _repetitive_prompts()
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=24, ignore_eos=True, logprobs=2)
    before = engines["spec"].stats()["spec_decode"]["num_draft_tokens"]
    want = engines["plain"].generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = engines["spec"].generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert engines["spec"].stats()["spec_decode"]["num_draft_tokens"] - before > 20
    for plain, spec in zip(want, got):
        assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
        for expected, actual in zip(plain.outputs[0].logprobs, spec.outputs[0].logprobs, strict=True):
            assert expected.keys() == actual.keys()
            for token, entry in expected.items():
                assert actual[token].rank == entry.rank
                assert actual[token].logprob == pytest.approx(entry.logprob, abs=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_penalised_requests_speculate_and_keep_the_plain_tokens(engines, temperature):
    """Penalties, logit biases and allowed ids apply at every verified position (the proposals before it
    counted as output), so such requests verify proposals and still give the plain engine's tokens."""
    prompts = _repetitive_prompts()
    params = [SamplingParams(temperature=temperature, seed=11, max_tokens=40, ignore_eos=True, **extra) for extra in (
        {"repetition_penalty": 1.2}, {"presence_penalty": 0.5, "frequency_penalty": 0.3},
        {"logit_bias": {prompts[2][0]: 2.0}}, {"allowed_token_ids": sorted(set(prompts[3]))[:5]},
        {"repetition_penalty": 0.9, "top_k": 20}, {})]
    want, _ = spec_generate(engines["plain"], prompts, params)
    got, moved = spec_generate(engines["spec"], prompts, params)
    assert got == want
    assert moved["num_draft_tokens"] > 20, f"too few proposals to mean anything: {moved}"


def test_seeded_sampling_gives_the_plain_engines_tokens(engines):
    """Each emitted token is the one plain sampling draws at its index (sampling/verify.py), so seeded outputs equal
    the plain engine's, run after run (the second run's prompts hit the prefix cache: other steps verify)."""
    prompts = _repetitive_prompts()
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=5, max_tokens=32, ignore_eos=True, n=2)
    moved = check_seeded_runs_give_plain_tokens(engines["plain"], engines["spec"], prompts, params)
    assert moved["num_draft_tokens"] > 0


def test_spec_decode_stats(engines):
    spec_generate(engines["spec"], _repetitive_prompts(), GREEDY)
    stats = engines["spec"].stats()["spec_decode"]
    assert stats["num_emitted_tokens"] == stats["num_accepted_tokens"] + stats["num_drafts"]
    assert len(stats["accepted_per_position"]) == SPEC["num_speculative_tokens"]
    assert sum(stats["accepted_per_position"]) == stats["num_accepted_tokens"]
    rates = stats["acceptance_rate_per_position"]
    assert all(a >= b for a, b in zip(rates, rates[1:])), "a later proposal is accepted only after the earlier ones"
    assert 1.0 <= stats["mean_acceptance_length"] <= 1 + SPEC["num_speculative_tokens"]


def test_prometheus_counters_follow_the_stats(engines):
    from prometheus_client.parser import text_string_to_metric_families

    from jaxserve.engine.served_model import ServedModel
    from jaxserve.server.metrics import ServerMetrics, cache_config_info

    llm = engines["spec"]
    spec_generate(llm, _repetitive_prompts(), GREEDY)
    kv_cache = ServedModel.of(llm.engine).kv_cache
    metrics = ServerMetrics("vllm", "llama", lambda: [llm.stats()], 128, cache_config_info(kv_cache))
    samples = [s for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples]
    values = {s.name: s.value for s in samples if "position" not in s.labels}
    stats = llm.stats()["spec_decode"]
    assert values["vllm:spec_decode_num_drafts_total"] == stats["num_drafts"] > 0
    assert values["vllm:spec_decode_num_draft_tokens_total"] == stats["num_draft_tokens"]
    assert values["vllm:spec_decode_num_accepted_tokens_total"] == stats["num_accepted_tokens"]
    per_position = {int(s.labels["position"]): s.value for s in samples if "position" in s.labels}
    assert per_position == dict(enumerate(stats["accepted_per_position"]))
