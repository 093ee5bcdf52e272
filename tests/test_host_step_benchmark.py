"""benchmarks/host_step.py at tiny sizes: the engine's real host path over a fake runner reaches a steady decode of
every row, and the result says where each step's host time went."""

import json

import numpy as np

from benchmarks.host_step import COLUMNS, FakeRunner, main
from jaxserve.batch.builder import padded_batch_arrays, padded_sampling_arrays
from jaxserve.batch.descriptor import BatchDescriptor
from jaxserve.engine.step_timing import PHASES
from jaxserve.sampling.sampler import SamplingBatch


def test_host_step_benchmark_times_a_steady_decode_of_every_row(tmp_path):
    path = tmp_path / "host_step.json"
    results = main(["--rows", "4", "--steps", "3", "--warmup", "2", "--prompt-len", "40", "--json", str(path)])
    assert [(r["rows"], r["sampling"]) for r in results] == [(4, "sampled"), (4, "greedy")]
    for result in results:
        assert result["decoding_rows"] == [4, 4, 4], "every timed step decodes every row"
        assert set(result["mean_ms"]) == set(result["best_ms"]) == set(COLUMNS) == {"total", "other", "gc", *PHASES}
        assert 0 <= result["mean_ms"]["gc"] <= result["mean_ms"]["total"]  # inside the phases it interrupted
        assert all(len(times) == 3 for times in result["step_ms"].values())
        for phase in ("total", "schedule", "build", "dispatch", "wait", "update", "output"):
            assert result["best_ms"][phase] > 0, phase
            assert result["best_ms"][phase] <= result["mean_ms"][phase], phase
        assert result["mean_ms"]["swap"] == 0.0  # nothing is preempted
        parts = sum(result["mean_ms"][phase] for phase in PHASES) + result["mean_ms"]["other"]
        assert abs(parts - result["mean_ms"]["total"]) < 1e-6, "the phases and the rest add up to the step"
        assert result["timing"]["steps"] > 3  # the engine's own count: the prompts, the warm-up, the timed steps
    assert json.loads(path.read_text()) == results


def _step_inputs(rows: list[tuple[int, int]], num_rows: int):
    """A BatchDescriptor and a SamplingBatch of `num_rows` padded rows whose real rows have (seed, seq_len) `rows`."""
    batch = padded_batch_arrays(num_rows, num_rows, 4, 16)
    sampling = padded_sampling_arrays(num_rows, 0)
    for row, (seed, seq_len) in enumerate(rows):
        sampling["seeds"][row] = (seed, 0)
        batch["seq_lens"][row] = seq_len
    batch["num_seqs"] = np.asarray(len(rows), np.int32)
    return BatchDescriptor(**batch), SamplingBatch(**sampling)


def test_the_fake_runners_samples_do_not_depend_on_the_batch():
    """A row's sample is a function of its request's seed and position alone, whatever rows run beside it; the
    pending step is done at once and brings the real rows only."""
    corpus = np.arange(1000, 1100, dtype=np.int32)
    runner = FakeRunner(corpus, None, None, None, page_size=16, cache_dtype=np.dtype(np.float32))
    alone = runner.dispatch(*_step_inputs([(7, 40)], 8))
    together = runner.dispatch(*_step_inputs([(3, 500), (7, 40), (9, 12)], 8))
    assert alone.ready.done() and together.ready.done()
    assert alone.fetch().token_ids.tolist() == [[1047]]  # corpus[(7 + 40) % 100]
    assert together.fetch().token_ids.tolist() == [[1003, 1047, 1021]]
