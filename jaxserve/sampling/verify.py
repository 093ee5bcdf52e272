"""Verification of proposed tokens on the device: which guesses to keep, and the token that follows them.

A row verifying k proposals d_1..d_k fed [t, d_1, .., d_k] to the target model and has the target's
logits at each of those k + 1 positions. At each position j the row draws the sample plain decoding would
draw there: the sampler's own choice (penalties, logit biases and allowed ids applied, the proposals before j
counted as output; then argmax for greedy rows, else Gumbel-max over the row's sampling distribution p_j with
the noise of `sampler.sample_key(seed, s)` for output index s). Proposal d_{j+1} is
kept when it equals that sample; the row emits its samples up to and including the first that differs from
its proposal (or the one after the last proposal).

This is the standard rejection rule for a proposal that is a point mass q (both proposers are
deterministic: prompt lookup, and the draft model's greedy decode), with the randomness coupled to plain
sampling: d_{j+1} is accepted with probability p_j(d_{j+1}) = min(1, p_j / q), and on rejection the token
emitted is the sample given that it is not d_{j+1}, i.e. drawn from max(0, p_j - q) normalised. Every emitted
token is therefore exactly the token plain decoding samples at its index, so a seeded request's output is
the same with speculation and without, and the same whichever steps verified which of its tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.sampling.sampler import KIND_OUTPUT, KIND_PAD, SamplerOutput, SamplingBatch, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposals:
    """The tokens each row of a verification step proposes. R rows, S = 1 + the most proposals per row."""

    token_ids: jax.Array  # (R, S - 1) int32 proposals in order; pad -1
    num_tokens: jax.Array  # (R,) int32 proposals of each row (0 for a row that only samples, and padded rows)
    logits_index: jax.Array  # (R, S) int32 the step token of each verified position: the row's first + j; pad 0


def verify(logits: jax.Array, sampling: SamplingBatch, proposals: Proposals,
           logprobs_mode: str = "raw_logprobs") -> tuple[jax.Array, SamplerOutput]:
    """The tokens each row emits: its accepted proposals, then the sample after them; -1 after.

    `logits` (R, S, V) float32 are the target's at each row's S positions. Position j is sampled as output
    index `sample_index + j`, its penalty history extended by the proposals before it (accepted, they are the
    output there). Returns the tokens (S, R) int32 and the sampler's output at every position, row-major
    (R * S rows: row r's position j at r * S + j; its logprobs, as `logprobs_mode` says, are those of the emitted
    tokens there)."""
    num_rows, width, vocab = logits.shape
    out = sample(logits.reshape(num_rows * width, vocab), per_position(sampling, proposals), logprobs_mode)
    samples = out.token_ids.reshape(num_rows, width)  # (R, S)
    positions = jnp.arange(width)  # (S,)
    # The proposal each position checks: d_{j+1} at position j < num_tokens, else none (-1, never a sample).
    padded = jnp.pad(proposals.token_ids, ((0, 0), (0, 1)), constant_values=-1)  # (R, S)
    checked = jnp.where(positions[None, :] < proposals.num_tokens[:, None], padded, -1)  # (R, S)
    num_accepted = jnp.sum(jnp.cumprod(samples == checked, axis=1), axis=1)  # (R,) leading proposals kept
    return jnp.where(positions[None, :] <= num_accepted[:, None], samples, -1).T, out  # (S, R)


def per_position(sampling: SamplingBatch, proposals: Proposals) -> SamplingBatch:
    """The sampling rows of every (row, position), row-major (R * S rows): a row's parameters, the output index
    of each position, and (when the batch has token lists) the row's tokens plus, as output tokens, the
    proposals before the position."""
    num_rows, width = proposals.logits_index.shape
    repeat = lambda x: jnp.repeat(x, width, axis=0)  # noqa: E731  (R, ...) -> (R * S, ...)
    rows = {field.name: repeat(getattr(sampling, field.name)) for field in dataclasses.fields(sampling)
            if getattr(sampling, field.name).ndim}
    positions = jnp.arange(width)  # (S,)
    rows["sample_index"] = (sampling.sample_index[:, None] + positions[None, :]).reshape(-1)  # (R * S,)
    if sampling.aux_token_ids.shape[1]:
        proposed = jnp.arange(width - 1)  # (S - 1,)
        before = (proposed[None, None, :] < positions[None, :, None]) & (
            proposed[None, None, :] < proposals.num_tokens[:, None, None])  # (R, S, S - 1) proposal i precedes j
        extra = jnp.where(before, proposals.token_ids[:, None, :], -1).reshape(num_rows * width, width - 1)
        rows["aux_token_ids"] = jnp.concatenate([rows["aux_token_ids"], extra], axis=1)  # (R * S, P + S - 1)
        rows["aux_token_kind"] = jnp.concatenate(
            [rows["aux_token_kind"], jnp.where(extra >= 0, KIND_OUTPUT, KIND_PAD).astype(jnp.int8)], axis=1)
        rows["aux_values"] = jnp.concatenate([rows["aux_values"], jnp.zeros(extra.shape, jnp.float32)], axis=1)
    return dataclasses.replace(sampling, **rows)
