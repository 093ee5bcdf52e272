"""The step channel's encoding (distributed/channel.py): MessagePack (msgspec) with numpy arrays and jaxserve's own
dataclasses as extension types. Decoding runs no code from the wire, where a pickle would run whatever it names: an
array is rebuilt from its dtype name, shape and bytes (numeric dtypes only), a dataclass is one of jaxserve's modules
already imported, its fields set without calling its constructor; anything else is refused.
"""

from __future__ import annotations

import dataclasses
import sys

import msgspec
import numpy as np

ARRAY, DATACLASS = 1, 2  # the extension types' codes
_NUMERIC_KINDS = frozenset("biufcV")  # bool, ints, unsigned, floats, complex, and ml_dtypes' (bfloat16, float8: V)
_ENCODER = msgspec.msgpack.Encoder()


class WireError(ValueError):
    """A message that cannot be sent, or one received that is not a step channel message."""


def encode(message: object) -> bytes:
    """`message` (tuples, lists, dicts, scalars, strings, numpy or jax arrays, jaxserve dataclasses) as bytes."""
    return _ENCODER.encode(_to_wire(message))


def decode(payload: bytes) -> object:
    """A message from `encode` (tuples come back as lists); WireError for anything else."""
    try:
        return _DECODER.decode(payload)
    except msgspec.DecodeError as error:
        raise WireError(f"not a step channel message: {error}") from error


def _to_wire(value: object) -> object:
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (list, tuple)):
        return [_to_wire(item) for item in value]
    if isinstance(value, dict):
        return {key: _to_wire(item) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        fields = {field.name: _to_wire(getattr(value, field.name)) for field in dataclasses.fields(value)}
        return msgspec.msgpack.Ext(DATACLASS, _ENCODER.encode([cls.__module__, cls.__qualname__, fields]))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) or hasattr(value, "__array__"):
        array = np.asarray(value)  # (tobytes is C order; ascontiguousarray would make a 0-d array 1-d)
        if array.dtype.kind not in _NUMERIC_KINDS:
            raise WireError(f"cannot send an array of {array.dtype} over the step channel")
        return msgspec.msgpack.Ext(ARRAY, _ENCODER.encode([array.dtype.name, list(array.shape), array.tobytes()]))
    raise WireError(f"cannot send a {type(value).__name__} over the step channel")


def _from_ext(code: int, data: memoryview) -> object:
    if code == ARRAY:
        dtype_name, shape, raw = _DECODER.decode(data)
        dtype = np.dtype(dtype_name)
        if dtype.kind not in _NUMERIC_KINDS:
            raise WireError(f"the step channel carries numeric arrays only, not {dtype}")
        return np.frombuffer(raw, dtype).reshape(shape).copy()
    if code == DATACLASS:
        module_name, qualname, fields = _DECODER.decode(data)
        cls = _dataclass(module_name, qualname)
        value = cls.__new__(cls)
        known = {field.name for field in dataclasses.fields(cls)}
        if set(fields) != known:
            raise WireError(f"{qualname} carries fields {sorted(fields)}, not {sorted(known)}")
        for name, field_value in fields.items():
            object.__setattr__(value, name, field_value)
        return value
    raise WireError(f"unknown extension type {code} on the step channel")


def _dataclass(module_name: str, qualname: str) -> type:
    """The dataclass `qualname` of the jaxserve module `module_name`, if that module is imported (nothing is
    imported here)."""
    module = sys.modules.get(module_name) if module_name.split(".")[0] == "jaxserve" else None
    cls = module
    for part in qualname.split(".") if module is not None else ():
        cls = getattr(cls, part, None)
    if not isinstance(cls, type) or not dataclasses.is_dataclass(cls):
        raise WireError(f"{module_name}.{qualname} is not a jaxserve dataclass")
    return cls


_DECODER = msgspec.msgpack.Decoder(ext_hook=_from_ext)
