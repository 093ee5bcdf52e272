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
    values = _field_arrays(obj)
    return np.concatenate([_to_words(value) for value in values]), _layout(obj, values)


def packed_layout(obj) -> tuple[int, Layout]:
    """(the number of words, the layout) of `pack(obj)`'s buffer, without copying the arrays: what an abstract
    buffer needs (the largest sampler bucket of an 8B config packs ~100 MB)."""
    values = _field_arrays(obj)
    return sum(value.size for value in values), _layout(obj, values)


def _field_arrays(obj) -> list[np.ndarray]:
    return [np.asarray(getattr(obj, field.name)) for field in dataclasses.fields(obj)]


def _layout(obj, values: list[np.ndarray]) -> Layout:
    return tuple((field.name, value.shape, value.dtype.name) for field, value in zip(dataclasses.fields(obj), values))


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
