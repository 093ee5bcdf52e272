"""The multi-host step channel's encoding (jaxserve/distributed/wire.py) against the pickles it replaced: bytes and
microseconds to encode and decode one `dispatch` call of a 256-token, 64-row step (best of 5 rounds of 2000).

    python -m benchmarks.step_channel_encoding
"""

from __future__ import annotations

import pickle
import time

from jaxserve.batch.builder import BatchDescriptor, padded_batch_arrays
from jaxserve.distributed.wire import decode, encode


def best_us(function, repeats: int = 2000, rounds: int = 5) -> float:
    """The best round's mean microseconds per call of `function`."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            function()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e6


def main() -> dict:
    """Measure both encodings side by side; print and return the figures."""
    message = ("runner", "dispatch", (BatchDescriptor(**padded_batch_arrays(256, 64, 16, 16)),), {})
    pickled, packed = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), encode(message)
    result = {
        "pickle": {"bytes": len(pickled), "encode_us": best_us(lambda: pickle.dumps(message, pickle.HIGHEST_PROTOCOL)),
                   "decode_us": best_us(lambda: pickle.loads(pickled))},
        "msgpack": {"bytes": len(packed), "encode_us": best_us(lambda: encode(message)),
                    "decode_us": best_us(lambda: decode(packed))},
    }
    for name, figures in result.items():
        print(f"{name}: {figures['bytes']} bytes, encode {figures['encode_us']:.1f} us, "
              f"decode {figures['decode_us']:.1f} us")
    return result


if __name__ == "__main__":
    main()
