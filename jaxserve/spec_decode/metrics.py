"""Counters of speculative decoding, under vLLM's spec_decode names."""

from __future__ import annotations


class SpecDecodeStats:
    """Proposals verified, accepted and emitted, and how often each proposal position was accepted."""

    def __init__(self, num_speculative_tokens: int):
        self.num_drafts = 0  # rows that verified at least one proposal
        self.num_draft_tokens = 0  # proposals verified
        self.num_accepted_tokens = 0  # proposals the target accepted
        self.accepted_per_position = [0] * num_speculative_tokens  # (k,) acceptances of the i-th proposal

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """One row's verification: `num_proposed` proposals, the first `num_accepted` of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def summary(self) -> dict:
        """The counters, the tokens emitted by verifying rows (accepted + one each), the mean acceptance length
        (tokens emitted per verifying row) and the acceptance rate of each position (per verifying row)."""
        drafts = max(self.num_drafts, 1)
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_emitted_tokens": self.num_accepted_tokens + self.num_drafts,
                "mean_acceptance_length": (self.num_accepted_tokens + self.num_drafts) / drafts,
                "accepted_per_position": list(self.accepted_per_position),
                "acceptance_rate_per_position": [count / drafts for count in self.accepted_per_position]}
