"""A pooling request's running pool: the sum of its pooled prompt tokens' final hidden states (a sequence
classifier's: of their class logits), added step by step as its prompt is computed (chunk by chunk, again after a
preemption by recompute), and the embedding (or the class probabilities) made from it at the end; or for a
token-wise task (vLLM's token_embed, token_classify: pooling type ALL) every prompt token's own state, each made
into its embedding (its class probabilities)."""

from __future__ import annotations

import dataclasses

import numpy as np

PER_TOKEN = "ALL"  # the pooling type of the token-wise tasks: every prompt token's state, one by one


@dataclasses.dataclass
class PooledPrompt:
    """What a pooling request has pooled so far. Its positions are pooled in order, each once."""

    pooling_type: str  # params.POOLING_TYPES, or PER_TOKEN
    normalize: bool
    dimensions: int | None  # keep the first that many values (None: all)
    # a classifier's: what turns its pooled class logits into probabilities (softmax, sigmoid or identity); None:
    # an embedding
    activation: str | None = None
    total: np.ndarray | None = None  # (H,) float32 sum of the pooled tokens' final hidden states ((labels,) logits)
    tokens: list[np.ndarray] = dataclasses.field(default_factory=list)  # PER_TOKEN: (count, H) arrays, in order
    num_pooled: int = 0  # prompt positions added to `total` (to `tokens`)

    @property
    def per_token(self) -> bool:
        """Whether every prompt token's state is kept apart (a token-wise task)."""
        return self.pooling_type == PER_TOKEN

    def positions(self, prompt_len: int) -> range:
        """The prompt positions still to pool: every one for MEAN and token-wise pooling (from the first not yet
        pooled), else the one position (the last, or the first) until it is pooled."""
        if self.pooling_type in ("MEAN", PER_TOKEN):
            return range(self.num_pooled, prompt_len)
        if self.num_pooled:
            return range(0)
        return range(prompt_len - 1, prompt_len) if self.pooling_type == "LAST" else range(1)

    @property
    def uses_every_position(self) -> bool:
        """Whether pooling needs states of positions before the last, so a cached prefix cannot be skipped."""
        return self.pooling_type != "LAST"

    def add(self, states: np.ndarray, count: int) -> None:
        """Add one step's states of the next `count` positions to pool: their sum (H,), or each apart (count, H)."""
        if self.per_token:
            self.tokens.append(np.array(states, np.float32).reshape(count, -1))
        else:
            total = states if states.ndim == 1 else states.sum(axis=0)
            self.total = total.copy() if self.total is None else self.total + total
        self.num_pooled += count

    def probs(self) -> list[float]:
        """A classifier's class probabilities: the activation of its pooled class logits (their mean for MEAN)."""
        return self._activated(self.total / max(self.num_pooled, 1)).tolist()

    def embedding(self) -> list[float]:
        """The embedding: the pooled states' mean (MEAN) or the one state, cut to `dimensions`, then L2-normalized
        when asked."""
        return self._embedded(self.total / max(self.num_pooled, 1)).tolist()

    def token_data(self) -> list[list[float]]:
        """A token-wise task's result, one entry per prompt token: its class probabilities (a classifier's) or its
        embedding."""
        states = np.concatenate(self.tokens) if self.tokens else np.zeros((0, 0), np.float32)  # (T, H)
        made = self._embedded if self.activation is None else self._activated
        return [made(state).tolist() for state in states]

    def _activated(self, logits: np.ndarray) -> np.ndarray:
        """(labels,) float32: the activation of class logits (labels,)."""
        logits = logits.astype(np.float64)
        if self.activation == "softmax":
            exp = np.exp(logits - logits.max())
            logits = exp / exp.sum()
        elif self.activation == "sigmoid":
            logits = 1.0 / (1.0 + np.exp(-logits))
        return logits.astype(np.float32)

    def _embedded(self, vector: np.ndarray) -> np.ndarray:
        """(dimensions,) float32: a state (H,) cut to `dimensions`, L2-normalized when asked."""
        if self.dimensions is not None:
            vector = vector[: self.dimensions]
        if self.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return vector.astype(np.float32)
