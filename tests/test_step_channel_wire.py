"""The multi-host step channel's encoding (jaxserve/distributed/wire.py): the leader's device calls arrive equal,
arrays of every dtype the steps use and jaxserve's dataclasses included, and what a stray connection could send
(a pickle, an object array, a class from outside jaxserve) is refused without running anything."""

import pickle

import ml_dtypes
import msgspec
import numpy as np
import pytest

from jaxserve.batch.builder import BatchDescriptor, padded_batch_arrays
from jaxserve.distributed.channel import STOP
from jaxserve.distributed.wire import ARRAY, DATACLASS, WireError, decode, encode


def test_a_device_call_arrives_equal():
    batch = BatchDescriptor(**padded_batch_arrays(16, 4, 3, 16))
    weights = {"w": np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3), "s": np.float32(0.5), "n": np.asarray(7)}
    runner, method, args, kwargs = decode(encode(("runner", "dispatch", (batch,), {"weights": weights,
                                                                                  "copies": [(1, 2)]})))
    assert (runner, method, kwargs["copies"]) == ("runner", "dispatch", [[1, 2]])
    (received,) = args
    assert type(received) is BatchDescriptor
    for name, value in vars(batch).items():
        sent = np.asarray(value)
        got = np.asarray(getattr(received, name))
        assert got.dtype == sent.dtype and got.shape == sent.shape and np.array_equal(got, sent), name
    assert kwargs["weights"]["w"].dtype == ml_dtypes.bfloat16 and kwargs["weights"]["n"].shape == ()
    assert tuple(decode(encode(STOP))) == STOP


def test_what_a_stray_connection_could_send_is_refused():
    with pytest.raises(WireError, match="not a step channel message"):
        decode(pickle.dumps(("runner", "dispatch", (), {})))
    with pytest.raises(WireError, match="numeric arrays only"):
        decode(msgspec.msgpack.encode(msgspec.msgpack.Ext(ARRAY, msgspec.msgpack.encode(["object", [1], b"x" * 8]))))
    for module, name in (("os", "system"), ("subprocess", "Popen"), ("jaxserve.batch.builder", "build_batch")):
        payload = msgspec.msgpack.Ext(DATACLASS, msgspec.msgpack.encode([module, name, {}]))
        with pytest.raises(WireError, match="not a jaxserve dataclass"):
            decode(msgspec.msgpack.encode(payload))
    with pytest.raises(WireError, match="cannot send a"):
        encode(object())


def test_the_encoding_benchmark_measures_both_encodings():
    from benchmarks.step_channel_encoding import main

    result = main()
    assert set(result) == {"pickle", "msgpack"}
    assert all(figures["bytes"] > 0 and figures["encode_us"] > 0 and figures["decode_us"] > 0
               for figures in result.values())
