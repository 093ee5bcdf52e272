"""What one engine step passes down the house: the scheduler's decision (plain Python, no arrays) and the tokens
the device sampled. Low in the package so the batch builder, the runner and the proposers read them without
importing the scheduler."""

from __future__ import annotations

import dataclasses

from jaxserve.request import Logprob, Request


@dataclasses.dataclass
class ScheduledRequest:
    """One request's share of a step: `num_new_tokens` tokens starting at `num_computed_tokens`. Never changed once
    made (`dataclasses.replace` makes another); not a frozen dataclass only because one's __init__ costs five
    times as much, and a step makes one per row."""

    request: Request
    num_new_tokens: int
    num_computed_tokens: int
    page_ids: tuple[int, ...]
    samples: bool  # the chunk reaches the end of the request's tokens, so its last logits sample a token
    page_copies: tuple[tuple[int, int], ...] = ()  # (source, copy) pages to copy before this step writes
    # Leading tokens of the chunk whose KV the request's pages already hold (a fork's last prompt
    # token, computed again only for its logits): the step must not write them into shared pages.
    num_present_tokens: int = 0
    sample_index: int = 0  # the output index of the token this chunk samples (when it samples)
    # Tokens the chunk samples: 1, or up to num_scheduler_steps for a decode run as several iterations in
    # one device call, each computing the token the last one sampled (pages for them all are allocated).
    num_steps: int = 1
    # Speculative decoding: proposed tokens this chunk feeds after the request's last token (they are among
    # its num_new_tokens); the step keeps those the target model accepts and samples one more, so it emits
    # between 1 and 1 + len(spec_token_ids) tokens.
    spec_token_ids: tuple[int, ...] = ()

    @property
    def num_samples(self) -> int:
        """Tokens this step may sample for the request: num_steps (or, verifying proposals, 1 + their number),
        or 0 for a chunk that stops mid-prompt."""
        return self.num_steps + len(self.spec_token_ids) if self.samples else 0

    @property
    def num_positions(self) -> int:
        """Positions whose KV this step computes: the chunk's tokens and the extra iterations' inputs."""
        return self.num_new_tokens + self.num_steps - 1


@dataclasses.dataclass
class SchedulerOutput:
    """The decision for one step: plain Python, no arrays."""

    scheduled: list[ScheduledRequest]  # in batch row order
    preempted_ids: list[str]
    # Page copies between the device pool and the host pool, made before the step runs, swap-outs first.
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (device page, host page)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (host page, device page)

    @property
    def page_copies(self) -> list[tuple[int, int]]:
        """Every (source, copy) page copy the step makes before it writes."""
        return [copy for item in self.scheduled for copy in item.page_copies]

    @property
    def total_num_tokens(self) -> int:
        """Tokens in this step before padding."""
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """True when nothing runs this step."""
        return not self.scheduled


@dataclasses.dataclass
class SampledToken:
    """What the device produced for one sampling row. Never changed once made (not frozen: see ScheduledRequest)."""

    token_id: int
    logprobs: dict[int, Logprob] | None = None
