"""Scores of text pairs from their embeddings (vLLM's score and rerank APIs for embedding models): the cosine
similarity of the two texts' pooled, normalized vectors."""

from __future__ import annotations

import numpy as np


def score_pairs(num_first: int, num_second: int) -> list[tuple[int, int]]:
    """The (first, second) index pairs to score, vLLM's rule: one first text against every second text, or as
    many first texts as second ones, pair by pair; a ValueError naming what to fix otherwise."""
    if not num_first or not num_second:
        raise ValueError("scoring needs at least one text on each side")
    if num_first == 1:
        return [(0, index) for index in range(num_second)]
    if num_first != num_second:
        raise ValueError(f"give one first text, or as many first texts as second ones: got {num_first} and "
                         f"{num_second}")
    return [(index, index) for index in range(num_first)]


def cosine_scores(first: list[list[float]], second: list[list[float]], pairs: list[tuple[int, int]]) -> list[float]:
    """The cosine similarity of each pair of embeddings."""
    a = np.asarray([first[i] for i, _ in pairs], np.float64)  # (N, H)
    b = np.asarray([second[j] for _, j in pairs], np.float64)  # (N, H)
    norms = np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)  # (N,)
    return (np.sum(a * b, axis=1) / norms).tolist()
