"""The batch builder: padding rules of the BatchDescriptor and SamplingBatch."""

import numpy as np
import pytest

from jaxserve.batch.builder import PAD_TOKEN_ID, BucketLadders, build_batch, build_sampling_batch
from jaxserve.batch.buckets import geometric_ladder, pick_bucket
from jaxserve.kv.page_pool import NULL_PAGE
from jaxserve.request import Request
from jaxserve.sampling.sampler import KIND_BANNED, KIND_OUTPUT, KIND_PROMPT
from jaxserve.sampling_params import SamplingParams
from jaxserve.step import ScheduledRequest, SchedulerOutput

LADDERS = BucketLadders.build(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, page_size=8,
                              min_token_bucket=8, max_aux_extra=4)


def _request(request_id, prompt, outputs=(), **params):
    request = Request(request_id, list(prompt), SamplingParams(**params), eos_token_ids=(1,), seed=7,
                      max_tokens=16)
    request.output_token_ids = list(outputs)
    return request


def test_ladders_and_buckets():
    assert geometric_ladder(8, 64) == (8, 16, 32, 64)
    assert geometric_ladder(8, 100) == (8, 16, 32, 64, 100)
    assert geometric_ladder(64, 1100, ratio=4) == (64, 256, 1024, 1100)
    assert pick_bucket((8, 16, 32), 9) == 16
    assert LADDERS.rows_for(64) == 8 and LADDERS.rows_for(8) == 8


@pytest.mark.parametrize("min_page_bucket, widths", [(1, (1, 4, 16, 64, 128)), (4, (4, 16, 64, 128)),
                                                     (100, (100, 128)), (128, (128,)), (4096, (128,))])
def test_page_widths_start_at_min_page_bucket_and_end_at_max_model_lens_pages(min_page_bucket, widths):
    """A larger min_page_bucket leaves fewer widths to compile; past max_model_len's pages, one (the widest)."""
    ladders = BucketLadders.build(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=2048, page_size=16,
                                  min_token_bucket=8, max_aux_extra=4, min_page_bucket=min_page_bucket)
    assert ladders.page_widths == widths


def test_prefill_chunk_and_decode_are_flattened_and_padded():
    prefill = _request("a", range(10, 22))  # 12 prompt tokens, first chunk of 5
    decode = _request("b", range(30, 39), outputs=[40])  # 9 prompt + 1 output, one token behind
    output = SchedulerOutput(
        scheduled=[
            ScheduledRequest(prefill, num_new_tokens=5, num_computed_tokens=0, page_ids=(3,), samples=False),
            ScheduledRequest(decode, num_new_tokens=1, num_computed_tokens=9, page_ids=(5, 6), samples=True),
        ],
        preempted_ids=[],
    )
    batch = build_batch(output, page_size=8, ladders=LADDERS)
    assert LADDERS.page_widths == (1, 4, 8)  # x4 rungs up to the widest
    assert batch.input_ids.shape == (8,) and batch.page_table.shape == (8, 4)  # T=8, R=8, W=4 (2 pages needed)
    assert batch.input_ids[:6].tolist() == [10, 11, 12, 13, 14, 40]
    assert batch.positions[:6].tolist() == [0, 1, 2, 3, 4, 9]
    assert batch.slot_mapping[:6].tolist() == [24, 25, 26, 27, 28, 6 * 8 + 1]
    assert (batch.slot_mapping[6:] == NULL_PAGE * 8).all(), "padded tokens write to the null page"
    assert batch.query_start_loc.tolist() == [0, 5, 6, 6, 6, 6, 6, 6, 6]
    assert batch.seq_lens.tolist() == [5, 10, 0, 0, 0, 0, 0, 0]
    assert batch.page_table[:2].tolist() == [[3, NULL_PAGE, NULL_PAGE, NULL_PAGE], [5, 6, NULL_PAGE, NULL_PAGE]]
    assert (batch.page_table[2:] == NULL_PAGE).all()
    assert batch.logits_indices[:2].tolist() == [4, 5] and int(batch.num_seqs) == 2


def test_a_token_still_on_the_device_is_read_from_the_last_steps_row():
    """Asynchronous scheduling: a decode whose input token the last step sampled (a placeholder on the
    host) takes it from that step's samples on the device, by row; nothing else does."""
    known = _request("k", range(10, 14), outputs=[20])
    pending = _request("p", range(30, 34), outputs=[40])
    pending.num_output_placeholders = 1  # its second output token is still on the device
    output = SchedulerOutput([
        ScheduledRequest(known, num_new_tokens=1, num_computed_tokens=4, page_ids=(3,), samples=True),
        ScheduledRequest(pending, num_new_tokens=1, num_computed_tokens=5, page_ids=(5,), samples=True),
    ], [])
    batch = build_batch(output, page_size=8, ladders=LADDERS, device_rows={"p": 6, "k": 2})
    assert batch.input_ids[:2].tolist() == [20, PAD_TOKEN_ID]
    assert batch.device_token_index.tolist() == [-1, 6, -1, -1, -1, -1, -1, -1]
    with pytest.raises(RuntimeError, match="tokens nobody has"):
        build_batch(output, page_size=8, ladders=LADDERS, device_rows={"k": 2})


def test_page_copies_and_present_tokens():
    """A fork's first step: its copy goes in the padded copy list, and its present token (the last prompt
    token, whose KV the shared page holds) is computed but written to the null page."""
    fork = _request("f", range(10, 18))
    output = SchedulerOutput(
        scheduled=[ScheduledRequest(fork, num_new_tokens=1, num_computed_tokens=7, page_ids=(4,), samples=True,
                                    page_copies=((2, 4),), num_present_tokens=1)],
        preempted_ids=[],
    )
    batch = build_batch(output, page_size=8, ladders=LADDERS)
    assert batch.copy_src.tolist() == [2] + [NULL_PAGE] * 7 and batch.copy_dst.tolist() == [4] + [NULL_PAGE] * 7
    assert batch.positions[0] == 7 and batch.input_ids[0] == 17
    assert batch.slot_mapping[0] == NULL_PAGE * 8 and batch.seq_lens[0] == 8


def test_sampling_rows_carry_history_only_when_needed():
    plain = _request("a", [5, 6], outputs=[7])
    penalised = _request("b", [5, 6], outputs=[7, 8], presence_penalty=0.5, min_tokens=4, stop_token_ids=[9],
                         temperature=0.7, top_k=-1, seed=3)
    output = SchedulerOutput(
        scheduled=[ScheduledRequest(r, 1, r.num_tokens - 1, (2,), True, sample_index=r.num_output_tokens)
                   for r in (plain, penalised)],
        preempted_ids=[],
    )
    sampling = build_sampling_batch(output, num_rows=8, ladders=LADDERS, vocab_size=64)
    assert sampling.aux_token_ids.shape == (8, 64)
    assert sampling.aux_token_ids[0, 0] == -1, "a row without penalties has no history"
    ids, kinds = sampling.aux_token_ids[1, :7].tolist(), sampling.aux_token_kind[1, :7].tolist()
    assert ids == [5, 6, 7, 8, 9, 1, -1]
    assert kinds == [KIND_PROMPT, KIND_PROMPT, KIND_OUTPUT, KIND_OUTPUT, KIND_BANNED, KIND_BANNED, 0]
    assert sampling.top_k[1] == 0 and np.isclose(sampling.temperature[1], 0.7)
    assert sampling.sample_index[:2].tolist() == [1, 2]
    assert (sampling.temperature[2:] == 0).all(), "padded rows are greedy"
    none = SchedulerOutput([ScheduledRequest(plain, 1, 2, (2,), True)], [])
    assert build_sampling_batch(none, num_rows=8, ladders=LADDERS, vocab_size=64).aux_token_ids.shape == (8, 0)
