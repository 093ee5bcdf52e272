"""Jittable next-token sampling, following vLLM V1's sampler.

Order per step: allowed tokens -> banned tokens (bad words, stop ids under
min_tokens) -> logit bias -> repetition penalty -> frequency/presence
penalties -> greedy argmax, or temperature -> min-p -> top-k -> top-p ->
Gumbel-max sampling. Logprobs are those of the raw model distribution by
default (vLLM's "raw_logprobs"), with the exact rank of every chosen token; the
engine's `logprobs_mode` (vLLM's; config.VALID_LOGPROBS_MODES) may ask for the raw
logits instead, or for the processed distribution each row samples from (the
tokens its filters drop at -inf).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams

MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS

# Values of SamplingBatch.aux_token_kind.
KIND_PAD = 0
KIND_PROMPT = 1
KIND_OUTPUT = 2
KIND_BANNED = 3
KIND_BIAS = 4  # add aux_values to this token's logit
KIND_ALLOWED = 5  # a row with any of these keeps only those tokens

# How many of each row's largest logits top-k/top-p filtering looks at before
# falling back to a full sort of the vocabulary (a full sort is slow on CPU).
SORT_PREFIX = 1024


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings for a batch of R requests, as device arrays."""

    temperature: jax.Array  # (R,) float32; < GREEDY_TEMPERATURE_EPS means greedy
    top_k: jax.Array  # (R,) int32; 0 means no limit
    top_p: jax.Array  # (R,) float32 in (0, 1]
    min_p: jax.Array  # (R,) float32 in [0, 1]
    presence_penalty: jax.Array  # (R,) float32
    frequency_penalty: jax.Array  # (R,) float32
    repetition_penalty: jax.Array  # (R,) float32
    seeds: jax.Array  # (R, 2) uint32 per-request 64-bit seed: low word, high word
    sample_index: jax.Array  # (R,) int32 output tokens already produced
    aux_token_ids: jax.Array  # (R, P) int32 penalty/ban/bias/allow token ids; pad -1; P may be 0
    aux_token_kind: jax.Array  # (R, P) int8 KIND_* of each aux token
    aux_values: jax.Array  # (R, P) float32 the bias of each KIND_BIAS token, else 0
    need_logprobs: jax.Array  # () bool whether any row asked for logprobs
    # (R, M) int32 tokens a row's grammar allows next, bit t % 32 of word t // 32 (structured output); every bit
    # set in a row without one; M is V / 32 rounded up when some row has a grammar, else 0
    token_bitmask: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """Sampled tokens and (when requested) raw-distribution logprobs."""

    token_ids: jax.Array  # (R,) int32
    logprobs: jax.Array  # (R,) float32 raw logprob of the chosen token; 0 if not needed
    ranks: jax.Array  # (R,) int32 1 + logits strictly above the chosen token's; 0 if not needed
    top_token_ids: jax.Array  # (R, K) int32, K = min(MAX_LOGPROBS, V), logprob desc
    top_logprobs: jax.Array  # (R, K) float32; 0 if not needed


def sample(logits: jax.Array, batch: SamplingBatch, logprobs_mode: str = "raw_logprobs") -> SamplerOutput:
    """Pick one token per row of `logits` (R, V) according to `batch`, with logprobs as `logprobs_mode`
    (config.VALID_LOGPROBS_MODES, static) says; jittable."""
    # logits: (R, V) float32
    processed = logits
    if batch.aux_token_ids.shape[1] > 0:
        processed = process_logits(logits, batch)  # (R, V) float32
    if batch.token_bitmask.shape[1] > 0:
        processed = apply_token_bitmask(processed, batch.token_bitmask)  # (R, V) float32
    is_greedy = batch.temperature < GREEDY_TEMPERATURE_EPS  # (R,) bool
    greedy_ids = first_argmax(processed)  # (R,) int32
    token_ids = jax.lax.cond(  # (R,) int32
        jnp.all(is_greedy),
        lambda: greedy_ids,
        lambda: jnp.where(is_greedy, greedy_ids, _random_sample(processed, batch)),
    )
    def reported(logits: jax.Array, token_ids: jax.Array) -> tuple[jax.Array, ...]:
        if logprobs_mode.startswith("processed"):  # the distribution each row samples from
            logits = jnp.where(is_greedy[:, None], processed, filtered_logits(processed, batch))  # (R, V)
        values = logits if logprobs_mode.endswith("logits") else jax.nn.log_softmax(logits, axis=-1)  # (R, V)
        return ranked(values, token_ids)

    chosen, ranks, top_ids, top_lps = jax.lax.cond(
        batch.need_logprobs, reported, _zero_logprobs, logits, token_ids
    )
    return SamplerOutput(token_ids, chosen, ranks, top_ids, top_lps)


def bitmask_width(vocab_size: int) -> int:
    """int32 words of one row's token bitmask."""
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf for every token a row's bitmask leaves out."""
    # logits: (R, V) float32; bitmask: (R, M) int32, M * 32 >= V
    vocab = logits.shape[1]
    token = jnp.arange(vocab, dtype=jnp.int32)  # (V,)
    words = bitmask[:, token // 32]  # (R, V) each token's word
    allowed = (jnp.right_shift(words, token % 32) & 1).astype(jnp.bool_)  # (R, V)
    return jnp.where(allowed, logits, -jnp.inf)


def first_argmax(x: jax.Array) -> jax.Array:
    """Index of each row's maximum (the first on ties), as a max and a min reduction.

    Same result as `jnp.argmax` for finite rows, about twice as fast on the XLA CPU backend,
    whose variadic (value, index) reduction does not vectorise.
    """
    # x: (R, V) float32 -> (R,) int32
    vocab = x.shape[-1]
    is_max = x == jnp.max(x, axis=-1, keepdims=True)  # (R, V) bool
    first = jnp.min(jnp.where(is_max, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)  # (R,)
    return jnp.minimum(first, vocab - 1)


def process_logits(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """Keep only allowed tokens (rows that name some), ban banned ones, add logit biases, then apply
    repetition, frequency and presence penalties. The allowed and bias scatters run only in batches
    that use them."""
    # logits: (R, V) float32
    stats = _token_stats(batch, logits.shape[1])
    logits = jnp.where(stats.banned, -jnp.inf, logits)  # (R, V) float32
    kind = batch.aux_token_kind  # (R, P) int8
    logits = jax.lax.cond(jnp.any(kind == KIND_ALLOWED), _keep_allowed, lambda x, b: x, logits, batch)
    logits = jax.lax.cond(jnp.any(kind == KIND_BIAS), _add_logit_bias, lambda x, b: x, logits, batch)
    return apply_penalties(logits, batch, stats)


def _keep_allowed(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """In rows that name allowed tokens, mask every other token."""
    # logits: (R, V) float32
    rows, ids = _scatter_index(batch, logits.shape[1])
    is_allowed = batch.aux_token_kind == KIND_ALLOWED  # (R, P) bool
    allowed = jnp.zeros(logits.shape, jnp.bool_).at[rows, ids].max(is_allowed, mode="drop")  # (R, V) bool
    restrict = jnp.any(is_allowed, axis=-1, keepdims=True)  # (R, 1) bool
    return jnp.where(restrict & ~allowed, -jnp.inf, logits)


def _add_logit_bias(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """Add each KIND_BIAS token's value to its logit."""
    # logits: (R, V) float32
    rows, ids = _scatter_index(batch, logits.shape[1])
    bias = jnp.where(batch.aux_token_kind == KIND_BIAS, batch.aux_values, 0.0)  # (R, P) float32
    return logits.at[rows, ids].add(bias, mode="drop")


def apply_penalties(logits: jax.Array, batch: SamplingBatch, stats: "TokenStats") -> jax.Array:
    """Apply repetition, frequency and presence penalties (vLLM's order)."""
    # logits: (R, V) float32
    output_counts, seen = stats.output_counts, stats.seen
    rep = jnp.where(seen, batch.repetition_penalty[:, None], 1.0)  # (R, V) float32
    logits = jnp.where(logits > 0, logits / rep, logits * rep)  # (R, V) float32
    logits = logits - batch.frequency_penalty[:, None] * output_counts
    return logits - batch.presence_penalty[:, None] * (output_counts > 0)


@dataclasses.dataclass(frozen=True)
class TokenStats:
    """The aux tokens of a SamplingBatch scattered over the vocabulary."""

    output_counts: jax.Array  # (R, V) int32 times each token was generated
    seen: jax.Array  # (R, V) bool in the prompt or the output
    banned: jax.Array  # (R, V) bool


def _token_stats(batch: SamplingBatch, vocab_size: int) -> TokenStats:
    """Scatter the aux tokens into per-row output counts, seen mask and ban mask."""
    rows, ids = _scatter_index(batch, vocab_size)
    kind = batch.aux_token_kind  # (R, P) int8
    is_output = kind == KIND_OUTPUT  # (R, P) bool
    shape = (ids.shape[0], vocab_size)
    output_counts = jnp.zeros(shape, jnp.int32).at[rows, ids].add(is_output.astype(jnp.int32), mode="drop")
    empty = jnp.zeros(shape, jnp.bool_)
    seen = empty.at[rows, ids].max(is_output | (kind == KIND_PROMPT), mode="drop")
    banned = empty.at[rows, ids].max(kind == KIND_BANNED, mode="drop")
    return TokenStats(output_counts, seen, banned)


def _scatter_index(batch: SamplingBatch, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """(rows (R, 1), ids (R, P)) indexing each aux token's row and vocabulary entry; padding (-1) goes to
    bin V, which is out of range and dropped by `mode="drop"` scatters."""
    rows = jnp.arange(batch.aux_token_ids.shape[0])[:, None]  # (R, 1) int32
    ids = jnp.where(batch.aux_token_ids < 0, vocab_size, batch.aux_token_ids)  # (R, P) int32
    return rows, ids


def _random_sample(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """Sample every row with temperature, min-p, top-k, top-p and Gumbel-max."""
    # logits: (R, V) float32 (penalties applied)
    noise = gumbel_noise(batch.seeds, batch.sample_index, logits.shape[1])  # (R, V)
    return first_argmax(filtered_logits(logits, batch) + noise)  # (R,) int32


def filtered_logits(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """The logits of each row's sampling distribution: divided by its temperature (1 for greedy rows), with
    the tokens min-p, top-k and top-p drop at -inf; softmax of a row is the distribution it samples from."""
    # logits: (R, V) float32 (penalties applied)
    temperature = jnp.where(  # (R,) float32; greedy rows get 1 to stay finite
        batch.temperature < GREEDY_TEMPERATURE_EPS, 1.0, batch.temperature
    )
    scaled = _apply_min_p(logits / temperature[:, None], batch.min_p)  # (R, V)
    any_filter = jnp.any(batch.top_k > 0) | jnp.any(batch.top_p < 1.0)  # () bool
    return jax.lax.cond(  # (R, V) float32
        any_filter, apply_top_k_top_p, lambda x, k, p: x, scaled, batch.top_k, batch.top_p
    )


def _apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Mask tokens whose probability is below min_p times the row's top probability."""
    # logits: (R, V) float32; min_p: (R,) float32
    row_max = jnp.max(logits, axis=-1, keepdims=True)  # (R, 1) float32
    # p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p); log(0) = -inf keeps all.
    drop = logits - row_max < jnp.log(min_p)[:, None]  # (R, V) bool
    return jnp.where(drop, -jnp.inf, logits)


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask tokens outside each row's top-k, then outside its top-p nucleus.

    top_k <= 0 means no limit. Top-p works on the top-k renormalised
    distribution and drops a token when the probability mass strictly before it
    (in descending order) already reaches top_p, as vLLM does; the top-1 token is
    always kept. Both filters reduce to a per-row logit threshold (ties with it
    are kept), read off the row's largest SORT_PREFIX logits; only when some
    row's cutoff lies beyond them is the whole vocabulary sorted, and only those
    rows use the full sort, so a row's result never depends on the other rows.
    """
    # logits: (R, V) float32; top_k: (R,) int32; top_p: (R,) float32
    prefix = jax.lax.top_k(logits, min(SORT_PREFIX, logits.shape[1]))[0]  # (R, C)
    threshold, exact = _sorted_threshold(prefix, logits, top_k, top_p)  # (R, 1), (R,)
    threshold = jax.lax.cond(  # (R, 1) float32
        jnp.all(exact),
        lambda: threshold,
        lambda: jnp.where(exact[:, None], threshold, _full_sort_threshold(logits, top_k, top_p)),
    )
    return jnp.where(logits < threshold, -jnp.inf, logits)


def _full_sort_threshold(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Per-row top-k/top-p threshold from a sort of the whole vocabulary."""
    # logits: (R, V) float32
    ordered = jnp.sort(logits, axis=-1, descending=True)  # (R, V) float32
    return _sorted_threshold(ordered, logits, top_k, top_p)[0]  # (R, 1) float32


def _sorted_threshold(
    ordered: jax.Array, logits: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Top-k/top-p logit threshold from each row's C largest logits, sorted desc.

    Returns the threshold and whether those C values were enough to find it.
    """
    # ordered: (R, C) float32 descending; logits: (R, V) float32
    num_sorted, vocab_size = ordered.shape[1], logits.shape[1]
    no_k = (top_k <= 0) | (top_k >= vocab_size)  # (R,) bool
    k_index = jnp.clip(top_k, 1, num_sorted)[:, None] - 1  # (R, 1) int32
    kth = jnp.take_along_axis(ordered, k_index, axis=-1)  # (R, 1) float32
    k_threshold = jnp.where(no_k[:, None], -jnp.inf, kth)  # (R, 1) float32
    top_k_logits = jnp.where(logits < k_threshold, -jnp.inf, logits)  # (R, V) float32
    log_norm = jax.nn.logsumexp(top_k_logits, axis=-1, keepdims=True)  # (R, 1) float32
    probs = jnp.exp(jnp.where(ordered < k_threshold, -jnp.inf, ordered) - log_norm)  # (R, C)
    mass_before = jnp.pad(jnp.cumsum(probs, axis=-1)[:, :-1], ((0, 0), (1, 0)))  # (R, C)
    num_kept = jnp.sum(mass_before < top_p[:, None], axis=-1)  # (R,) int32, >= 1
    last_kept = jnp.take_along_axis(ordered, num_kept[:, None] - 1, axis=-1)  # (R, 1)
    no_p = top_p >= 1.0  # (R,) bool
    p_threshold = jnp.where(no_p[:, None], -jnp.inf, last_kept)  # (R, 1) float32
    exact = (no_k | (top_k <= num_sorted)) & (no_p | (num_kept < num_sorted))  # (R,) bool
    return jnp.maximum(k_threshold, p_threshold), exact


def sample_key(seed: jax.Array, index: jax.Array) -> jax.Array:
    """The key of one row's sample number `index`: a function of (64-bit seed, index) alone."""
    # seed: (2,) uint32 low and high words; index: () int32
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed[0]), seed[1]), index)


def gumbel_noise(seeds: jax.Array, sample_index: jax.Array, vocab_size: int) -> jax.Array:
    """Per-row Gumbel noise keyed only by (64-bit seed, sample_index), so rows are independent."""
    # seeds: (R, 2) uint32 low and high words; sample_index: (R,) int32

    def row_noise(seed: jax.Array, index: jax.Array) -> jax.Array:
        return jax.random.gumbel(sample_key(seed, index), (vocab_size,), jnp.float32)  # (V,) float32

    return jax.vmap(row_noise)(seeds, sample_index)  # (R, V) float32



def raw_logprobs(
    logits: jax.Array, token_ids: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Logprob and exact rank of each row's token, and the top-K logprobs, under log_softmax of the
    raw logits (also used for prompt logprobs, where the token is the next prompt token)."""
    # logits: (R, V) float32; token_ids: (R,) int32
    return ranked(jax.nn.log_softmax(logits, axis=-1), token_ids)


def ranked(values: jax.Array, token_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Each row's token's value and exact rank (1 + the values strictly above it), and the top-K values with
    their token ids, of per-token values (R, V) (log-probabilities or logits)."""
    # values: (R, V) float32; token_ids: (R,) int32
    chosen = jnp.take_along_axis(values, token_ids[:, None], axis=-1)[:, 0]  # (R,)
    ranks = 1 + jnp.sum(values > chosen[:, None], axis=-1, dtype=jnp.int32)  # (R,) int32
    top_values, top_ids = jax.lax.top_k(values, _num_top(values))  # (R, K) each
    return chosen, ranks, top_ids.astype(jnp.int32), top_values


def _zero_logprobs(
    logits: jax.Array, token_ids: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Zero placeholders shaped like raw_logprobs' results."""
    # logits: (R, V) float32; token_ids: (R,) int32
    shape = (logits.shape[0], _num_top(logits))
    return (
        jnp.zeros(token_ids.shape, jnp.float32),  # (R,) float32
        jnp.zeros(token_ids.shape, jnp.int32),  # (R,) int32
        jnp.zeros(shape, jnp.int32),  # (R, K) int32
        jnp.zeros(shape, jnp.float32),  # (R, K) float32
    )


def _num_top(logits: jax.Array) -> int:
    """Static K: MAX_LOGPROBS, or V when the vocabulary is smaller."""
    return min(MAX_LOGPROBS, logits.shape[1])
