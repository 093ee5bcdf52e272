"""SchedulerOutput -> fixed-shape padded arrays for the step. The only place that pads.

Padding rules: padded tokens write their K/V to the null page (slot 0) and read nothing that
matters; padded request rows have no tokens (`query_start_loc` repeats the real total), a page
table of null pages and `seq_lens` of 0, and their samples are dropped by the runner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxserve.batch.buckets import geometric_ladder, pick_bucket
from jaxserve.batch.descriptor import BatchDescriptor, DecodeSteps, PoolingBatch, PromptLogprobBatch
from jaxserve.kv.cache_manager import pages_for_tokens
from jaxserve.kv.page_pool import NULL_PAGE
from jaxserve.request import Request
from jaxserve.sampling.sampler import (
    KIND_ALLOWED,
    KIND_BANNED,
    KIND_BIAS,
    KIND_OUTPUT,
    KIND_PAD,
    KIND_PROMPT,
    SamplingBatch,
    bitmask_width,
)
from jaxserve.sampling.verify import Proposals
from jaxserve.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_EOS_TOKEN_IDS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_TOKEN_IDS,
)
from jaxserve.step import ScheduledRequest, SchedulerOutput

PAD_TOKEN_ID = 0
_NO_AUX_TOKENS = ((), (), ())  # (ids, kinds, values) of a sampling row without aux tokens
STOP_WIDTH = MAX_STOP_TOKEN_IDS + MAX_EOS_TOKEN_IDS  # DecodeSteps.stop_ids per row
# Per-row sampler tokens beyond the penalty history (prompt + output <= max_model_len): stop ids banned
# under min_tokens, logit biases, allowed ids, and the last tokens of bad words (two spellings each).
MAX_AUX_EXTRA = MAX_STOP_TOKEN_IDS + MAX_LOGIT_BIAS_ENTRIES + MAX_ALLOWED_TOKEN_IDS + 2 * MAX_BAD_WORDS


@dataclasses.dataclass(frozen=True)
class BucketLadders:
    """The padded sizes the runner compiles for: tokens T, page-table width W, penalty width P."""

    tokens: tuple[int, ...]
    page_widths: tuple[int, ...]
    aux_widths: tuple[int, ...]
    max_num_seqs: int

    @classmethod
    def build(cls, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, page_size: int,
              min_token_bucket: int, max_aux_extra: int, min_page_bucket: int = 1) -> "BucketLadders":
        """Powers of two up to each limit. Rows are tied to tokens: R = min(T, max_num_seqs)."""
        max_pages = pages_for_tokens(max_model_len, page_size)
        return cls(
            tokens=geometric_ladder(min(min_token_bucket, max_num_batched_tokens), max_num_batched_tokens),
            # x4 rungs: inside a bucket each attention tile already narrows to W/4 or W/2 pages, so
            # x2 rungs would add executables (start-up time) for little saved work.
            page_widths=geometric_ladder(min(min_page_bucket, max_pages), max_pages, ratio=4),
            # Penalty histories are rare and cheap to pad, so their ladder is coarser (x4).
            aux_widths=(0,) + geometric_ladder(min(64, max_model_len), max_model_len + max_aux_extra, ratio=4),
            max_num_seqs=max_num_seqs,
        )

    def rows_for(self, num_tokens_bucket: int) -> int:
        """The row bucket paired with a token bucket."""
        return min(num_tokens_bucket, self.max_num_seqs)

    def row_buckets(self) -> tuple[int, ...]:
        """Every distinct row count the sampler is compiled for."""
        return tuple(sorted({self.rows_for(t) for t in self.tokens}))


class PageRows:
    """Page-table rows as int32 arrays, kept from one step to the next: a request's row is converted from its page
    tuple once, and again only when a step hands it another tuple (KVCacheManager.page_tuple hands out the same
    tuple object while a request's pages do not change), instead of every row's pages every step."""

    def __init__(self):
        self._rows: dict[str, tuple[tuple[int, ...], np.ndarray]] = {}  # request id -> (its page tuple, (pages,))

    def flat(self, scheduled: list[ScheduledRequest]) -> np.ndarray:
        """(pages of all rows,) int32: every scheduled row's pages, row after row. Forgets the other requests."""
        rows, arrays = {}, []
        for item in scheduled:
            row = self._rows.get(item.request.request_id)
            if row is None or row[0] is not item.page_ids:  # the same tuple object: the same pages
                row = (item.page_ids, np.asarray(item.page_ids, np.int32).reshape(-1))
            rows[item.request.request_id] = row
            arrays.append(row[1])
        self._rows = rows
        return np.concatenate(arrays) if arrays else np.zeros((0,), np.int32)


def build_batch(output: SchedulerOutput, page_size: int, ladders: BucketLadders,
                device_rows: dict[str, int] | None = None, page_rows: PageRows | None = None) -> BatchDescriptor:
    """Flatten the scheduled chunks into padded numpy arrays (host side; the runner moves them).

    A request whose last token the previous step sampled and the host has not seen yet (asynchronous
    scheduling) finds it on the device: `device_rows` maps its id to its row in that step. `page_rows` keeps the
    page-table rows of an engine's requests from step to step (none: every row is converted)."""
    scheduled = output.scheduled
    total = output.total_num_tokens
    num_tokens = pick_bucket(ladders.tokens, max(total, 1))
    num_rows = ladders.rows_for(num_tokens)
    widest = max((pages_for_tokens(s.num_computed_tokens + s.num_positions, page_size) for s in scheduled), default=1)
    width = pick_bucket(ladders.page_widths, widest)

    arrays = padded_batch_arrays(num_tokens, num_rows, width, page_size)
    arrays["query_start_loc"][:] = total
    input_ids = arrays["input_ids"]

    # The rows' token ids, one Python pass; a plain decode's only token is usually on the device (nothing to copy).
    device_reads: list[tuple[int, int]] = []  # (step token, its row in the step before) of each token on the device
    present: list[tuple[int, int]] = []  # (first step token, count) of each row's tokens whose KV is already held
    start = 0
    for item in scheduled:
        stop = start + item.num_new_tokens
        first = item.num_computed_tokens
        proposed = len(item.spec_token_ids)  # proposals follow the request's own tokens
        own = item.num_new_tokens - proposed
        known = max(0, min(own, item.request.num_known_tokens - first))  # ids the host has
        if known < own:
            if known != own - 1 or proposed or item.request.request_id not in (device_rows or {}):
                raise RuntimeError(f"request {item.request.request_id} is scheduled over tokens nobody has")
            device_reads.append((stop - 1, device_rows[item.request.request_id]))
        if known:
            input_ids[start : start + known] = item.request.token_ids(first, first + known)
        if proposed:
            input_ids[stop - proposed : stop] = item.spec_token_ids
        if item.num_present_tokens:
            present.append((start, item.num_present_tokens))
        start = stop

    # Everything else at once, over the n scheduled rows and their N = `total` tokens.
    num_seqs = len(scheduled)
    num_new = np.array([item.num_new_tokens for item in scheduled], np.int64)  # (n,)
    computed = np.array([item.num_computed_tokens for item in scheduled], np.int64)  # (n,) first positions
    lora_slots = np.array([item.request.lora_slot for item in scheduled], np.int32)  # (n,)
    num_pages = np.array([len(item.page_ids) for item in scheduled], np.int64)  # (n,)
    stops = np.cumsum(num_new)  # (n,) each row's end in the step's tokens
    starts = stops - num_new  # (n,)
    if np.any((num_new > 0) & ((computed + num_new - 1) // page_size >= num_pages)):
        raise RuntimeError("a request is scheduled over positions its pages do not hold")
    page_table = arrays["page_table"]  # (R, W); pages for the extra iterations of a multi-step decode too
    page_table[:num_seqs][np.arange(width) < num_pages[:, None]] = (page_rows or PageRows()).flat(scheduled)
    row_of = np.repeat(np.arange(num_seqs), num_new)  # (N,) each step token's row
    positions = np.arange(total) - starts[row_of] + computed[row_of]  # (N,)
    arrays["positions"][:total] = positions
    arrays["lora_slots"][:total] = lora_slots[row_of]
    arrays["slot_mapping"][:total] = page_table[row_of, positions // page_size] * page_size + positions % page_size
    for token, count in present:
        arrays["slot_mapping"][token : token + count] = NULL_PAGE * page_size  # KV already held
    reads = np.array(device_reads, np.int64).reshape(-1, 2)  # (reads, 2) step token, row in the step before
    arrays["device_token_index"][reads[:, 0]] = reads[:, 1]
    arrays["query_start_loc"][:num_seqs] = starts
    arrays["seq_lens"][:num_seqs] = computed + num_new
    arrays["logits_indices"][:num_seqs] = stops - 1

    copies = output.page_copies
    if len(copies) > num_rows:
        raise RuntimeError(f"{len(copies)} page copies in a step of {num_rows} rows")
    for index, (source, copy) in enumerate(copies):
        arrays["copy_src"][index], arrays["copy_dst"][index] = source, copy
    arrays["num_seqs"] = np.asarray(num_seqs, np.int32)
    return BatchDescriptor(**arrays)


def prefill_batches(prompts: list[list[int]], page_size: int) -> tuple[int, list[BatchDescriptor]]:
    """(W, one step per prompt): each whole prompt as a step of one shape (the token rung of the longest, W pages)
    whose KV goes to pages 1 .. W in order, the steps of a scratch pool of W + 1 pages holding one prompt at a
    time (teacher-forced scoring, KV-scale calibration); one shape, so one compilation."""
    longest = max(len(prompt) for prompt in prompts)
    width = pages_for_tokens(longest, page_size)
    num_tokens = pick_bucket(geometric_ladder(16, max(16, longest)), longest)
    return width, [_prefill_batch(prompt, num_tokens, width, page_size) for prompt in prompts]


def _prefill_batch(prompt: list[int], num_tokens: int, width: int, page_size: int) -> BatchDescriptor:
    """One whole prompt as a step of `num_tokens` tokens (padded) whose KV goes to pages 1 .. `width`."""
    length = len(prompt)
    arrays = padded_batch_arrays(num_tokens, 1, width, page_size)
    positions = np.arange(length, dtype=np.int32)  # (n,)
    pages = np.arange(1, width + 1, dtype=np.int32)  # (W,)
    arrays["input_ids"][:length] = prompt
    arrays["positions"][:length] = positions
    arrays["slot_mapping"][:length] = pages[positions // page_size] * page_size + positions % page_size
    arrays["query_start_loc"][:] = [0, length]
    arrays["seq_lens"][0] = length
    arrays["page_table"][0] = pages
    arrays["logits_indices"][0] = length - 1
    arrays["num_seqs"] = np.asarray(1, np.int32)
    return BatchDescriptor(**arrays)


def padded_batch_arrays(num_tokens: int, num_rows: int, width: int, page_size: int) -> dict[str, np.ndarray]:
    """Every BatchDescriptor field at its padding value, for T tokens, R rows and W pages per row."""
    return {
        "input_ids": np.full((num_tokens,), PAD_TOKEN_ID, np.int32),  # (T,)
        "device_token_index": np.full((num_tokens,), -1, np.int32),  # (T,)
        "positions": np.zeros((num_tokens,), np.int32),  # (T,)
        "slot_mapping": np.full((num_tokens,), NULL_PAGE * page_size, np.int32),  # (T,)
        "query_start_loc": np.zeros((num_rows + 1,), np.int32),  # (R + 1,)
        "seq_lens": np.zeros((num_rows,), np.int32),  # (R,)
        "page_table": np.full((num_rows, width), NULL_PAGE, np.int32),  # (R, W)
        "logits_indices": np.zeros((num_rows,), np.int32),  # (R,)
        "copy_src": np.full((num_rows,), NULL_PAGE, np.int32),  # (R,)
        "copy_dst": np.full((num_rows,), NULL_PAGE, np.int32),  # (R,)
        "lora_slots": np.full((num_tokens,), -1, np.int32),  # (T,)
        "num_seqs": np.asarray(0, np.int32),  # ()
    }


def build_prompt_logprob_batch(output: SchedulerOutput, num_tokens: int) -> tuple[PromptLogprobBatch | None, list[int]]:
    """The prompt tokens this step can score for requests that want prompt logprobs, padded to the step's
    `num_tokens`; returns the batch and how many entries each scheduled row has, in row order, or
    (None, []) when nothing is wanted (the step then costs nothing extra).

    A chunk computes positions [c, c + n); position p scores prompt token p + 1. Tokens already scored
    (before a preemption, say) are skipped, so each prompt token is scored once.
    """
    if not any(item.request.num_prompt_logprobs_missing for item in output.scheduled):
        return None, []
    arrays = padded_prompt_logprob_arrays(num_tokens)
    counts, filled, start = [], 0, 0
    for item in output.scheduled:
        request, first = item.request, item.num_computed_tokens
        count = 0
        if request.num_prompt_logprobs_missing:
            lowest = max(first + 1, len(request.prompt_logprobs))  # first target not yet scored
            highest = min(first + item.num_new_tokens, len(request.prompt_token_ids) - 1)  # last target
            targets = np.arange(lowest, highest + 1)  # (count,) prompt positions
            count = len(targets)
            arrays["token_index"][filled : filled + count] = start + targets - 1 - first
            arrays["target_ids"][filled : filled + count] = np.asarray(request.prompt_token_ids)[targets]
        counts.append(count)
        filled += count
        start += item.num_new_tokens
    if not filled:
        return None, []
    arrays["num_targets"] = np.asarray(filled, np.int32)
    return PromptLogprobBatch(**arrays), counts


def build_pooling_batch(output: SchedulerOutput, num_tokens: int, num_rows: int
                        ) -> tuple[PoolingBatch | None, list[slice]]:
    """The step tokens pooling requests pool, padded to the step's `num_tokens` tokens of `num_rows` rows; returns
    the batch and the step tokens each scheduled row pools (a slice of the step's tokens), in row order, or (None,
    []) when no row pools any (the step then costs nothing extra). A chunk computes positions [c, c + n); of those,
    a row pools the ones its pool still needs (pooling/pooled.py), so a position computed again after a preemption
    is pooled once. The tokens' states are summed row by row, or come back one by one when some request pools
    every token apart (`PooledPrompt.per_token`)."""
    pooling = [item for item in output.scheduled if item.request.pooled is not None]
    if not pooling:
        return None, []
    per_token = any(item.request.pooled.per_token for item in pooling)
    arrays = padded_pooling_arrays(num_tokens, num_tokens if per_token else num_rows)
    spans, start = [], 0
    for row, item in enumerate(output.scheduled):
        request, first = item.request, item.num_computed_tokens
        span = slice(start, start)
        if request.pooled is not None:
            wanted = request.pooled.positions(len(request.prompt_token_ids))
            low, high = max(first, wanted.start), min(first + item.num_new_tokens, wanted.stop)
            span = slice(start + low - first, start + max(high, low) - first)
            arrays["token_segments"][span] = np.arange(span.start, span.stop) if per_token else row
        spans.append(span)
        start += item.num_new_tokens
    if not any(span.stop > span.start for span in spans):
        return None, []
    return PoolingBatch(**arrays), spans


def padded_pooling_arrays(num_tokens: int, num_segments: int) -> dict[str, np.ndarray]:
    """Every PoolingBatch field at its padding value for a step of T tokens pooled into `num_segments` (R, or T)."""
    return {"token_segments": np.full((num_tokens,), num_segments, np.int32),  # (T,)
            "num_segments": np.asarray(num_segments, np.int32)}  # ()


def build_decode_steps(output: SchedulerOutput, num_rows: int) -> DecodeSteps | None:
    """The per-row step counts and stop ids of a multi-step decode, padded to `num_rows` rows; None when every
    row samples one token (an ordinary step)."""
    if all(item.num_steps == 1 for item in output.scheduled):
        return None
    arrays = padded_decode_step_arrays(num_rows)
    for row, item in enumerate(output.scheduled):
        params = item.request.sampling_params
        stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(item.request.eos_token_ids))
        arrays["num_steps"][row] = item.num_steps
        arrays["stop_ids"][row, : len(stop_ids)] = stop_ids
    return DecodeSteps(**arrays)


def build_proposals(output: SchedulerOutput, num_rows: int, width: int) -> Proposals | None:
    """The proposals each row verifies and the step tokens whose logits check them, padded to `num_rows` rows
    of `width` positions (1 + num_speculative_tokens); None when no row verifies any (an ordinary step)."""
    if not any(item.spec_token_ids for item in output.scheduled):
        return None
    arrays = padded_proposal_arrays(num_rows, width)
    start = 0
    for row, item in enumerate(output.scheduled):
        count = len(item.spec_token_ids)
        arrays["token_ids"][row, :count] = item.spec_token_ids
        arrays["num_tokens"][row] = count
        first = start + item.num_new_tokens - 1 - count  # the request's own last token
        arrays["logits_index"][row] = first + np.minimum(np.arange(width), count)
        start += item.num_new_tokens
    return Proposals(**arrays)


def padded_proposal_arrays(num_rows: int, width: int) -> dict[str, np.ndarray]:
    """Every Proposals field at its padding value for R rows and S = `width` verified positions."""
    return {
        "token_ids": np.full((num_rows, width - 1), -1, np.int32),  # (R, S - 1)
        "num_tokens": np.zeros((num_rows,), np.int32),  # (R,)
        "logits_index": np.zeros((num_rows, width), np.int32),  # (R, S)
    }


def padded_decode_step_arrays(num_rows: int) -> dict[str, np.ndarray]:
    """Every DecodeSteps field at its padding value for R rows."""
    return {
        "num_steps": np.zeros((num_rows,), np.int32),  # (R,)
        "stop_ids": np.full((num_rows, STOP_WIDTH), -1, np.int32),  # (R, S)
    }


def padded_prompt_logprob_arrays(num_tokens: int) -> dict[str, np.ndarray]:
    """Every PromptLogprobBatch field at its padding value for a step of T tokens."""
    return {
        "token_index": np.zeros((num_tokens,), np.int32),  # (Q,)
        "target_ids": np.zeros((num_tokens,), np.int32),  # (Q,)
        "num_targets": np.asarray(0, np.int32),  # ()
    }


def build_sampling_batch(output: SchedulerOutput, num_rows: int, ladders: BucketLadders,
                         vocab_size: int) -> SamplingBatch:
    """Per-row sampling parameters, padded to `num_rows`; penalty/ban token lists padded to a P bucket; room for the
    token bitmask of each sampling row under a constraint (structured output, a thinking budget) when one is, every
    bit set until `fill_token_bitmasks`."""
    scheduled = output.scheduled
    aux_rows = [_aux_tokens(item.request, item.sample_index) for item in scheduled]
    aux_width = pick_bucket(ladders.aux_widths, max((len(ids) for ids, _, _ in aux_rows), default=0))
    constrained = any(_masked(item) for item in output.scheduled)

    arrays = padded_sampling_arrays(num_rows, aux_width, bitmask_width(vocab_size) if constrained else 0)
    num_seqs = len(scheduled)
    params = [item.request.sampling_params for item in scheduled]
    arrays["temperature"][:num_seqs] = [p.temperature for p in params]
    arrays["top_k"][:num_seqs] = [max(p.top_k, 0) for p in params]
    arrays["top_p"][:num_seqs] = [p.top_p for p in params]
    arrays["min_p"][:num_seqs] = [p.min_p for p in params]
    arrays["presence_penalty"][:num_seqs] = [p.presence_penalty for p in params]
    arrays["frequency_penalty"][:num_seqs] = [p.frequency_penalty for p in params]
    arrays["repetition_penalty"][:num_seqs] = [p.repetition_penalty for p in params]
    seeds = np.array([item.request.seed % (1 << 64) for item in scheduled], np.uint64)  # (n,)
    arrays["seeds"][:num_seqs, 0] = seeds & 0xFFFFFFFF
    arrays["seeds"][:num_seqs, 1] = seeds >> 32
    arrays["sample_index"][:num_seqs] = [item.sample_index for item in scheduled]
    for row, (ids, kinds, aux_values) in enumerate(aux_rows):
        if ids:
            arrays["aux_token_ids"][row, : len(ids)] = ids
            arrays["aux_token_kind"][row, : len(kinds)] = kinds
            arrays["aux_values"][row, : len(aux_values)] = aux_values
    arrays["need_logprobs"] = np.asarray(any(p.logprobs is not None for p in params))
    return SamplingBatch(**arrays)


def fill_token_bitmasks(sampling: SamplingBatch, output: SchedulerOutput) -> None:
    """Write each constrained sampling row's mask of allowed tokens into `sampling.token_bitmask` (R, M), from its
    request's constraint: once it has taken every token before the row's (the step in flight brought), just
    before the step is dispatched. Rows of requests that ended meanwhile keep every bit set (their samples are
    dropped)."""
    if sampling.token_bitmask.shape[1] == 0:
        return
    for row, item in enumerate(output.scheduled):
        if _masked(item) and not item.request.is_finished:
            item.request.constraint.fill(sampling.token_bitmask, row)


def _masked(item: ScheduledRequest) -> bool:
    """Whether a scheduled row samples under its request's constraint: a token not certainly free."""
    constraint = item.request.constraint
    return bool(item.samples) and constraint is not None and not constraint.is_free(item.sample_index)


def padded_sampling_arrays(num_rows: int, aux_width: int, mask_width: int = 0) -> dict[str, np.ndarray]:
    """Every SamplingBatch field at its neutral value (greedy, no penalties, every token allowed) for R rows, P aux
    tokens, M bitmask words."""
    return {
        "temperature": np.zeros((num_rows,), np.float32),  # (R,)
        "top_k": np.zeros((num_rows,), np.int32),  # (R,)
        "top_p": np.ones((num_rows,), np.float32),  # (R,)
        "min_p": np.zeros((num_rows,), np.float32),  # (R,)
        "presence_penalty": np.zeros((num_rows,), np.float32),  # (R,)
        "frequency_penalty": np.zeros((num_rows,), np.float32),  # (R,)
        "repetition_penalty": np.ones((num_rows,), np.float32),  # (R,)
        "seeds": np.zeros((num_rows, 2), np.uint32),  # (R, 2)
        "sample_index": np.zeros((num_rows,), np.int32),  # (R,)
        "aux_token_ids": np.full((num_rows, aux_width), -1, np.int32),  # (R, P)
        "aux_token_kind": np.full((num_rows, aux_width), KIND_PAD, np.int8),  # (R, P)
        "aux_values": np.zeros((num_rows, aux_width), np.float32),  # (R, P)
        "need_logprobs": np.asarray(False),  # ()
        "token_bitmask": np.full((num_rows, mask_width), -1, np.int32),  # (R, M)
    }


def _aux_tokens(request: Request, sample_index: int) -> tuple[Sequence[int], Sequence[int], Sequence[float]]:
    """Token ids the sampler must see for this row, their KIND_* and values: history for penalties,
    stop ids banned by min_tokens, banned last tokens of bad words, logit biases, allowed ids.
    `sample_index` is the output index of the token the row samples."""
    params = request.sampling_params
    if not (params.needs_penalties or request.bad_words_token_ids or sample_index < params.min_tokens
            or params.allowed_token_ids or params.logit_bias):
        return _NO_AUX_TOKENS  # the common row (each list below would stay empty), at no allocation
    ids: list[int] = []
    kinds: list[int] = []
    if params.needs_penalties:
        ids += request.prompt_token_ids + request.output_token_ids
        kinds += [KIND_PROMPT] * len(request.prompt_token_ids) + [KIND_OUTPUT] * request.num_output_tokens
    banned = _banned_bad_word_tokens(request)
    if sample_index < params.min_tokens:
        banned += list(params.stop_token_ids) + ([] if params.ignore_eos else list(request.eos_token_ids))
    ids += banned
    kinds += [KIND_BANNED] * len(banned)
    if params.allowed_token_ids:
        ids += params.allowed_token_ids
        kinds += [KIND_ALLOWED] * len(params.allowed_token_ids)
    values = [0.0] * len(ids)
    if params.logit_bias:
        ids += list(params.logit_bias)
        kinds += [KIND_BIAS] * len(params.logit_bias)
        values += list(params.logit_bias.values())
    return ids, kinds, values


def _banned_bad_word_tokens(request: Request) -> list[int]:
    """The last token of every bad word whose other tokens end the output so far (vLLM's rule)."""
    output = request.output_token_ids
    banned = []
    for word in request.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix):
            banned.append(word[-1])
    return banned
