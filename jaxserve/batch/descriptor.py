"""BatchDescriptor: the fixed-shape padded pytree that is the model step's input; PromptLogprobBatch:
which of its tokens' hidden states score a prompt token; PoolingBatch: which of them a pooling request pools;
DecodeSteps: a multi-step decode's per-row counts."""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    """The model step's only input besides params and KV pages. Shapes: T tokens, R rows, W pages per row."""

    input_ids: jax.Array  # (T,) int32 token ids, flattened over requests
    # (T,) int32 for a token whose id is still on the device: its row in the previous step's samples; else -1
    device_token_index: jax.Array
    positions: jax.Array  # (T,) int32 absolute position of each token in its sequence
    slot_mapping: jax.Array  # (T,) int32 page * page_size + offset where each token's K/V is written
    query_start_loc: jax.Array  # (R + 1,) int32 first token of each row; padded rows start at the real total
    seq_lens: jax.Array  # (R,) int32 tokens in the cache after this step (0 for padded rows)
    page_table: jax.Array  # (R, W) int32 page ids of each row, padded with the null page
    logits_indices: jax.Array  # (R,) int32 index of each row's last token in the flattened batch
    copy_src: jax.Array  # (R,) int32 pages to copy before the step writes (copy-on-write); pad 0
    copy_dst: jax.Array  # (R,) int32 where each copy goes; pad 0 (the null page onto itself)
    lora_slots: jax.Array  # (T,) int32 the LoRA adapter slot each token runs with (model/lora.py); -1: none
    num_seqs: jax.Array  # () int32 real rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobBatch:
    """The prompt tokens whose logprobs a step computes, padded to the step's T tokens (Q = T).

    The hidden state of the token at position p predicts the prompt token at p + 1.
    """

    token_index: jax.Array  # (Q,) int32 index into the step's tokens of the predicting position; pad 0
    target_ids: jax.Array  # (Q,) int32 the prompt token whose logprob is wanted; pad 0
    num_targets: jax.Array  # () int32 real entries


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PoolingBatch:
    """The step tokens whose final hidden states pooling requests add into their pools (embeddings): each
    segment's sum over its tokens comes back (pooling/pooled.py). A segment is a row, or in a step where some
    request pools token by token (`num_segments` == T) each pooled token's own index."""

    token_segments: jax.Array  # (T,) int32 the segment whose sum a token's state joins; num_segments (none) else
    num_segments: jax.Array  # () int32 R, or T when tokens are pooled one by one (read on the host)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeSteps:
    """Multi-step decoding: how many tokens each row of a decode-only batch samples in one device call, and
    which sampled ids end a row early (its later iterations then write their KV to the null page)."""

    num_steps: jax.Array  # (R,) int32 tokens each row samples; 0 for padded rows
    stop_ids: jax.Array  # (R, S) int32 EOS (unless ignored) and stop token ids of each row; pad -1
