"""Multi-step decoding: several forward + sample iterations of a decode-only batch in one device call.

A decode-only batch has one token per row (token t is row t). Each iteration computes every live row's
input token, samples the next, and makes that sample the next iteration's input at the next position, its
KV slot found in the row's page table (the scheduler allocated pages for every iteration). A row stops
after its `num_steps` samples or at a stop id; from then on its token writes to the null page and its
samples are not kept. The host gets every iteration's samples at once and applies the stop rules again
(stop strings and max_tokens included), dropping what follows a stop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxserve.batch.descriptor import BatchDescriptor, DecodeSteps
from jaxserve.kv.page_pool import NULL_PAGE
from jaxserve.sampling.sampler import SamplingBatch, sample


def sampled_by(sampling: SamplingBatch) -> Callable:
    """The `pick` of run_decode_steps that samples iteration i as output index `sample_index + i` of each row."""
    return lambda logits, i: sample(logits, dataclasses.replace(sampling, sample_index=sampling.sample_index + i)
                                    ).token_ids


def run_decode_steps(forward: Callable, params: dict, caches: tuple, batch: BatchDescriptor, pick: Callable,
                     steps: DecodeSteps, max_steps: int, page_size: int,
                     features: jax.Array | None = None) -> tuple[jax.Array, tuple]:
    """Up to `max_steps` iterations (static); returns (samples (max_steps, R) int32, -1 where a row was no
    longer live, and the updated caches). `forward(params, caches, batch) -> (logits, hidden, caches)`;
    `pick(logits, i) -> (R,) int32` chooses iteration i's tokens from its logits (R, V). With `features` (R, F)
    (an EAGLE head's), `forward(params, caches, batch, features)` takes each token's feature, and each
    iteration's outputs (R, F) are the next one's."""
    num_tokens, num_rows = batch.input_ids.shape[0], batch.page_table.shape[0]
    token_rows = jnp.minimum(jnp.arange(num_tokens), num_rows - 1)  # (T,) row of each token
    real_tokens = jnp.arange(num_tokens) < batch.num_seqs  # (T,)
    no_copies = jnp.full_like(batch.copy_src, NULL_PAGE)  # (R,) the first iteration made the page copies

    def iteration(i, carry):
        caches, batch, samples, done, features = carry  # samples: (K, R) int32; done: (R,) bool
        if features is None:
            logits, _, caches = forward(params, caches, batch)  # logits: (R, V)
        else:
            logits, features, caches = forward(params, caches, batch, features)
        sampled = pick(logits, i)  # (R,) int32
        live = (i < steps.num_steps) & ~done  # (R,) rows whose sample this is
        samples = samples.at[i].set(jnp.where(live, sampled, -1))
        stopped = jnp.any(sampled[:, None] == steps.stop_ids, axis=1)  # (R,)
        done = ~live | stopped | (i + 1 >= steps.num_steps)
        grows = ~done[token_rows] & real_tokens  # (T,) tokens that take the next position
        positions = batch.positions + grows  # (T,)
        pages = batch.page_table[token_rows, positions // page_size]  # (T,)
        batch = dataclasses.replace(
            batch,
            input_ids=jnp.where(grows, sampled[token_rows], batch.input_ids),
            positions=positions,
            slot_mapping=jnp.where(grows, pages * page_size + positions % page_size, NULL_PAGE * page_size),
            seq_lens=batch.seq_lens + ~done,
            copy_src=no_copies,
            copy_dst=no_copies,
        )
        return caches, batch, samples, done, features

    samples = jnp.full((max_steps, num_rows), -1, jnp.int32)  # (K, R)
    done = steps.num_steps < 1  # (R,) padded rows never sample
    caches, _, samples, _, _ = jax.lax.fori_loop(0, max_steps, iteration, (caches, batch, samples, done, features))
    return samples, caches
