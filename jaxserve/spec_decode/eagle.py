"""EAGLE speculative decoding (speculative_config method "eagle": EAGLE-1, "eagle3": EAGLE-3): a one-layer head
over the target's own features proposes each request's next k tokens (model/eagle.py).

The target keeps every computed token's feature (EAGLE-1: its final hidden state after the final norm; EAGLE-3:
the inputs of three of its layers side by side) in its KV pages, beside the attention's arrays (runner.py's
`features`), so prefix-cache hits, page copies, swaps and preemptions carry the features with the KV. The head
has its own KV pool and pages, as a draft model does (spec_decode/draft.py's proposer, whose catch-up and proposing this
reuses): at a position p it feeds the token after p with the target's feature at p, read through the target's
page table. A request with known tokens t_0..t_n has features up to position n - 1, so the head feeds positions
up to n - 1 (t_1..t_n) and proposes after them; the positions it fed its own proposals at are computed anew after
the verification, from the target's features of the accepted tokens (the head's KV there used its own outputs in
place of features). The head's pool keeps no prefix cache: its KV at a page's last position depends on the next
page's first token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention import fp8
from jaxserve.batch.builder import BucketLadders, padded_batch_arrays, padded_decode_step_arrays
from jaxserve.batch.descriptor import BatchDescriptor, DecodeSteps
from jaxserve.batch.packing import Layout, pack, unpack
from jaxserve.config import EngineConfig
from jaxserve.kv.cache_manager import KVCacheManager
from jaxserve.model.eagle import HeadConfig, MidlayerNames, eagle3_weights, eagle_forward, eagle_weights
from jaxserve.model.loader import SafetensorsFolder, load_params
from jaxserve.model_spec import ModelSpec
from jaxserve.request import Request
from jaxserve.runner.runner import Runner
from jaxserve.sharding import cache_kv_heads, put_global
from jaxserve.spec_decode.draft import DraftModelProposer
from jaxserve.spec_decode.draft_runner import DraftRunner, run_draft_steps
from jaxserve.step import ScheduledRequest


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FeatureSlots:
    """Where the target keeps the feature of each position a catch-up batch feeds."""

    slots: jax.Array  # (T,) int32 the target's page * page_size + offset of each token's position; pad 0


class EagleRunner(DraftRunner):
    """The head's device side: a DraftRunner whose proposal executable (one per (T, W) bucket) reads each fed
    position's feature from the target runner's pages (and, for EAGLE-1, uses the target's LM head)."""

    def __init__(self, spec: ModelSpec, params: dict, mesh, *, target: Runner, num_proposals: int, version: int,
                 **kwargs):
        Runner.__init__(self, spec, params, mesh, **kwargs)  # (not DraftRunner's: its executable is a draft model's)
        self.num_proposals = num_proposals
        self.target = target
        # EAGLE-1 borrows the target's LM head (a tied target's: its embedding); EAGLE-3 has its own
        self.head_leaf = None if version == 3 else "lm_head" if "lm_head" in target.params else "embed"
        self.trace_key += ("eagle", version, num_proposals, self.head_leaf)
        forward = eagle_forward(version, spec, self.attention.attention, self.attention.write_kv, mesh)
        page_size, transposed = self.page_size, self.head_leaf == "embed"

        def propose_packed(params, head, caches, features, buffers, layouts: tuple[Layout, Layout, Layout]):
            batch, steps = unpack(buffers[0], layouts[0], BatchDescriptor), unpack(buffers[1], layouts[1], DecodeSteps)
            slots = unpack(buffers[2], layouts[2], FeatureSlots).slots  # (T,)
            token_features = features[0, slots // page_size, slots % page_size, 0]  # (T, F)
            if head is not None:
                params = {**params, "lm_head": head.T if transposed else head}  # (H, V)
            return run_draft_steps(forward, params, caches, batch, steps, num_proposals, page_size, token_features)

        head_sharding = target.param_shardings[self.head_leaf] if self.head_leaf else None
        self._propose = jax.jit(
            propose_packed,
            in_shardings=(self.param_shardings, head_sharding, self._kv_sharding, target._kv_sharding[-1],
                          self._replicated),
            out_shardings=(self._replicated, self._kv_sharding), donate_argnums=(2,), static_argnums=(5,))
        self._propose_exec: dict[tuple[int, int], jax.stages.Compiled] = {}  # (T, W) -> executable

    def propose_call(self, num_tokens: int, width: int, num_pages: int | None = None) -> tuple[Callable, tuple]:
        """The proposal bucket (T, W): a catch-up batch of T tokens with their features' slots and the rows'
        numbers of further steps, against the allocated pools or abstract ones of `num_pages`."""
        num_rows = self.ladders.rows_for(num_tokens)
        buffers, layouts = self.abstract_packed(
            BatchDescriptor(**padded_batch_arrays(num_tokens, num_rows, width, self.page_size)),
            DecodeSteps(**padded_decode_step_arrays(num_rows)), FeatureSlots(np.zeros((num_tokens,), np.int32)))
        features = self.target.caches(num_pages)[-1]  # (1, P, S, 1, F)
        return self._propose, (self.params, self._target_head(), self.caches(num_pages), features, buffers, layouts)

    def _target_head(self) -> jax.Array | None:
        """The target's LM head leaf an EAGLE-1 head borrows (None for EAGLE-3)."""
        return self.target.params[self.head_leaf] if self.head_leaf else None

    def propose(self, batch: BatchDescriptor, steps: DecodeSteps, slots: FeatureSlots) -> jax.Array:
        """Dispatch one proposal step; returns its (num_proposals, R) int32 proposals on the device."""
        key = (batch.input_ids.shape[0], batch.page_table.shape[1])
        executable = self._executable(self._propose_exec, key, self.propose_call)
        buffers = put_global((pack(batch)[0], pack(steps)[0], pack(slots)[0]), self._replicated)
        proposals, self.kv_caches = executable(self.params, self._target_head(), self.kv_caches,
                                               self.target.kv_caches[-1], buffers)
        return proposals


class EagleProposer(DraftModelProposer):
    """Proposes `runner.num_proposals` tokens per request by greedy decoding with an EAGLE head."""

    target_kv: KVCacheManager | None = None  # the target's pages (the engine sets it): where the features are

    @classmethod
    def load(cls, config: EngineConfig, head: HeadConfig, mesh, ladders: BucketLadders, max_model_len: int,
             target: Runner) -> "EagleProposer":
        """The head that config's speculative_config names (its folder's `head`, read_head_config's), in the
        target's dtype (never quantized)."""
        path = config.speculative_config.model
        spec = head.spec.for_max_model_len(max_model_len)
        kv_heads = cache_kv_heads(spec, mesh.devices.size)
        folder = SafetensorsFolder(path)
        has_embed = "embed_tokens.weight" in folder
        if head.version == 3:
            folder = MidlayerNames(folder)
            declared = eagle3_weights(spec, kv_heads, mesh.devices.size, has_embed, head.draft_vocab_size)
        else:
            declared = eagle_weights(spec, kv_heads, mesh.devices.size, has_embed, "fc.bias" in folder)
        params = load_params(folder, spec, mesh, target.weight_dtype, kv_heads, declared=declared)
        if not has_embed:  # the head has no embedding of its own: a copy of the target's
            params["embed"] = jnp.copy(target.params["embed"])
        if head.version == 3 and head.draft_vocab_size < spec.vocab_size:
            params["draft_tokens"] = put_global(read_draft_tokens(folder, head.draft_vocab_size, spec.vocab_size),
                                                target._replicated)
        runner = EagleRunner(spec, params, mesh, target=target, page_size=config.cache_config.page_size,
                             num_cache_kv_heads=kv_heads, cache_dtype=fp8.cache_dtype("auto", target.weight_dtype),
                             ladders=ladders, attention_backend=config.compilation_config.attention_backend,
                             num_proposals=config.num_speculative_tokens, version=head.version)
        return cls(runner, config.scheduler_config.max_num_batched_tokens, max_model_len, enable_prefix_caching=False)

    def _fed_positions(self, request: Request) -> int:
        """The positions whose target features exist: every known token's but the last."""
        return request.num_known_tokens - 1

    def _num_valid(self, request: Request) -> int:
        """The positions the head fed with the target's features, short of the last one (fed again to propose
        after it when nothing follows it yet)."""
        fed = self._fed.get(request.request_id)
        return 0 if fed is None else min(fed.num_tokens, self._fed_positions(request) - 1)

    def _dispatch(self, batch: BatchDescriptor, steps: DecodeSteps, items: list[ScheduledRequest]) -> jax.Array:
        """Feed each position the token after it and the target's feature at it."""
        input_ids = np.array(batch.input_ids)  # (T,)
        slots = np.zeros_like(input_ids)  # (T,)
        page_size = self.runner.page_size
        for row, item in enumerate(items):
            start, first = int(batch.query_start_loc[row]), item.num_computed_tokens
            count = item.num_new_tokens
            input_ids[start: start + count] = item.request.token_ids(first + 1, first + count + 1)
            positions = np.arange(first, first + count)
            pages = np.asarray(self.target_kv.page_ids(item.request.request_id))[positions // page_size]
            slots[start: start + count] = pages * page_size + positions % page_size
        batch = dataclasses.replace(batch, input_ids=input_ids)
        return self.runner.propose(batch, steps, FeatureSlots(slots))


def read_draft_tokens(folder, draft_vocab_size: int, vocab_size: int) -> np.ndarray:
    """The target's token of each of an EAGLE-3 head's draft ids, d + d2t[d] (draft_vocab_size,) int32; a ValueError
    for a head without `d2t` or whose tokens are not distinct ids of the target's vocabulary."""
    if "d2t" not in folder:
        raise ValueError(f"the EAGLE-3 head has draft_vocab_size {draft_vocab_size} < the target's {vocab_size} but "
                         f"no `d2t` tensor mapping its ids to the target's")
    offsets = np.asarray(folder.get("d2t")).astype(np.int64)  # (V_draft,)
    tokens = np.arange(draft_vocab_size) + (offsets if offsets.shape == (draft_vocab_size,) else 0)
    if offsets.shape != (draft_vocab_size,) or tokens.min() < 0 or tokens.max() >= vocab_size or len(
            np.unique(tokens)) != draft_vocab_size:
        raise ValueError(f"the EAGLE-3 head's d2t (shape {offsets.shape}) must map its {draft_vocab_size} ids to "
                         f"distinct ids of the target's vocabulary of {vocab_size}")
    return tokens.astype(np.int32)
