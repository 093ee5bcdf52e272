"""Speculative decoding with a draft model (issue 15): jaxserve/spec_decode/draft.py and spec_decode/draft_runner.py.

The proposer's bookkeeping is checked against a fake draft runner (which tokens it feeds at which positions
as proposals are accepted or rejected, the step budget, its pages). On the real engine, greedy outputs must
be identical with and without speculation for two drafts of the test vocabulary: the target itself (its
greedy proposals are the target's own tokens, so nearly all are accepted) and the qwen3 test checkpoint (a
different random model: nearly all rejected), under preemption and chunked prefill too. Nothing compiles
after warm-up and every page of both pools comes back.

Engines have the shapes of test_spec_decode's (8 rows, token buckets 16 and 32, 31 usable pages).
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_runner import RequestSpec
from helpers import (
    check_same_tokens_under_preemption, check_seeded_runs_give_plain_tokens, checkpoint, small_engine_args,
    spec_generate,
)
from jaxserve import LLM, SamplingParams
from jaxserve.batch.builder import BucketLadders
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import ASSETS_DIR, DEFAULT_MODEL_NAME
from jaxserve.kv.page_pool import NULL_PAGE
from jaxserve.spec_decode.draft import DraftModelProposer

ENGINE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=32, num_pages=32, skip_precompile=False)
SELF_DRAFT = {"method": "draft_model", "model": checkpoint("llama"), "num_speculative_tokens": 3}
OTHER_DRAFT = {"model": checkpoint("qwen3"), "num_speculative_tokens": 2}  # method inferred from `model`
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


# ---- the proposer's bookkeeping, with a fake draft runner -------------------------------------------------


class FakeDraftRunner:
    """Records what each proposal step feeds; row r proposes 1000 * (call) + 10 * r + i for i < k."""

    page_size = 4

    def __init__(self, num_proposals: int, max_num_batched_tokens: int):
        self.num_proposals = num_proposals
        self.ladders = BucketLadders.build(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=4,
                                           max_model_len=64, page_size=4, min_token_bucket=4, max_aux_extra=0)
        self.calls: list[dict] = []
        self.copies: list[list[tuple[int, int]]] = []  # each call's (source, copy) page copies
        self.fail = False  # propose raises

    def allocate_kv(self, num_pages: int) -> None:
        pass

    def warmup(self, show_progress: bool = True) -> None:
        pass

    def propose(self, batch, steps) -> np.ndarray:
        if self.fail:
            raise RuntimeError("the device call failed")
        self.copies.append([(int(s), int(d)) for s, d in zip(batch.copy_src, batch.copy_dst) if s != NULL_PAGE])
        fed = int(batch.query_start_loc[batch.num_seqs])
        self.calls.append({"tokens": batch.input_ids[:fed].tolist(), "positions": batch.positions[:fed].tolist(),
                           "further": steps.num_steps[: batch.num_seqs].tolist()})
        rows = batch.page_table.shape[0]
        base = 1000 * len(self.calls)
        return np.asarray([[base + 10 * row + i for row in range(rows)] for i in range(self.num_proposals)])


def _proposer(num_pages: int = 40, budget: int = 16, k: int = 3,
              prefix_caching: bool = False) -> tuple[DraftModelProposer, FakeDraftRunner]:
    runner = FakeDraftRunner(k, budget)
    proposer = DraftModelProposer(runner, max_num_batched_tokens=budget, max_model_len=64,
                                  enable_prefix_caching=prefix_caching)
    proposer.allocate(num_pages, show_progress=False)
    return proposer, runner


def test_draft_feeds_what_it_lacks_and_keeps_the_accepted_proposals():
    proposer, runner = _proposer()
    request = RequestSpec("a", prompt_len=20, max_tokens=30).build(64)
    prompt = list(request.prompt_token_ids)

    assert proposer.propose([request]) == [[]]  # the 16-token budget covers part of the prompt: no proposal yet
    assert runner.calls[-1] == {"tokens": prompt[:16], "positions": list(range(16)), "further": [0]}

    guess = proposer.propose([request])[0]  # the rest of the prompt, then 3 proposals (2 of them fed back)
    assert guess == [2000, 2001, 2002]
    assert runner.calls[-1] == {"tokens": prompt[16:], "positions": [16, 17, 18, 19], "further": [2]}

    request.output_token_ids += [2000, 7]  # the target accepted the first proposal and emitted 7
    guess = proposer.propose([request])[0]
    assert runner.calls[-1] == {"tokens": [7], "positions": [21], "further": [2]}  # KV of 2000 kept, 2001 not

    request.output_token_ids += guess + [9]  # all three accepted: the third was never fed
    proposer.propose([request])
    assert runner.calls[-1] == {"tokens": [guess[2], 9], "positions": [24, 25], "further": [2]}

    proposer.release("a")
    assert proposer.kv.pool.num_free == proposer.kv.pool.num_usable
    proposer.propose([request])  # forgotten: starts from the prompt again
    assert runner.calls[-1]["positions"] == list(range(16))


def test_draft_shares_the_budget_and_stops_before_max_model_len():
    proposer, runner = _proposer(budget=16)
    first = RequestSpec("a", prompt_len=12, max_tokens=30).build(64)
    second = RequestSpec("b", prompt_len=12, max_tokens=30).build(64)
    guesses = proposer.propose([first, second])
    assert guesses[0] == [1000, 1001, 1002] and guesses[1] == []  # b's 12 tokens do not fit the 4 left
    assert runner.calls[-1]["positions"] == list(range(12)) + [0, 1, 2, 3]
    assert runner.calls[-1]["further"] == [2, 0]

    near_end = RequestSpec("c", prompt_len=63, max_tokens=1, resolve_max_tokens=False).build(64)
    proposer, runner = _proposer(budget=64)
    assert proposer.propose([near_end]) == [[1000, 1001]]  # position 63 is the last one a proposal is fed at
    assert runner.calls[-1]["further"] == [1]


def test_a_request_whose_draft_pages_cannot_be_had_gets_no_proposal():
    proposer, runner = _proposer(num_pages=5)  # 4 usable pages of 4 tokens
    small = RequestSpec("a", prompt_len=6, max_tokens=30).build(64)
    large = RequestSpec("b", prompt_len=14, max_tokens=30).build(64)
    assert proposer.propose([small, large]) == [[1000, 1001, 1002], []]
    assert proposer.kv.page_ids("b") == []  # nothing left held by the request that did not fit
    assert len(runner.calls[-1]["further"]) == 1


def _sharing(prompt: list[int], tail: int, request_id: str, salt: str | None = None):
    """A request whose prompt is `prompt` and then `tail` tokens of its own (page size 4)."""
    request = RequestSpec(request_id, prompt_len=len(prompt) + tail, max_tokens=30).build(64)
    request.prompt_token_ids = list(prompt) + list(request.prompt_token_ids[len(prompt):])
    request.cache_salt = salt
    return request


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_draft_takes_a_cached_prefix_and_feeds_only_the_rest(prefix_caching):
    proposer, runner = _proposer(prefix_caching=prefix_caching)
    shared = list(range(100, 110))  # two full pages and half of a third
    first, second = _sharing(shared, 3, "a"), _sharing(shared, 2, "b")
    proposer.propose([first])
    proposer.propose([second])
    if prefix_caching:  # the first two pages come from the cache: b feeds from position 8 on
        assert runner.calls[-1]["positions"] == list(range(8, 12))
        assert proposer.kv.page_ids("b")[:2] == proposer.kv.page_ids("a")[:2]
        assert proposer.num_cached_tokens == 8
    else:
        assert runner.calls[-1]["positions"] == list(range(12))
        assert proposer.num_cached_tokens == 0
    assert proposer.num_fed_tokens == 13 + 12 - proposer.num_cached_tokens
    proposer.release("a")
    proposer.release("b")
    assert proposer.kv.pool.num_free == proposer.kv.pool.num_usable


def test_draft_rows_of_one_call_share_pages_scheduled_before_them():
    """The other samples of a request (n > 1) first propose in the same call: the first row computes the shared
    pages, the later rows take them (K/V are written before any row attends)."""
    proposer, runner = _proposer(budget=32, prefix_caching=True)
    prompt = list(range(200, 210))
    samples = [_sharing(prompt, 0, f"s{i}") for i in range(3)]
    for sample in samples:
        sample.output_token_ids.append(7)  # the target emitted the first token: 11 known tokens
    proposer.propose(samples)
    assert runner.calls[-1]["positions"] == list(range(11)) + [8, 9, 10] * 2
    assert [proposer.kv.page_ids(s.request_id)[:2] for s in samples[1:]] == [proposer.kv.page_ids("s0")[:2]] * 2


def test_draft_prefix_cache_keeps_salts_apart():
    proposer, runner = _proposer(prefix_caching=True)
    prompt = list(range(300, 310))
    proposer.propose([_sharing(prompt, 0, "a", salt="x")])
    proposer.propose([_sharing(prompt, 0, "b", salt="y")])
    assert runner.calls[-1]["positions"] == list(range(10))


def test_draft_copies_a_shared_page_before_writing_into_it():
    """A request fed up to its last token feeds that token again to propose; when another request took its last
    full page from the cache meanwhile, the draft writes into a private copy of it."""
    proposer, runner = _proposer(prefix_caching=True)
    first = _sharing(list(range(400, 408)), 0, "a")  # exactly two pages
    proposer.propose([first])
    assert runner.calls[-1]["positions"] == list(range(8))
    second = _sharing(list(range(400, 408)), 4, "b")
    proposer.propose([second])  # takes a's two pages
    shared = proposer.kv.page_ids("a")[1]
    assert proposer.kv.page_ids("b")[1] == shared
    proposer.propose([first])  # nothing new for a: position 7 again, in a page b holds
    assert runner.calls[-1]["positions"] == [7]
    assert runner.copies[-1] == [(shared, proposer.kv.page_ids("a")[1])]
    assert proposer.kv.page_ids("a")[1] != shared and proposer.kv.page_ids("b")[1] == shared


def test_a_failed_draft_call_forgets_its_rows_and_the_pages_it_registered():
    proposer, runner = _proposer(prefix_caching=True)
    request = _sharing(list(range(500, 510)), 0, "a")
    runner.fail = True
    with pytest.raises(RuntimeError, match="device call failed"):
        proposer.propose([request])
    assert proposer.kv.pool.num_free == proposer.kv.pool.num_usable and proposer.kv.pool.num_cached == 0
    runner.fail = False
    proposer.propose([_sharing(list(range(500, 510)), 0, "b")])
    assert runner.calls[-1]["positions"] == list(range(10))  # nothing was taken from the failed call's pages


class ShadowDraftRunner(FakeDraftRunner):
    """A fake draft runner that also keeps what each KV slot of the draft's pool holds (the token id written there):
    a call makes its page copies, writes its fed tokens at their slots and each proposal it feeds back at the
    position after the one before, and never writes one slot twice. Its proposals are 30 or 31, tokens the
    requests' own tails hold too."""

    def __init__(self, num_proposals: int, max_num_batched_tokens: int, num_pages: int):
        super().__init__(num_proposals, max_num_batched_tokens)
        self.slots = np.full((num_pages * self.page_size,), -1)  # (pages * page size,) token id held

    def propose(self, batch, steps) -> np.ndarray:
        proposals = 30 + super().propose(batch, steps) % 2  # (k, R)
        size = self.page_size
        for source, copy in self.copies[-1]:
            self.slots[copy * size : (copy + 1) * size] = self.slots[source * size : (source + 1) * size]
        fed = int(batch.query_start_loc[batch.num_seqs])
        written = [int(slot) for slot in batch.slot_mapping[:fed]]
        self.slots[written] = batch.input_ids[:fed]
        for row in range(int(batch.num_seqs)):
            for step in range(int(steps.num_steps[row])):
                position = int(batch.seq_lens[row]) + step
                slot = int(batch.page_table[row, position // size]) * size + position % size
                self.slots[slot] = proposals[step, row]
                written.append(slot)
        assert len(written) == len(set(written)), "a call wrote one KV slot twice"
        return proposals


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_what_the_draft_believes_it_holds_is_what_its_pages_hold(data):
    """Random requests (two shared prefixes, two salts), proposal calls over random subsets, the target accepting
    a random number of each guess, releases: after every call, each request's pages hold its first tokens and then
    the proposals fed after them, exactly what the proposer counts on (so no row ever wrote into a page another
    request reads), and every page comes back at the end."""
    num_pages, page_size = 24, 4
    budget = data.draw(st.sampled_from([8, 16]), label="budget")
    runner = ShadowDraftRunner(3, budget, num_pages)
    proposer = DraftModelProposer(runner, max_num_batched_tokens=budget, max_model_len=64, enable_prefix_caching=True)
    proposer.allocate(num_pages, show_progress=False)
    prefixes = [[5, 6, 7, 5, 6, 7, 5, 6], [20, 21, 22, 23, 24, 25]]  # two pages and one and a half
    active, guesses = [], {}
    for step in range(data.draw(st.integers(4, 30), label="steps")):
        action = data.draw(st.sampled_from(["add", "propose", "propose", "emit", "release"]))
        if action == "add" or not active:
            prefix = data.draw(st.sampled_from(prefixes))
            tail = data.draw(st.lists(st.integers(30, 31), min_size=0, max_size=5))
            request = _sharing(prefix, 0, f"r{step}", salt=data.draw(st.sampled_from([None, "x"])))
            request.prompt_token_ids = prefix + tail
            active.append(request)
        elif action == "propose":
            chosen = [r for r in active if data.draw(st.booleans())][:4]  # a step's decodes: max_num_seqs at most
            for request, guess in zip(chosen, proposer.propose(chosen)):
                guesses[request.request_id] = guess
        elif action == "emit":
            request = data.draw(st.sampled_from(active))
            guess = guesses.pop(request.request_id, [])
            if request.num_known_tokens + len(guess) + 1 < 60:
                request.output_token_ids += guess[: data.draw(st.integers(0, len(guess)))] + [40 + step % 4]
        else:
            request = active.pop(data.draw(st.integers(0, len(active) - 1)))
            proposer.release(request.request_id)
        for request in active:
            fed = proposer._fed.get(request.request_id)
            if fed is None:
                continue
            want = request.token_ids(0, fed.num_tokens) + fed.proposals
            pages = proposer.kv.page_ids(request.request_id)
            held = [int(runner.slots[pages[p // page_size] * page_size + p % page_size]) for p in range(len(want))]
            assert held == want, (request.request_id, held, want)
    for request in active:
        proposer.release(request.request_id)
    assert proposer.kv.pool.num_free == proposer.kv.pool.num_usable


# ---- the engine -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines():
    return {"plain": LLM(checkpoint("llama"), **small_engine_args(**ENGINE_ARGS)),
            "self": LLM(checkpoint("llama"), **small_engine_args(**ENGINE_ARGS, speculative_config=SELF_DRAFT)),
            "other": LLM(checkpoint("llama"), **small_engine_args(**ENGINE_ARGS, speculative_config=OTHER_DRAFT)),
            "other-tp2": LLM(checkpoint("llama"), tensor_parallel_size=2,
                             **small_engine_args(**ENGINE_ARGS, speculative_config=OTHER_DRAFT))}


def _prompts(count: int, seed: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 500) for _ in range(rng.randint(*lengths))] for _ in range(count)]


@pytest.mark.parametrize("draft", ["self", "other", "other-tp2"])
def test_greedy_outputs_are_identical_with_a_draft_model(engines, draft):
    """Also under tensor parallelism 2: the target and the draft (qwen3: 2 KV heads) sharded over two devices."""
    prompts = _prompts(6, 3, (5, 30))
    want, _ = spec_generate(engines["plain"], prompts, GREEDY)
    got, moved = spec_generate(engines[draft], prompts, GREEDY)
    assert got == want
    assert moved["num_draft_tokens"] > 50, f"too few proposals to mean anything: {moved}"
    rate = moved["num_accepted_tokens"] / moved["num_draft_tokens"]
    if draft == "self":
        assert rate > 0.9, f"the target drafting for itself should agree with itself: {moved}"
    else:
        assert rate < 0.5, f"an unrelated random draft should mostly miss: {moved}"


def test_greedy_outputs_are_identical_under_preemption_and_chunked_prefill(engines):
    """Ten requests of 40-100 prompt tokens (chunked: the budget is 32) and 60 outputs for 31 pages."""
    prompts = _prompts(10, 9, (40, 100))
    moved = check_same_tokens_under_preemption(engines["plain"], engines["self"], prompts, GREEDY.clone(max_tokens=60))
    assert moved["num_accepted_tokens"] > 0


def test_prompts_with_a_shared_prefix_reuse_the_drafts_pages(engines):
    """Six prompts of one 40-token prefix (two full pages of 16) and their own tails: the draft computes the
    prefix once, each later prompt takes its pages from the draft's prefix cache; greedy tokens unchanged."""
    prefix = _prompts(1, 11, (40, 40))[0]
    prompts = [prefix + tail for tail in _prompts(6, 12, (3, 10))]
    want, _ = spec_generate(engines["plain"], prompts, GREEDY)
    before = engines["self"].stats()
    got, moved = spec_generate(engines["self"], prompts, GREEDY)
    after = engines["self"].stats()
    assert got == want and moved["num_accepted_tokens"] > 0
    hits = after["draft_prefix_cache_hits"] - before["draft_prefix_cache_hits"]
    assert hits >= 5 * 32, f"each prompt after the first should take the prefix's two pages: {hits}"
    fed = after["draft_fed_tokens"] - before["draft_fed_tokens"]
    emitted = sum(len(tokens[0]) for tokens in got)
    assert fed <= sum(map(len, prompts)) - hits + emitted
    engines["self"].reset_prefix_cache()  # the draft's cache is forgotten with the target's
    assert engines["self"].engine.core.draft.kv.pool.num_cached == 0


def test_penalised_and_short_requests_share_the_batch(engines):
    prompts = _prompts(4, 5, (5, 20))
    params = [GREEDY, GREEDY.clone(repetition_penalty=1.3), GREEDY.clone(max_tokens=5), GREEDY.clone(max_tokens=1)]
    want = engines["plain"].generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = engines["other"].generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [len(o.outputs[0].token_ids) for o in got] == [40, 40, 5, 1]


def test_seeded_sampling_gives_the_plain_engines_tokens(engines):
    """Each emitted token is the one plain sampling draws at its index (sampling/verify.py), so seeded outputs equal
    the plain engine's, run after run (the second run's prompts hit the prefix cache: other steps verify)."""
    prompts = _prompts(4, 7, (5, 20))
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=5, max_tokens=24, ignore_eos=True, n=2)
    moved = check_seeded_runs_give_plain_tokens(engines["plain"], engines["self"], prompts, params)
    assert moved["num_accepted_tokens"] > 0


@pytest.mark.parametrize("config, message", [
    ({"method": "draft_model"}, "needs `model`"),
    ({"method": "ngram", "model": "somewhere"}, "takes no `model`"),
    ({"method": "medusa"}, "must be one of"),
])
def test_bad_speculative_configs_say_what_to_fix(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=config)


def test_a_draft_with_another_vocabulary_is_refused():
    bundled = os.path.join(ASSETS_DIR, DEFAULT_MODEL_NAME)  # vocabulary 4096, the test checkpoints' 512
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(checkpoint("llama"), **small_engine_args(speculative_config={"model": bundled}))
