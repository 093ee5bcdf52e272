"""The interface between the scheduler and a proposer of speculative tokens."""

from __future__ import annotations

from typing import Protocol

from jaxserve.request import Request


class Proposer(Protocol):
    """Guesses the tokens that follow each request's known tokens.

    The scheduler calls `propose` for a step's decodes that can verify proposals, when the step leaves budget
    for them (the host holds every token: speculative steps are brought before the next is planned), and
    `release` when a request leaves the running batch (finished or preempted), so a proposer with per-request
    state (the draft model's KV pages) gives it back."""

    def propose(self, requests: list[Request]) -> list[list[int]]:
        """Each request's guess of its next tokens, in order (possibly empty; at most the configured number)."""

    def release(self, request_id: str) -> None:
        """Forget a request (its state, its pages); a no-op for one the proposer does not know."""
