"""A pooling request's running pool: the sum of its pooled prompt tokens' final hidden states (a sequence
classifier's: of their class logits), added step by step as its prompt is computed (chunk by chunk, again after a
preemption by recompute), and the embedding (or the class probabilities) made from it at the end."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class PooledPrompt:
    """What a pooling request has pooled so far. Its positions are pooled in order, each once."""

    pooling_type: str  # params.POOLING_TYPES
    normalize: bool
    dimensions: int | None  # keep the first that many values (None: all)
    # a classifier's: what turns its pooled class logits into probabilities (softmax, sigmoid or identity); None:
    # an embedding
    activation: str | None = None
    total: np.ndarray | None = None  # (H,) float32 sum of the pooled tokens' final hidden states ((labels,) logits)
    num_pooled: int = 0  # prompt positions added to `total`

    def positions(self, prompt_len: int) -> range:
        """The prompt positions still to pool: every one for MEAN (from the first not yet pooled), else the one
        position (the last, or the first) until it is pooled."""
        if self.pooling_type == "MEAN":
            return range(self.num_pooled, prompt_len)
        if self.num_pooled:
            return range(0)
        return range(prompt_len - 1, prompt_len) if self.pooling_type == "LAST" else range(1)

    @property
    def uses_every_position(self) -> bool:
        """Whether pooling needs states of positions before the last, so a cached prefix cannot be skipped."""
        return self.pooling_type != "LAST"

    def add(self, total: np.ndarray, count: int) -> None:
        """Add one step's sum (H,) of the states of the next `count` positions to pool."""
        self.total = total.copy() if self.total is None else self.total + total
        self.num_pooled += count

    def probs(self) -> list[float]:
        """A classifier's class probabilities: the activation of its pooled class logits (their mean for MEAN)."""
        logits = (self.total / max(self.num_pooled, 1)).astype(np.float64)  # (labels,)
        if self.activation == "softmax":
            exp = np.exp(logits - logits.max())
            logits = exp / exp.sum()
        elif self.activation == "sigmoid":
            logits = 1.0 / (1.0 + np.exp(-logits))
        return logits.astype(np.float32).tolist()

    def embedding(self) -> list[float]:
        """The embedding: the pooled states' mean (MEAN) or the one state, cut to `dimensions`, then L2-normalized
        when asked."""
        vector = self.total / max(self.num_pooled, 1)  # (H,) float32
        if self.dimensions is not None:
            vector = vector[: self.dimensions]
        if self.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return vector.astype(np.float32).tolist()
