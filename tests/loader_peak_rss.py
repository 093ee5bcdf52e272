"""Peak host memory of load_params, run as its own process: `python loader_peak_rss.py FOLDER`.

It loads FOLDER once and keeps those params (so the CPU backend, the imports and the jit caches for these shapes
are in place, and the second load cannot reuse their memory), resets the kernel's peak-RSS mark, loads FOLDER
again in float32 on one CPU device and prints JSON: the RSS growth at the peak and the params' bytes (on the CPU
the loaded params are host memory too). The warm-up must have the measured shapes: a load that compiles its
stacking updates counts XLA's compile memory (20-40 MiB here, more on a loaded machine) as the loader's."""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxserve.model.loader import load_params  # noqa: E402
from jaxserve.sharding import cache_kv_heads, make_mesh  # noqa: E402
from jaxserve.model.registry import load_model_spec  # noqa: E402


def _status_bytes(key: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _load(folder: str) -> dict:
    spec = load_model_spec(folder)
    return jax.block_until_ready(load_params(folder, spec, make_mesh(1), jnp.float32, cache_kv_heads(spec, 1)))


def main(folder: str) -> None:
    """Print {"peak_growth": bytes, "params": bytes} for loading `folder` a second time."""
    warm = _load(folder)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    before = _status_bytes("VmRSS")
    params = _load(folder)
    peak = _status_bytes("VmHWM")
    del warm  # alive until here: the measured load must not reuse its memory
    print(json.dumps({"peak_growth": peak - before,
                      "params": sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params))}))


if __name__ == "__main__":
    main(*sys.argv[1:])
