"""The mixture-of-experts block on the CPU: routed (only the top-k experts' rows) against dense (every expert
for every token), and `jax.lax.ragged_dot` against plain matmuls.

    python benchmarks/moe_step.py
    python benchmarks/moe_step.py --experts 8,32 --tokens 16,256 --runs 20 --ragged

Layer stack: `--layers` MoE layers (H=256, I=512, top-2 by default, float32), each `x = x + moe(x / rms(x))`,
stacked weights scanned over like the engine's decoder. Each variant is one jitted function; after the same
warm-up calls, the variants' timed calls alternate (routed, dense, routed, ...) so a slow spell of a shared
machine hits both. Reports mean and best ms per step and dense / routed.

ragged_dot section: one (M, K) @ (G, K, N) grouped matmul (M=512, K=256, N=512, equal groups) by
`jax.lax.ragged_dot`, by the module's blocked loop (`grouped_matmul(impl="blocked")`), by one batched
matmul of the groups (the grouped optimum on this backend), by G full (M, K) @ (K, N) matmuls (what a
dense-expanded ragged_dot costs), and the single (M, K) @ (K, N) matmul.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model import moe


def make_stack(rng: np.random.Generator, layers: int, hidden: int, inner: int, experts: int, dtype) -> dict:
    """Random stacked weights: router (L, H, E), w_gate, w_up (L, E, H, I), w_down (L, E, I, H)."""
    def normal(*shape, scale):
        return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32), dtype)

    return {"router": normal(layers, hidden, experts, scale=1.0 / np.sqrt(hidden)),
            "w_gate": normal(layers, experts, hidden, inner, scale=1.0 / np.sqrt(hidden)),
            "w_up": normal(layers, experts, hidden, inner, scale=1.0 / np.sqrt(hidden)),
            "w_down": normal(layers, experts, inner, hidden, scale=1.0 / np.sqrt(inner))}


def make_step(block, top_k: int):
    """A jitted pass through the layer stack with `block` (moe_mlp or moe_mlp_dense) as each layer's MLP."""
    def step(stack, x):
        def layer(x, w):
            h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)  # (T, H)
            out = block(h, w["router"], w["w_gate"], w["w_up"], w["w_down"], top_k=top_k, normalize_top_k=True)
            return x + out, None

        return jax.lax.scan(layer, x, stack)[0]  # (T, H)

    return jax.jit(step)


def time_alternating(calls: dict, warmup: int, runs: int) -> dict:
    """{name: (mean ms, best ms)} of zero-argument calls, warmed up alike, the timed calls interleaved."""
    for call in calls.values():
        for _ in range(warmup):
            jax.block_until_ready(call())
    times = {name: [] for name in calls}
    for _ in range(runs):
        for name, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: (float(np.mean(t)), float(np.min(t))) for name, t in times.items()}


def layer_table(args) -> list[str]:
    """Markdown rows: routed vs dense (and ragged) for each (E, T)."""
    dtype = jnp.dtype(args.dtype)
    rows = []
    for experts in args.experts:
        stack = make_stack(np.random.default_rng(0), args.layers, args.hidden, args.inner, experts, dtype)
        steps = {"routed": make_step(moe.moe_mlp, args.top_k), "dense": make_step(moe.moe_mlp_dense, args.top_k)}
        if args.ragged:
            ragged = lambda *a, **k: moe.moe_mlp(*a, impl="ragged", **k)
            steps["ragged"] = make_step(ragged, args.top_k)
        for tokens in args.tokens:
            x = jnp.asarray(np.random.default_rng(tokens).standard_normal((tokens, args.hidden)), dtype)
            outs = {name: step(stack, x) for name, step in steps.items()}
            diff = max(float(jnp.max(jnp.abs(o.astype(jnp.float32) - outs["dense"].astype(jnp.float32))))
                       for o in outs.values())
            timed = time_alternating({name: (lambda s=step: s(stack, x)) for name, step in steps.items()},
                                     args.warmup, args.runs)
            (r_mean, r_best), (d_mean, d_best) = timed["routed"], timed["dense"]
            cells = [f"{experts}", f"{tokens}", f"{r_mean:.2f}", f"{r_best:.2f}", f"{d_mean:.2f}",
                     f"{d_best:.2f}", f"{d_mean / r_mean:.2f}x", f"{d_best / r_best:.2f}x"]
            if args.ragged:
                cells += [f"{timed['ragged'][0]:.2f}", f"{timed['ragged'][1]:.2f}"]
            rows.append("| " + " | ".join(cells + [f"{diff:.1e}"]) + " |")
    head = ["E", "T", "routed mean", "routed best", "dense mean", "dense best", "dense/routed mean",
            "dense/routed best"] + (["ragged mean", "ragged best"] if args.ragged else []) + ["max abs diff"]
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + rows


def ragged_dot_table(args) -> list[str]:
    """Markdown rows: the grouped matmul by each method, per group count."""
    m, k, n = 512, 256, 512
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))  # (M, K)
    rows = ["| G | ragged_dot mean | ragged_dot best | blocked mean | blocked best | batched groups best "
            "| G full matmuls best | one (M,K)@(K,N) best |", "|" + "---|" * 8]
    for groups in (8, 64):
        rhs = jnp.asarray(rng.standard_normal((groups, k, n)).astype(np.float32))  # (G, K, N)
        sizes = jnp.full((groups,), m // groups, jnp.int32)  # (G,)
        jitted = {
            "ragged_dot": (jax.jit(jax.lax.ragged_dot), (lhs, rhs, sizes)),
            "blocked": (jax.jit(lambda *a: moe.grouped_matmul(*a, impl="blocked")), (lhs, rhs, sizes)),
            "batched": (jax.jit(lambda a, b: jnp.einsum("gmk,gkn->gmn", a.reshape(groups, -1, k), b)),
                        (lhs, rhs)),
            "full": (jax.jit(lambda a, b: jnp.einsum("mk,gkn->gmn", a, b)), (lhs, rhs)),
            "one": (jax.jit(jnp.matmul), (lhs, rhs[0])),
        }
        calls = {name: (lambda f=f, a=a: f(*a)) for name, (f, a) in jitted.items()}
        timed = time_alternating(calls, args.warmup, max(3, args.runs // 2))
        rows.append(f"| {groups} | {timed['ragged_dot'][0]:.2f} | {timed['ragged_dot'][1]:.2f} | "
                    f"{timed['blocked'][0]:.2f} | {timed['blocked'][1]:.2f} | {timed['batched'][1]:.2f} | "
                    f"{timed['full'][1]:.2f} | {timed['one'][1]:.2f} |")
    return rows


def main() -> None:
    """Time both tables and print them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda text: [int(v) for v in text.split(",")]
    parser.add_argument("--experts", type=ints, default=[8, 32], help="comma list of expert counts E")
    parser.add_argument("--tokens", type=ints, default=[16, 256], help="comma list of step token counts T")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inner", type=int, default=512, help="each expert's intermediate size I")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--ragged", action="store_true", help="also time the layers with impl='ragged'")
    parser.add_argument("--skip-ragged-dot", action="store_true", help="skip the ragged_dot table")
    args = parser.parse_args()
    print(f"backend {jax.default_backend()}, jax {jax.__version__}, {args.layers} layers, H={args.hidden}, "
          f"I={args.inner}, top-{args.top_k}, {args.dtype}; ms per step, {args.runs} timed runs after "
          f"{args.warmup} warm-up\n")
    print("\n".join(layer_table(args)))
    if not args.skip_ragged_dot:
        print(f"\nGrouped matmul M=512, K=256, N=512, equal groups (ms; {max(3, args.runs // 2)} timed runs):\n")
        print("\n".join(ragged_dot_table(args)))


if __name__ == "__main__":
    main()
