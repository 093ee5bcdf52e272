"""batch/packing.py: a dataclass of host arrays packed into one int32 buffer comes back field for field inside
jit, and `packed_layout` gives the buffer's length and layout without packing."""

import dataclasses

import jax
import numpy as np

from jaxserve.batch.packing import pack, packed_layout, unpack


@dataclasses.dataclass
class Fields:
    ids: np.ndarray  # (2, 3) int32
    values: np.ndarray  # (4,) float32
    flags: np.ndarray  # (3,) bool
    kinds: np.ndarray  # (2, 2) int8
    count: np.ndarray  # () int32


def _fields() -> Fields:
    return Fields(ids=np.arange(6, dtype=np.int32).reshape(2, 3) - 3, values=np.array([0.5, -1.25, np.inf, 3e-8],
                  np.float32), flags=np.array([True, False, True]), kinds=np.array([[1, -2], [127, -128]], np.int8),
                  count=np.array(7, np.int32))


def test_packed_fields_come_back_inside_jit():
    fields = _fields()
    buffer, layout = pack(fields)
    assert buffer.dtype == np.int32 and buffer.shape == (6 + 4 + 3 + 4 + 1,)
    out = jax.jit(lambda words: dataclasses.asdict(unpack(words, layout, Fields)))(buffer)
    for name, value in dataclasses.asdict(fields).items():
        assert out[name].dtype == value.dtype and out[name].shape == value.shape
        np.testing.assert_array_equal(np.asarray(out[name]), value)


def test_packed_layout_is_packs_without_the_copy():
    fields = _fields()
    buffer, layout = pack(fields)
    assert packed_layout(fields) == (buffer.size, layout)
