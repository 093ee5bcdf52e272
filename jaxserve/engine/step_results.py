"""A step's device results turned into what each request gets: its sampled tokens (with their logprobs), its
prompt's logprobs, its pooled states."""

from __future__ import annotations

from jaxserve.request import Logprob
from jaxserve.runner.runner import StepOutput, TokenLogprobs
from jaxserve.spec_decode.metrics import SpecDecodeStats
from jaxserve.step import SampledToken, SchedulerOutput


def sampled_tokens(output: SchedulerOutput, result: StepOutput,
                   spec_stats: SpecDecodeStats) -> list[list[SampledToken]]:
    """Each scheduled chunk's samples, in order (none for a chunk that stops mid-prompt), with their logprobs when
    the request asked; a speculative row's accepted proposals counted in `spec_stats`."""
    sampled: list[list[SampledToken]] = []
    rows = result.token_ids.T.tolist()  # (num_seqs, S): each row's samples, as Python ints at once
    for row, item in enumerate(output.scheduled):
        if not item.samples:
            sampled.append([])
            continue
        if item.spec_token_ids:  # the accepted proposals and the token after them; -1 after
            token_ids = [t for t in rows[row][: item.num_samples] if t >= 0]
            spec_stats.observe(len(item.spec_token_ids), len(token_ids) - 1)
        else:
            token_ids = rows[row][: item.num_steps]
        num_logprobs = item.request.sampling_params.logprobs
        if num_logprobs is None:  # (multi-step decodes never have logprobs rows)
            sampled.append(list(map(SampledToken, token_ids)))
        else:
            first = row * result.logprobs_per_row
            sampled.append([SampledToken(t, _logprob_dict(result.sampled_logprobs, first + j, t, num_logprobs))
                            for j, t in enumerate(token_ids)])
    return sampled


def record_prompt_logprobs(output: SchedulerOutput, counts: list[int], scored: TokenLogprobs) -> None:
    """Append each row's newly scored prompt tokens to its request's prompt logprobs."""
    entry = 0
    for item, count in zip(output.scheduled, counts, strict=True):
        num_top = item.request.sampling_params.prompt_logprobs
        for index in range(entry, entry + count):
            target = item.request.prompt_token_ids[len(item.request.prompt_logprobs)]
            item.request.prompt_logprobs.append(_logprob_dict(scored, index, target, num_top))
        entry += count


def record_pooled(output: SchedulerOutput, spans: list[slice], pooled) -> None:
    """Add each pooling row's newly pooled positions' states to its pool: `pooled` (R, H) the rows' sums, or
    (T, H) the step tokens' states one by one (`spans`: each row's tokens)."""
    per_token = any(item.request.pooled is not None and item.request.pooled.per_token for item in output.scheduled)
    for row, (item, span) in enumerate(zip(output.scheduled, spans)):
        if span.stop > span.start:
            item.request.pooled.add(pooled[span] if per_token else pooled[row], span.stop - span.start)


def _logprob_dict(scored: TokenLogprobs, index: int, token_id: int, num_top: int) -> dict[int, Logprob]:
    """vLLM's per-token logprobs: the token itself (exact rank) plus the `num_top` most likely tokens."""
    top_ids = scored.top_token_ids[index, :num_top].tolist()
    top_lps = scored.top_logprobs[index, :num_top].tolist()
    entries = {tid: Logprob(lp, rank=rank + 1) for rank, (tid, lp) in enumerate(zip(top_ids, top_lps))}
    own = Logprob(float(scored.logprobs[index]), rank=int(scored.ranks[index]))
    return {token_id: own, **{tid: e for tid, e in entries.items() if tid != token_id}}
