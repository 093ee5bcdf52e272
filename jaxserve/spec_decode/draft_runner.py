"""The draft model's device side: catch its KV up with a batch of requests and propose k tokens, in one call.

A draft step takes a batch built like a target step (`batch.build_batch`): each row feeds the tokens the
draft has not computed yet (in a steady decode the token the target emitted last, plus the last accepted
proposal when all k were accepted; a request's whole prompt the first time), so the forward writes their KV
into the draft's own pages and gives each row's logits at its last token. Their argmax is the first
proposal; `run_decode_steps` then feeds each proposal back for the next (k - 1 more forwards in a
`lax.fori_loop`). Proposals are greedy: each is a point mass, which is what verify.py's rejection rule
assumes, so the target's emitted tokens keep its exact distribution whatever the draft proposes.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxserve.batch.builder import padded_batch_arrays, padded_decode_step_arrays
from jaxserve.batch.descriptor import BatchDescriptor, DecodeSteps
from jaxserve.batch.packing import Layout, pack, unpack
from jaxserve.kv.page_pool import NULL_PAGE
from jaxserve.runner.decode_steps import run_decode_steps
from jaxserve.runner.runner import Runner, activation_bytes
from jaxserve.sampling.sampler import first_argmax
from jaxserve.sharding import put_global


def run_draft_steps(forward: Callable, params: dict, caches: tuple, batch: BatchDescriptor, steps: DecodeSteps,
                    num_tokens: int, page_size: int, features: jax.Array | None = None) -> tuple[jax.Array, tuple]:
    """Catch up and propose: (proposals (num_tokens, R) int32, the updated caches).

    Row r's first proposal is the argmax at its last token; it proposes `steps.num_steps[r]` more, each
    the argmax after feeding the one before (-1 beyond them; a row with 0 feeds nothing more).
    `forward(params, caches, batch) -> (logits, hidden, caches)`; an EAGLE head's takes each token's `features`
    (T, F) too, and each row's own output at its last token stands for the feature of the token fed after it."""
    extra = () if features is None else (features,)
    logits, hidden, caches = forward(params, caches, batch, *extra)  # logits: (R, V)
    first = first_argmax(logits)  # (R,) int32
    if num_tokens == 1:
        return first[None], caches
    greedy = lambda logits, i: first_argmax(logits)  # noqa: E731  (R, V) -> (R,)
    row_features = None if features is None else hidden[batch.logits_indices]  # (R, F)
    later, caches = run_decode_steps(forward, params, caches, next_token_batch(batch, first, steps, page_size),
                                     greedy, steps, num_tokens - 1, page_size, row_features)  # (num_tokens - 1, R)
    return jnp.concatenate([first[None], later]), caches


def next_token_batch(batch: BatchDescriptor, token_ids: jax.Array, steps: DecodeSteps,
                     page_size: int) -> BatchDescriptor:
    """A decode batch of one token per row (R tokens): row r feeds `token_ids[r]` at the position after the
    last token `batch` fed it; a row with no steps to take writes nothing (null page)."""
    num_rows, width = batch.page_table.shape
    rows = jnp.arange(num_rows)  # (R,)
    real = rows < batch.num_seqs  # (R,)
    positions = batch.seq_lens  # (R,) each row's next position
    pages = batch.page_table[rows, jnp.minimum(positions // page_size, width - 1)]  # (R,)
    writes = steps.num_steps > 0  # (R,)
    no_copies = jnp.full_like(batch.copy_src, NULL_PAGE)  # (R,) the catch-up made the step's page copies
    return BatchDescriptor(
        input_ids=token_ids,
        device_token_index=jnp.full((num_rows,), -1, jnp.int32),
        positions=positions,
        slot_mapping=jnp.where(writes, pages * page_size + positions % page_size, NULL_PAGE * page_size),
        query_start_loc=jnp.minimum(jnp.arange(num_rows + 1), batch.num_seqs).astype(jnp.int32),
        seq_lens=jnp.where(real, positions + 1, 0),
        page_table=batch.page_table,
        logits_indices=rows.astype(jnp.int32),
        copy_src=no_copies,
        copy_dst=no_copies,
        lora_slots=jnp.full((num_rows,), -1, jnp.int32),  # (the draft serves no adapters)
        num_seqs=batch.num_seqs,
    )


class DraftRunner(Runner):
    """A Runner of the draft model that compiles only its proposal executable: one per (T, W) forward bucket
    of the ladders (the catch-up batch's shape), proposing `num_proposals` tokens per row."""

    def __init__(self, *args, num_proposals: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_proposals = num_proposals
        self.trace_key += (num_proposals,)
        forward, page_size = self.model_forward, self.page_size  # the jitted function must not capture self

        def propose_packed(params, caches, buffers, layouts: tuple[Layout, Layout]):
            batch, steps = unpack(buffers[0], layouts[0], BatchDescriptor), unpack(buffers[1], layouts[1], DecodeSteps)
            return run_draft_steps(forward, params, caches, batch, steps, num_proposals, page_size)

        self._propose = jax.jit(propose_packed,
                                in_shardings=(self.param_shardings, self._kv_sharding, self._replicated),
                                out_shardings=(self._replicated, self._kv_sharding), donate_argnums=(1,),
                                static_argnums=(3,))
        self._propose_exec: dict[tuple[int, int], jax.stages.Compiled] = {}  # (T, W) -> executable

    def warmup(self, show_progress: bool = True) -> None:
        """AOT-compile the proposal executable of every (T, W) bucket."""
        self.compile_buckets([(self._propose_exec, self.propose_call, self.shapes()[0])], "compiling draft buckets",
                             show_progress)

    def propose_call(self, num_tokens: int, width: int, num_pages: int | None = None) -> tuple[Callable, tuple]:
        """The proposal bucket (T, W): a catch-up batch of T tokens and the rows' numbers of further steps, against
        the allocated pool or an abstract one of `num_pages`."""
        num_rows = self.ladders.rows_for(num_tokens)
        buffers, layouts = self.abstract_packed(
            BatchDescriptor(**padded_batch_arrays(num_tokens, num_rows, width, self.page_size)),
            DecodeSteps(**padded_decode_step_arrays(num_rows)))
        return self._propose, (self.params, self.caches(num_pages), buffers, layouts)

    def peak_activation_bytes(self, num_pages: int) -> int:
        """Per-device bytes the largest proposal bucket needs beyond its inputs (XLA's memory analysis, compiled
        against an abstract pool of `num_pages` pages)."""
        return activation_bytes(*self.propose_call(self.ladders.tokens[-1], self.ladders.page_widths[-1], num_pages))

    def propose(self, batch: BatchDescriptor, steps: DecodeSteps) -> jax.Array:
        """Dispatch one proposal step; returns its (num_proposals, R) int32 proposals on the device."""
        key = (batch.input_ids.shape[0], batch.page_table.shape[1])
        executable = self._executable(self._propose_exec, key, self.propose_call)
        buffers = put_global((pack(batch)[0], pack(steps)[0]), self._replicated)
        proposals, self.kv_caches = executable(self.params, self.kv_caches, buffers)
        return proposals
