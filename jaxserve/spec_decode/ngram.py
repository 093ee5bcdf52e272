"""The n-gram proposer (prompt lookup): guess a request's next tokens from its own prompt and output.

For n from `max_n` down to `min_n`, find the latest earlier place where the sequence's last n tokens
occur, and propose the tokens that followed them there. Host-side numpy; never imports jax.
"""

from __future__ import annotations

import numpy as np

from jaxserve.request import Request


class NgramProposer:
    """Proposes up to `num_tokens` tokens per request by prompt lookup (vLLM's `prompt_lookup_min/max`)."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt_lookup_min ({min_n}) must be >= 1 and <= prompt_lookup_max ({max_n})")
        self.num_tokens = num_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: list[Request]) -> list[list[int]]:
        """Each request's guess (possibly empty), from the tokens the host has."""
        return [propose_ngram(np.asarray(r.token_ids(0, r.num_known_tokens), np.int64), self.num_tokens,
                              self.min_n, self.max_n) for r in requests]

    def release(self, request_id: str) -> None:
        """Nothing to forget: the n-gram proposer keeps no state per request."""


def propose_ngram(tokens: np.ndarray, num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """The up to `num_tokens` tokens that followed the latest earlier occurrence of the last n tokens of
    `tokens` (the longest n in [min_n, max_n] that occurs); [] when none does."""
    # tokens: (L,) int64 the sequence so far
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # (L - n, n) earlier n-grams
        matches = np.flatnonzero(np.all(windows == tokens[length - n :], axis=1))  # starts of earlier matches
        if len(matches):
            start = matches[-1] + n  # the token after the latest match
            return tokens[start : start + num_tokens].tolist()
    return []
