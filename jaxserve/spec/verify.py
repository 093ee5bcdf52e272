"""Verification of proposed tokens on the device: which guesses to keep, and the token that follows them.

A row verifying k proposals d_1..d_k fed [t, d_1, .., d_k] to the target model and has the target's
logits at each of those k + 1 positions. Position j's distribution p_j is the row's sampling
distribution (temperature, min-p, top-k, top-p: `sampler.filtered_logits`) of those logits. A proposal
is a point mass q (the n-gram proposer is deterministic), so the standard rejection rule reads: accept
d_{j+1} with probability min(1, p_j(d_{j+1}) / q(d_{j+1})) = p_j(d_{j+1}); at the first rejection, emit
a sample of the residual max(0, p_j - q) normalised, which is p_j without d_{j+1}; when all k are
accepted, emit a sample of p_k. Each emitted token is then distributed exactly as the target's. Greedy
rows accept a proposal when it is the argmax, and emit the argmax.

Keys: the token emitted at output index s is drawn with the Gumbel noise of `sampler.sample_key(seed, s)`,
the key plain sampling would use (a row with no proposals samples exactly as without speculation); the
acceptance draw at s uses an independent key derived from it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.sampler import SamplingBatch, filtered_logits, first_argmax, gumbel_noise, sample_key
from jaxserve.sampling_params import GREEDY_TEMPERATURE_EPS

ACCEPT_KEY_TAG = 0x5EC  # folded into a sample's key for its acceptance draw


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposals:
    """The tokens each row of a verification step proposes. R rows, S = 1 + the most proposals per row."""

    token_ids: jax.Array  # (R, S - 1) int32 proposals in order; pad -1
    num_tokens: jax.Array  # (R,) int32 proposals of each row (0 for a row that only samples, and padded rows)
    logits_index: jax.Array  # (R, S) int32 the step token of each verified position: the row's first + j; pad 0


def verify(logits: jax.Array, sampling: SamplingBatch, proposals: Proposals) -> jax.Array:
    """The tokens each row emits: its accepted proposals, then one token sampled from the target; -1 after.

    `logits` (R, S, V) float32 are the target's at each row's S positions; `sampling` has no aux tokens
    (verified rows have no penalties, bans, biases or allowed ids). Returns (S, R) int32."""
    num_rows, width, vocab = logits.shape
    positions = jnp.arange(width)  # (S,)
    repeat = lambda x: jnp.repeat(x, width, axis=0)  # (R, ...) -> (R * S, ...), row-major like the logits
    flat_sampling = dataclasses.replace(
        sampling, temperature=repeat(sampling.temperature), top_k=repeat(sampling.top_k),
        top_p=repeat(sampling.top_p), min_p=repeat(sampling.min_p), seeds=repeat(sampling.seeds),
        sample_index=(sampling.sample_index[:, None] + positions[None, :]).reshape(-1),
    )
    flat = logits.reshape(num_rows * width, vocab)  # (R * S, V)
    # The proposal each position checks: d_{j+1} at position j < num_tokens, else none (-1).
    padded = jnp.pad(proposals.token_ids, ((0, 0), (0, 1)), constant_values=-1)  # (R, S)
    checked = jnp.where(positions[None, :] < proposals.num_tokens[:, None], padded, -1).reshape(-1)  # (R * S,)
    has_check = checked >= 0  # (R * S,)
    safe = jnp.maximum(checked, 0)[:, None]  # (R * S, 1)

    greedy = flat_sampling.temperature < GREEDY_TEMPERATURE_EPS  # (R * S,)
    argmax = first_argmax(flat)  # (R * S,) int32

    def sampled() -> tuple[jax.Array, jax.Array]:
        """(accepted, emitted) with the random rows drawn; greedy rows as in `greedy_only`."""
        scaled = filtered_logits(flat, flat_sampling)  # (R * S, V) the sampling distribution's logits
        p_checked = jnp.take_along_axis(jax.nn.softmax(scaled, axis=-1), safe, axis=-1)[:, 0]  # (R * S,)
        uniform = jax.vmap(lambda seed, index: jax.random.uniform(jax.random.fold_in(sample_key(seed, index),
                                                                                     ACCEPT_KEY_TAG)))(
            flat_sampling.seeds, flat_sampling.sample_index)  # (R * S,) float32 in [0, 1)
        accepted = has_check & jnp.where(greedy, argmax == checked, uniform < p_checked)  # (R * S,)
        # The token emitted where a row stops: the residual (p without the rejected proposal) or, with no
        # proposal left to check, p itself; greedy rows emit the argmax (which differs from a rejected proposal).
        residual = jnp.where(has_check[:, None] & (jnp.arange(vocab)[None, :] == safe), -jnp.inf, scaled)
        noise = gumbel_noise(flat_sampling.seeds, flat_sampling.sample_index, vocab)  # (R * S, V)
        return accepted, jnp.where(greedy, argmax, first_argmax(residual + noise))

    def greedy_only() -> tuple[jax.Array, jax.Array]:
        """(accepted, emitted) when every row is greedy: a proposal is kept when it is the argmax."""
        return has_check & (argmax == checked), argmax

    accepted, emitted = jax.lax.cond(jnp.all(greedy), greedy_only, sampled)  # (R * S,) each
    emitted = emitted.reshape(num_rows, width)  # (R, S)

    num_accepted = jnp.sum(jnp.cumprod(accepted.reshape(num_rows, width), axis=1), axis=1)  # (R,) leading accepts
    tokens = jnp.where(positions[None, :] < num_accepted[:, None], padded, -1)  # (R, S) the accepted proposals
    last = jnp.take_along_axis(emitted, num_accepted[:, None], axis=1)  # (R, 1) the token after them
    tokens = jnp.where(positions[None, :] == num_accepted[:, None], last, tokens)  # (R, S)
    return tokens.T  # (S, R)
