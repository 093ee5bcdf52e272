"""SchedulerOutput -> fixed-shape padded arrays for the step. The only place that pads.

Padding rules: padded tokens write their K/V to the null page (slot 0) and read nothing that
matters; padded request rows have no tokens (`query_start_loc` repeats the real total), a page
table of null pages and `seq_lens` of 0, and their samples are dropped by the runner.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.batch_descriptor import BatchDescriptor
from jaxserve.buckets import pick_bucket, geometric_ladder
from jaxserve.kv.cache_manager import pages_for_tokens
from jaxserve.kv.page_pool import NULL_PAGE
from jaxserve.sampler import KIND_BANNED, KIND_OUTPUT, KIND_PAD, KIND_PROMPT, SamplingBatch
from jaxserve.scheduler import SchedulerOutput

PAD_TOKEN_ID = 0


@dataclasses.dataclass(frozen=True)
class BucketLadders:
    """The padded sizes the runner compiles for: tokens T, page-table width W, penalty width P."""

    tokens: tuple[int, ...]
    page_widths: tuple[int, ...]
    aux_widths: tuple[int, ...]
    max_num_seqs: int

    @classmethod
    def build(cls, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, page_size: int,
              min_token_bucket: int, max_aux_extra: int) -> "BucketLadders":
        """Powers of two up to each limit. Rows are tied to tokens: R = min(T, max_num_seqs)."""
        return cls(
            tokens=geometric_ladder(min(min_token_bucket, max_num_batched_tokens), max_num_batched_tokens),
            # x4 rungs: inside a bucket each attention tile already narrows to W/4 or W/2 pages, so
            # x2 rungs would add executables (start-up time) for little saved work.
            page_widths=geometric_ladder(1, pages_for_tokens(max_model_len, page_size), ratio=4),
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


def build_batch(output: SchedulerOutput, page_size: int, ladders: BucketLadders) -> BatchDescriptor:
    """Flatten the scheduled chunks into padded numpy arrays (host side; the runner moves them)."""
    num_tokens = pick_bucket(ladders.tokens, max(output.total_num_tokens, 1))
    num_rows = ladders.rows_for(num_tokens)
    widest = max((pages_for_tokens(s.num_computed_tokens + s.num_new_tokens, page_size) for s in output.scheduled),
                 default=1)
    width = pick_bucket(ladders.page_widths, widest)

    arrays = padded_batch_arrays(num_tokens, num_rows, width, page_size)
    arrays["query_start_loc"][:] = output.total_num_tokens
    input_ids, positions, slot_mapping = arrays["input_ids"], arrays["positions"], arrays["slot_mapping"]
    query_start_loc, seq_lens, page_table = arrays["query_start_loc"], arrays["seq_lens"], arrays["page_table"]
    logits_indices = arrays["logits_indices"]

    start = 0
    for row, item in enumerate(output.scheduled):
        stop = start + item.num_new_tokens
        first = item.num_computed_tokens
        token_positions = np.arange(first, first + item.num_new_tokens, dtype=np.int32)
        pages = np.asarray(item.page_ids, np.int32)
        input_ids[start:stop] = item.request.token_ids(first, first + item.num_new_tokens)
        positions[start:stop] = token_positions
        slot_mapping[start:stop] = pages[token_positions // page_size] * page_size + token_positions % page_size
        query_start_loc[row] = start
        seq_lens[row] = first + item.num_new_tokens
        page_table[row, : len(pages)] = pages
        logits_indices[row] = stop - 1
        start = stop

    arrays["num_seqs"] = np.asarray(len(output.scheduled), np.int32)
    return BatchDescriptor(**arrays)


def padded_batch_arrays(num_tokens: int, num_rows: int, width: int, page_size: int) -> dict[str, np.ndarray]:
    """Every BatchDescriptor field at its padding value, for T tokens, R rows and W pages per row."""
    return {
        "input_ids": np.full((num_tokens,), PAD_TOKEN_ID, np.int32),  # (T,)
        "positions": np.zeros((num_tokens,), np.int32),  # (T,)
        "slot_mapping": np.full((num_tokens,), NULL_PAGE * page_size, np.int32),  # (T,)
        "query_start_loc": np.zeros((num_rows + 1,), np.int32),  # (R + 1,)
        "seq_lens": np.zeros((num_rows,), np.int32),  # (R,)
        "page_table": np.full((num_rows, width), NULL_PAGE, np.int32),  # (R, W)
        "logits_indices": np.zeros((num_rows,), np.int32),  # (R,)
        "num_seqs": np.asarray(0, np.int32),  # ()
    }


def build_sampling_batch(output: SchedulerOutput, num_rows: int, ladders: BucketLadders) -> SamplingBatch:
    """Per-row sampling parameters, padded to `num_rows`; penalty/ban token lists padded to a P bucket."""
    aux_rows = [_aux_tokens(item.request) for item in output.scheduled]
    aux_width = pick_bucket(ladders.aux_widths, max((len(ids) for ids, _ in aux_rows), default=0))

    arrays = padded_sampling_arrays(num_rows, aux_width)
    need_logprobs = False

    for row, item in enumerate(output.scheduled):
        request, params = item.request, item.request.sampling_params
        arrays["temperature"][row] = params.temperature
        arrays["top_k"][row] = max(params.top_k, 0)
        arrays["top_p"][row] = params.top_p
        arrays["min_p"][row] = params.min_p
        arrays["presence_penalty"][row] = params.presence_penalty
        arrays["frequency_penalty"][row] = params.frequency_penalty
        arrays["repetition_penalty"][row] = params.repetition_penalty
        arrays["seeds"][row] = request.seed % (1 << 32)
        arrays["sample_index"][row] = request.num_output_tokens
        ids, kinds = aux_rows[row]
        arrays["aux_token_ids"][row, : len(ids)] = ids
        arrays["aux_token_kind"][row, : len(kinds)] = kinds
        need_logprobs |= params.logprobs is not None

    arrays["need_logprobs"] = np.asarray(need_logprobs)
    return SamplingBatch(**arrays)


def padded_sampling_arrays(num_rows: int, aux_width: int) -> dict[str, np.ndarray]:
    """Every SamplingBatch field at its neutral value (greedy, no penalties) for R rows, P aux tokens."""
    return {
        "temperature": np.zeros((num_rows,), np.float32),  # (R,)
        "top_k": np.zeros((num_rows,), np.int32),  # (R,)
        "top_p": np.ones((num_rows,), np.float32),  # (R,)
        "min_p": np.zeros((num_rows,), np.float32),  # (R,)
        "presence_penalty": np.zeros((num_rows,), np.float32),  # (R,)
        "frequency_penalty": np.zeros((num_rows,), np.float32),  # (R,)
        "repetition_penalty": np.ones((num_rows,), np.float32),  # (R,)
        "seeds": np.zeros((num_rows,), np.uint32),  # (R,)
        "sample_index": np.zeros((num_rows,), np.int32),  # (R,)
        "aux_token_ids": np.full((num_rows, aux_width), -1, np.int32),  # (R, P)
        "aux_token_kind": np.full((num_rows, aux_width), KIND_PAD, np.int8),  # (R, P)
        "need_logprobs": np.asarray(False),  # ()
    }


def _aux_tokens(request) -> tuple[list[int], list[int]]:
    """Token ids the sampler must see for this row: history for penalties, stop ids banned by min_tokens."""
    params = request.sampling_params
    ids: list[int] = []
    kinds: list[int] = []
    if params.needs_penalties:
        ids += request.prompt_token_ids + request.output_token_ids
        kinds += [KIND_PROMPT] * len(request.prompt_token_ids) + [KIND_OUTPUT] * request.num_output_tokens
    if request.num_output_tokens < params.min_tokens:
        banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(request.eos_token_ids))
        ids += banned
        kinds += [KIND_BANNED] * len(banned)
    return ids, kinds
