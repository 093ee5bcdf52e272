"""Built step inputs padded again into a larger bucket: while the smaller buckets still compile in the background
(`background_compile`), a step runs in the largest one, which serves any step.

Padding is what the builders write for nothing: the padded tokens and rows of the larger bucket are exactly those
of a step built for it, so its real tokens, rows and samples are the same.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.batch.builder import padded_batch_arrays, padded_prompt_logprob_arrays, padded_sampling_arrays
from jaxserve.batch.descriptor import BatchDescriptor, PromptLogprobBatch
from jaxserve.sampling.sampler import SamplingBatch


def _copied(small, large: dict) -> dict:
    """`large` (padding arrays by field name) with each array field of the dataclass `small` written over its
    leading corner (a scalar field: replaced)."""
    for field in dataclasses.fields(small):
        name, value = field.name, np.asarray(getattr(small, field.name))
        if value.ndim:
            large[name][tuple(slice(0, size) for size in value.shape)] = value
        else:
            large[name] = value
    return large


def repad_batch(batch: BatchDescriptor, num_tokens: int, num_rows: int, width: int, page_size: int) -> BatchDescriptor:
    """`batch` in the bucket of T tokens, R rows and W pages per row (each at least the batch's)."""
    arrays = _copied(batch, padded_batch_arrays(num_tokens, num_rows, width, page_size))
    arrays["query_start_loc"][batch.query_start_loc.shape[0]:] = batch.query_start_loc[-1]  # padded rows: at the end
    return BatchDescriptor(**arrays)


def repad_sampling(sampling: SamplingBatch, num_rows: int, aux_width: int) -> SamplingBatch:
    """`sampling` for R rows and P aux tokens a row (each at least its own), its bitmask width kept."""
    arrays = padded_sampling_arrays(num_rows, aux_width, sampling.token_bitmask.shape[1])
    return SamplingBatch(**_copied(sampling, arrays))


def repad_prompt(prompt: PromptLogprobBatch, num_tokens: int) -> PromptLogprobBatch:
    """`prompt` for a step of T tokens (at least its own)."""
    return PromptLogprobBatch(**_copied(prompt, padded_prompt_logprob_arrays(num_tokens)))
