"""Pack a dataclass of small host arrays into one int32 buffer, so a step moves one array, not twenty.

Moving each field separately cost about 1.8 ms of Python per step (docs/benchmarks.md); one
buffer costs one transfer. The layout (field names, shapes, dtypes) is static and picks the
executable, exactly as the shapes did before.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

Layout = tuple[tuple[str, tuple[int, ...], str], ...]  # (field, shape, dtype name) in field order


def pack(obj) -> tuple[np.ndarray, Layout]:
    """Concatenate every field of a dataclass of arrays as int32 words; returns (buffer, layout)."""
    words, layout = [], []
    for field in dataclasses.fields(obj):
        value = np.asarray(getattr(obj, field.name))
        layout.append((field.name, value.shape, value.dtype.name))
        words.append(_to_words(value))
    return np.concatenate(words), tuple(layout)


def unpack(buffer: jax.Array, layout: Layout, cls):
    """Inverse of `pack` inside jit: slice, reshape and bit-cast each field back."""
    # buffer: (total words,) int32
    values, offset = {}, 0
    for name, shape, dtype in layout:
        size = math.prod(shape)
        values[name] = _from_words(buffer[offset : offset + size], np.dtype(dtype)).reshape(shape)
        offset += size
    return cls(**values)


def _to_words(value: np.ndarray) -> np.ndarray:
    if value.dtype.itemsize == 4:
        return np.ascontiguousarray(value).view(np.int32).ravel()
    return value.astype(np.int32).ravel()  # bool, int8: one word each


def _from_words(words: jax.Array, dtype: np.dtype) -> jax.Array:
    if dtype == np.bool_:
        return words != 0
    if dtype.itemsize == 4:
        return jax.lax.bitcast_convert_type(words, dtype)
    return words.astype(dtype)
