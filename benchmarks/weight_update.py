"""What new weights cost a running engine: `update_weights` against starting an engine on them (the restart an RL
loop would do otherwise).

    PYTHONPATH=. python benchmarks/weight_update.py [--model-shape llama-small] [--repeats 5]

Two weight sets of one model: the shape's generated folder and a copy with every tensor perturbed. Timed, each
until the engine can serve the new weights (params on the devices):
- `update_weights(folder)`: a running engine reads the other set from its safetensors folder;
- `update_weights(arrays)`: the same from numpy arrays in memory (what a trainer in the same process hands over);
- `restart`: the old engine dropped and an `LLM` started on the other folder (weights, KV pool, executables from
  the warm compilation cache: one warm-up start fills it);
- `sleep(L) + update_weights(arrays) + wake_up`: an RL loop that lends the devices to a trainer: the engine frees
  its KV pool and weights (level 1: kept in host memory; level 2: discarded), takes the new weights while asleep
  and reads them at the wake-up, with a zeroed KV pool (sleep mode).
The sets alternate, so every timed call changes the weights; one warm-up round, then --repeats rounds in an order
that alternates between rounds. Reported: mean and best seconds, and each against the restart's. Afterwards the
updated engine's greedy tokens are checked against a fresh engine's on the same weights.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import jax  # noqa: E402
import numpy as np  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.bench.models import SHAPE_NAMES, ensure_model  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def tensors_of(folder: str) -> dict[str, np.ndarray]:
    """Every tensor of a folder's safetensors files."""
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def perturbed_copy(source: str, destination: str) -> None:
    """`source` copied to `destination` with noise of 0.05 added to every tensor (one file)."""
    shutil.copytree(source, destination, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    rng = np.random.default_rng(1)
    save_file({name: (t + 0.05 * rng.standard_normal(t.shape)).astype(t.dtype)
               for name, t in tensors_of(source).items()}, os.path.join(destination, "model.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", choices=SHAPE_NAMES, default="llama-small")
    parser.add_argument("--cache-dir", default="/tmp/jaxserve-bench")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    first = ensure_model(args.model_shape, args.cache_dir)
    options = dict(show_progress=False, compilation_cache_dir=os.path.join(args.cache_dir, "xla-cache"),
                   enable_sleep_mode=True)
    with tempfile.TemporaryDirectory() as scratch:
        second = os.path.join(scratch, "second")
        perturbed_copy(first, second)
        folders, arrays = [first, second], [tensors_of(first), tensors_of(second)]
        engine = {"llm": LLM(first, **options)}
        turn = [0]  # the set the engine serves

        def update(source_of) -> None:
            turn[0] = 1 - turn[0]
            engine["llm"].update_weights(source_of(turn[0]))
            jax.block_until_ready(engine["llm"].engine.core.runner.params)

        def sleep_update_wake(level: int) -> None:
            turn[0] = 1 - turn[0]
            llm = engine["llm"]
            llm.sleep(level)
            llm.update_weights(arrays[turn[0]])
            llm.wake_up()
            jax.block_until_ready((llm.engine.core.runner.params, llm.engine.core.runner.kv_caches))

        def restart() -> None:
            turn[0] = 1 - turn[0]
            del engine["llm"]
            engine["llm"] = LLM(folders[turn[0]], **options)

        settings = {"update_weights(folder)": lambda: update(folders.__getitem__),
                    "update_weights(arrays)": lambda: update(arrays.__getitem__),
                    "sleep(1) + update_weights(arrays) + wake_up": lambda: sleep_update_wake(1),
                    "sleep(2) + update_weights(arrays) + wake_up": lambda: sleep_update_wake(2), "restart": restart}
        seconds: dict[str, list[float]] = {name: [] for name in settings}
        order = list(settings)
        for round_index in range(args.repeats + 1):
            for name in order if round_index % 2 else order[::-1]:
                started = time.perf_counter()
                settings[name]()
                if round_index:  # round 0 warms up
                    seconds[name].append(time.perf_counter() - started)
        engine["llm"].update_weights(second)
        updated = [o.outputs[0].token_ids for o in engine["llm"].generate(["def f(x):"], GREEDY, use_tqdm=False)]
        del engine["llm"]
        fresh = [o.outputs[0].token_ids for o in LLM(second, **options).generate(["def f(x):"], GREEDY,
                                                                                   use_tqdm=False)]
    assert updated == fresh, "the updated engine's tokens differ from a fresh engine's on the same weights"
    megabytes = sum(t.nbytes for t in arrays[0].values()) / 2**20
    restart_mean, restart_best = statistics.mean(seconds["restart"]), min(seconds["restart"])
    print(f"{args.model_shape} ({megabytes:.1f} MiB of weights), {args.repeats} rounds; greedy tokens after an update "
          "equal a fresh engine's")
    print("| how | mean s | best s | against restart, mean (best) |")
    print("|---|---:|---:|---|")
    for name, runs in seconds.items():
        mean, best = statistics.mean(runs), min(runs)
        print(f"| {name} | {mean:.3f} | {best:.3f} | {mean / restart_mean:.3f}x ({best / restart_best:.3f}x) |")


if __name__ == "__main__":
    main()
