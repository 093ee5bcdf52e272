"""The draft-model proposer: a smaller model of the same vocabulary guesses each request's next k tokens.

The draft has its own weights, its own KV pool (as many pages as the target's: it never holds more tokens
than the target does) and its own compiled buckets (spec_decode/draft_runner.py: one call per engine step catches
the draft's KV up and proposes k tokens greedily). The scheduler asks it only for the steps that verify
proposals, and tells it when a request leaves the running batch, which gives its draft pages back.

What the draft's KV holds for a request: the first `num_tokens` tokens of the request, then the proposals it
fed after them (their KV is that of the request's real tokens as far as the target accepted them). So before
each proposal the draft feeds the request's tokens from the first one it does not hold (usually the one or
two the last verification emitted; the whole prompt the first time, in chunks of the step budget when it is
longer) and proposes after the last one. A request whose draft pages cannot be had gets no proposal.

The draft's pool has a prefix cache of its own when the engine's is on (the same KVCacheManager and page hashes
as the target's): a request's first proposal starts from the longest run of its full pages the draft already
holds for another request (a shared system prompt, the other samples of a request with n > 1), so the draft
computes only the rest. Pages are registered as soon as a call schedules their tokens, before it computes them:
a later row of the same call may take them, since every row's K/V is written before any row attends.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxserve.attention import fp8
from jaxserve.batch.builder import BucketLadders, build_batch, padded_decode_step_arrays
from jaxserve.batch.descriptor import BatchDescriptor, DecodeSteps
from jaxserve.config import EngineConfig
from jaxserve.kv.cache_manager import KVCacheManager, pages_for_tokens
from jaxserve.kv.page_pool import PagePool
from jaxserve.model.checkpoint import load_weights
from jaxserve.model.registry import load_model_spec
from jaxserve.model_spec import ModelSpec
from jaxserve.request import Request
from jaxserve.sharding import cache_kv_heads
from jaxserve.spec_decode.draft_runner import DraftRunner
from jaxserve.step import ScheduledRequest, SchedulerOutput


@dataclasses.dataclass
class _Fed:
    """What the draft's KV holds for one request."""

    num_tokens: int  # the request's first tokens
    proposals: list[int]  # proposals fed after them, in order


class DraftModelProposer:
    """Proposes `runner.num_proposals` tokens per request by greedy decoding with the draft model."""

    def __init__(self, runner: DraftRunner, max_num_batched_tokens: int, max_model_len: int,
                 enable_prefix_caching: bool = False):
        self.runner = runner
        self.num_tokens = runner.num_proposals
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.kv: KVCacheManager | None = None  # allocate(): the draft's pages
        self._fed: dict[str, _Fed] = {}  # request id -> what the draft's KV holds
        self.num_fed_tokens = 0  # tokens the draft computed to catch up (proposals fed back not counted)
        self.num_cached_tokens = 0  # tokens it took from its prefix cache instead

    @classmethod
    def load(cls, config: EngineConfig, target: ModelSpec, mesh, ladders: BucketLadders,
             max_model_len: int) -> "DraftModelProposer":
        """The draft that config's speculative_config names, its weights read as the target's are (`load_weights`:
        the engine's dtype, load format and KV cache dtype; never quantized; dummy weights seeded apart from the
        target's); a ValueError when its vocabulary differs from the target's or it is shorter than max_model_len."""
        speculative = config.speculative_config
        model_path = speculative.model
        spec = load_model_spec(model_path).for_max_model_len(max_model_len)
        if spec.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model {model_path!r} has vocab_size {spec.vocab_size} but the target has "
                             f"{target.vocab_size}: a draft model must share the target's tokenizer and vocabulary")
        if spec.max_position_embeddings < max_model_len:
            raise ValueError(f"the draft model {model_path!r} has max_position_embeddings "
                             f"{spec.max_position_embeddings} < max_model_len {max_model_len}: lower max_model_len")
        kv_heads = cache_kv_heads(spec, mesh.devices.size)
        draft_config = config.replace(model=model_path, quantization="none", seed=config.model_config.seed + 1)
        params, dtype = load_weights(draft_config, model_path, spec, mesh, kv_heads)
        runner = DraftRunner(spec, params, mesh, page_size=config.cache_config.page_size, num_cache_kv_heads=kv_heads,
                             cache_dtype=fp8.cache_dtype(config.cache_config.kv_cache_dtype, dtype), ladders=ladders,
                             attention_backend=config.compilation_config.attention_backend,
                             num_proposals=speculative.num_speculative_tokens)
        return cls(runner, config.scheduler_config.max_num_batched_tokens, max_model_len,
                   enable_prefix_caching=config.prefix_caching)

    def allocate(self, num_pages: int, show_progress: bool = True, precompile: bool = True) -> None:
        """Allocate the draft's KV pool of `num_pages` pages and compile its buckets (with `precompile`; else each
        at its first use)."""
        self.runner.allocate_kv(num_pages)
        if precompile:
            self.runner.warmup(show_progress)
        self.kv = KVCacheManager(PagePool(num_pages), self.runner.page_size, self.enable_prefix_caching)

    def release(self, request_id: str) -> None:
        """Give the request's draft pages back and forget what they held."""
        self.kv.free(request_id)
        self._fed.pop(request_id, None)

    def propose(self, requests: list[Request]) -> list[list[int]]:
        """Catch the draft up with each request (as the step budget allows) and propose after its last token."""
        items: list[ScheduledRequest] = []
        further: list[int] = []  # proposals each row makes after its first
        budget = self.max_num_batched_tokens
        page_size = self.runner.page_size
        for request in requests:
            cached = self._cached_prefix(request)
            computed = len(cached) * page_size if cached else self._num_valid(request)
            known = request.num_known_tokens
            end = self._fed_positions(request)  # the positions the draft feeds before it proposes
            take = min(end - computed, budget)
            if take <= 0:
                break
            proposes = take == end - computed
            extra = max(0, min(self.num_tokens - 1, self.max_model_len - known)) if proposes else 0
            total = computed + take + extra
            if not self.kv.allocate_slots(request.request_id, computed, total, cached):
                self.release(request.request_id)
                continue
            self.kv.cache_full_pages(request.request_id, computed + take, request.token_ids, request.cache_salt)
            self.num_cached_tokens += len(cached) * page_size
            self.num_fed_tokens += take
            pages = self.kv.page_ids(request.request_id)[: pages_for_tokens(total, page_size)]
            items.append(ScheduledRequest(request, take, computed, tuple(pages), samples=proposes, num_steps=1 + extra,
                                          page_copies=tuple(self.kv.pop_copies(request.request_id))))
            further.append(extra)
            budget -= take
        if not items:
            return [[] for _ in requests]
        try:
            batch = build_batch(SchedulerOutput(items, []), page_size, self.runner.ladders)
            steps = padded_decode_step_arrays(batch.page_table.shape[0])
            steps["num_steps"][: len(further)] = further
            proposals = np.asarray(self._dispatch(batch, DecodeSteps(**steps), items))  # (k, R) int32
        except BaseException:  # the pages registered above were never computed: forget them and the rows
            for item in items:
                self.release(item.request.request_id)
            self.kv.pool.reset_cache()
            raise
        guesses: dict[str, list[int]] = {}
        for row, (item, extra) in enumerate(zip(items, further)):
            guess = proposals[: 1 + extra, row].tolist() if item.samples else []
            self._fed[item.request.request_id] = _Fed(item.num_computed_tokens + item.num_new_tokens, guess[:extra])
            guesses[item.request.request_id] = guess
        return [guesses.get(request.request_id, []) for request in requests]

    def _fed_positions(self, request: Request) -> int:
        """How many of the request's positions the draft feeds before it proposes: all its known tokens."""
        return request.num_known_tokens

    def _dispatch(self, batch: BatchDescriptor, steps: DecodeSteps, items: list[ScheduledRequest]) -> jax.Array:
        """Run the draft over the catch-up batch of `items`; its (k, R) proposals on the device."""
        return self.runner.propose(batch, steps)

    def _cached_prefix(self, request: Request) -> list[int]:
        """For a request the draft holds nothing of: the draft's cached pages of its longest cached prefix."""
        if self.kv.page_ids(request.request_id):
            return []
        return self.kv.find_cached_prefix(request.token_ids(0, request.num_known_tokens), request.cache_salt)

    def _num_valid(self, request: Request) -> int:
        """The request's leading tokens whose KV the draft holds, short of its last (which is fed again to
        propose after it when nothing follows it yet)."""
        fed = self._fed.get(request.request_id)
        if fed is None:
            return 0
        known = request.num_known_tokens
        actual = request.token_ids(fed.num_tokens, min(fed.num_tokens + len(fed.proposals), known))
        matched = 0
        for token, proposal in zip(actual, fed.proposals):
            if token != proposal:
                break
            matched += 1
        return min(fed.num_tokens + matched, known - 1)
