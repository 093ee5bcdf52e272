"""The mixture-of-experts feed-forward block of Mixtral and Qwen3-MoE as pure functions: route each token to its
top-k experts, run each expert's SwiGLU MLP on the tokens routed to it only, and combine the outputs with the
routing weights. The arithmetic follows Hugging Face (transformers 5.x `MixtralSparseMoeBlock`,
`Qwen3MoeSparseMoeBlock`), dtype casts included; see `route` and `combine`.

Weights (leading E = experts; a model stacks them per layer as (L, E, ...) and scans over L):
    router  (H, E)                       HF `mlp.gate.weight` transposed
    w_gate, w_up (E, H, I)               HF `mlp.experts.gate_up_proj` (E, 2I, H) split and transposed
    w_down  (E, I, H)                    HF `mlp.experts.down_proj` (E, H, I) transposed
Each expert weight may instead be quantized like the dense layers (model/quantize.py): {"weight": the same
shape in int8 or float8_e4m3fn, "scale": (E, out) float32}, as `quantize_weight` makes from (E, in, out), or
with an fp8 checkpoint's block-wise scales grouped, (E, in // block columns, out), sharded like the weight.

Only the routed (token, expert) pairs are computed: the T*k assignments are sorted by expert, gathered into
one row each (rows grouped by expert, `group_sizes` per expert), and a grouped matmul multiplies each group of
rows by its own expert's weights. The grouped matmul is one of two implementations with the same contract
(`grouped_matmul`, `grouped_swiglu`; `impl` overrides the choice):

- "ragged": `jax.lax.ragged_dot`. On TPU it lowers to XLA's native grouped matmul. On CPU it does not: JAX
  lowers it (lax.py `_ragged_dot_general_impl`) by masking the rows into a (G, M, K) copy and contracting
  over groups and K together, one dense (M, G*K) @ (G*K, N) matmul, so its cost is G times a dense matmul
  whatever the group sizes. Measured on a shared 2-core CPU (benchmarks/moe_step.py), M=512, K=256, N=512,
  best of 10: ragged_dot 14 ms at G=8 and 170 ms at G=64 (G full matmuls: 17 and 212 ms), the blocked
  loop below 3 and 10 ms, one (M, K) @ (K, N) 2 ms.
- "blocked": two while loops with traced trip counts: the outer one over the non-empty groups only (each
  group's weights sliced once, an int8 / fp8 weight cast once), the inner one over the group's rows in
  chunks of `block_rows` from its first row, the last chunk partial (its rows past the group are computed
  and discarded). The work is the routed rows plus fewer than b rows per non-empty group, each used
  expert's weights are sliced once, and an unused expert costs nothing, not even reading its weights.

`jax.default_backend()` picks at trace time: "ragged" on TPU, "blocked" elsewhere. GPU is not measured
here; with jaxlib 0.10 XLA:GPU's ragged_dot is reported to fall back to the same dense expansion unless
cuDNN's grouped-matmul fusion applies, so the blocked loop (one small matmul chain per used expert and
chunk; a GPU while loop also syncs its trip condition each iteration) is the default there too until a GPU
measurement says otherwise (`impl="ragged"` to try it).

Parallelism over a mesh axis (`moe_mlp_expert_parallel`): the expert weights are split on their expert
axis, tokens and router replicated; inside `jax.shard_map` every device routes all tokens, computes only
the assignments to its own experts, and the float32 partial sums are added with `psum` (each assignment
is computed on one device only, so the result equals one device's up to float32 reassociation of the k
products). Tensor parallelism within experts (`moe_mlp_tensor_parallel`: w_gate, w_up split on I, w_down
on its I rows, psum after the down projection, like the dense MLP) reuses the same code. Both shard_maps
run with check_vma=False: the blocked loop's zero-initialised carry is device-invariant while its result
varies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.model.quantize import dequantize, is_grouped, linear, quantized_spec, weight_values
from jaxserve.sharding import MODEL_AXIS

IMPLS = ("blocked", "ragged")


def route(router_logits: jax.Array, top_k: int, normalize_top_k: bool) -> tuple[jax.Array, jax.Array]:
    """Each token's top-k experts and their weights: softmax over all experts in float32, top-k, and with
    `normalize_top_k` the k weights divided by their sum (Mixtral always; Qwen3-MoE when `norm_topk_prob`).
    Ties go to the lower expert index."""
    # router_logits: (T, E) in the activations' dtype -> weights (T, k) float32, experts (T, k) int32
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # (T, E)
    weights, experts = jax.lax.top_k(probs, top_k)  # (T, k), (T, k)
    if normalize_top_k:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def combine(expert_out: jax.Array, weights: jax.Array, round_weights: bool) -> jax.Array:
    """Each token's routing-weighted sum of its k expert outputs, before the cast back to the activations'
    dtype, as HF's default experts path (`grouped_mm`) does: Mixtral's weights stay float32, so the products are
    float32; Qwen3-MoE (`round_weights`) casts the weights to the activations' dtype first, so each product is
    rounded to it; the k products are summed in float32. Assignments a device does not own are zero."""
    # expert_out: (T, k, H) activations' dtype; weights: (T, k) float32 -> (T, H) float32
    if round_weights:
        contrib = expert_out * weights.astype(expert_out.dtype)[..., None]  # (T, k, H) activations' dtype
        # XLA may keep a low-precision product in float32 when it is cast up next (excess precision): round it
        # as HF does
        info = jnp.finfo(contrib.dtype)
        contrib = jax.lax.reduce_precision(contrib, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    else:
        contrib = expert_out.astype(jnp.float32) * weights[..., None]  # (T, k, H) float32
    return jnp.sum(contrib.astype(jnp.float32), axis=1)


@dataclasses.dataclass(frozen=True)
class ExpertMLP:
    """What an expert computes: `apply(x (N, H), weights, dense) -> (N, H)` over the expert's weights (a tuple of
    arrays, each float or quantized), where `dense(x, w, bias=None)` is its matmul (one expert's in the blocked
    loop, each row's own expert's under ragged_dot); `split` says, per weight, which axis tensor parallelism within
    the experts splits: "columns" (the last: outputs) or "rows" (the one before: inputs)."""

    apply: Callable
    split: tuple[str, ...]


def _swiglu(x: jax.Array, weights: tuple, dense: Callable) -> jax.Array:
    """(silu(x @ w_gate) * (x @ w_up)) @ w_down."""
    # x: (N, H); w_gate, w_up: (H, I); w_down: (I, H) -> (N, H)
    w_gate, w_up, w_down = weights
    return dense(jax.nn.silu(dense(x, w_gate)) * dense(x, w_up), w_down)


SWIGLU = ExpertMLP(_swiglu, ("columns", "columns", "rows"))  # Mixtral's, the Qwen MoEs' experts


def clamped_swiglu(limit: float, alpha: float) -> ExpertMLP:
    """gpt-oss's experts (transformers' `GptOssExperts`): weights (w_gate_up (H, 2I) with gate and up interleaved
    by column, its bias b_gate_up (2I,), w_down (I, H)); gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate) @ w_down (the down projection's bias is added with the routing
    weights, outside the experts)."""

    def apply(x: jax.Array, weights: tuple, dense: Callable) -> jax.Array:
        # x: (N, H) -> (N, H)
        w_gate_up, b_gate_up, w_down = weights
        gate_up = dense(x, w_gate_up, b_gate_up)  # (N, 2I)
        gate, up = jnp.minimum(gate_up[:, ::2], limit), jnp.clip(gate_up[:, 1::2], -limit, limit)  # (N, I)
        return dense((up + 1) * (gate * jax.nn.sigmoid(gate * alpha)), w_down)

    return ExpertMLP(apply, ("columns", "columns", "rows"))


def _dense(x: jax.Array, w, bias: jax.Array | None = None) -> jax.Array:
    """x @ w (+ bias) for one expert's weight, float or quantized."""
    # x: (N, in); w: (in, out); bias: (out,) -> (N, out)
    out = linear(x, w)
    return out if bias is None else out + bias.astype(out.dtype)


def default_impl() -> str:
    """The grouped-matmul implementation for the current backend (see the module docstring)."""
    return "ragged" if jax.default_backend() == "tpu" else "blocked"


def default_block_rows(num_rows: int, num_groups: int) -> int:
    """Rows per block of the blocked loop: about half the mean group size, a power of two in [8, 128], so
    the partial blocks at group boundaries waste little and the matmuls stay large enough."""
    mean = max(1, num_rows // max(1, num_groups))
    return int(min(128, max(8, 1 << max(0, (mean - 1).bit_length() - 1))))


def grouped_matmul(lhs: jax.Array, rhs, group_sizes: jax.Array, *, impl: str | None = None,
                   block_rows: int | None = None) -> jax.Array:
    """lhs's rows times their group's matrix, like `jax.lax.ragged_dot`: rows sorted by group, group g
    being the next group_sizes[g] rows; rows past sum(group_sizes) come out zero. `rhs` float or quantized."""
    # lhs: (M, K); rhs: (G, K, N) or {"weight": (G, K, N), "scale": (G, N)}; group_sizes: (G,) int32 -> (M, N)
    if _check_impl(impl) == "ragged":
        return _ragged_linear(lhs, rhs, group_sizes)
    return _blocked(linear, rhs, lhs, group_sizes, block_rows)


def grouped_mlp(xs: jax.Array, group_sizes: jax.Array, weights: tuple, mlp: ExpertMLP = SWIGLU, *,
                impl: str | None = None, block_rows: int | None = None) -> jax.Array:
    """Every row's expert MLP with its group's weights, rows grouped as in `grouped_matmul`; the blocked loop does
    all of a block's matmuls in one visit."""
    # xs: (M, H) sorted by expert; group_sizes: (E,) int32; weights: each (E, ...) -> (M, H)
    if _check_impl(impl) == "ragged":
        ends = jnp.cumsum(group_sizes)  # (E,)
        row_group = jnp.minimum(jnp.searchsorted(ends, jnp.arange(xs.shape[0]), side="right"),
                                group_sizes.shape[0] - 1)  # (M,)

        def dense(x, w, bias=None):
            out = _ragged_linear(x, w, group_sizes)  # (M, out)
            return out if bias is None else out + bias[row_group].astype(out.dtype)

        return mlp.apply(xs, weights, dense)  # (M, H)
    return _blocked(lambda rows, w: mlp.apply(rows, w, _dense), weights, xs, group_sizes, block_rows)


def routed_experts(x: jax.Array, experts: jax.Array, weights: tuple, mlp: ExpertMLP = SWIGLU, *, expert_offset=0,
                   impl: str | None = None, block_rows: int | None = None) -> jax.Array:
    """Each (token, slot) assignment's expert output, computing only assignments to experts
    [expert_offset, expert_offset + E_local) (the weights held); the others are zero."""
    # x: (T, H); experts: (T, k) int32 global ids; weights: each (E_local, ...) -> (T, k, H) in x's dtype
    num_tokens, top_k = experts.shape
    num_local = jax.tree_util.tree_leaves(weights[0])[0].shape[0]
    local = experts.reshape(-1) - expert_offset  # (A,) A = T*k
    key = jnp.where((local >= 0) & (local < num_local), local, num_local)  # (A,) others sort last
    order = jnp.argsort(key, stable=True)  # (A,) assignments grouped by expert
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)  # (E_local,)
    xs = x[order // top_k]  # (A, H)
    ys = grouped_mlp(xs, group_sizes, weights, mlp, impl=impl, block_rows=block_rows)  # (A, H)
    out = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)  # (A, H) back in assignment order
    return out.reshape(num_tokens, top_k, -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """Each token's top-k experts and their weights (`route`)."""

    weights: jax.Array  # (T, k) float32
    experts: jax.Array  # (T, k) int32


def routing(x: jax.Array, router, top_k: int, normalize_top_k: bool, router_bias: jax.Array | None = None
            ) -> Routing:
    """`route` over the router's logits of x (plus gpt-oss's router bias)."""
    # x: (T, H); router: (H, E); router_bias: (E,)
    logits = linear(x, router)  # (T, E)
    if router_bias is not None:
        logits = logits + router_bias.astype(logits.dtype)
    return Routing(*route(logits, top_k, normalize_top_k))


def grouped_sigmoid_routing(x: jax.Array, router: jax.Array, score_bias: jax.Array, *, top_k: int, num_groups: int,
                            top_groups: int, normalize_top_k: bool, scale: float) -> Routing:
    """DeepSeek-V3's routing (transformers' DeepseekV3TopkRouter): sigmoid scores of the float32 router logits; the
    choice made on the scores plus the score-correction bias: the `top_groups` of `num_groups` equal expert groups
    whose two best biased scores sum highest, then the top-k experts within them; the weights are the chosen
    experts' unbiased scores, renormalised (`normalize_top_k`, norm_topk_prob) and times `scale`
    (routed_scaling_factor). Ties go to the lower index."""
    # x: (T, H); router: (H, E); score_bias: (E,) -> weights (T, k) float32, experts (T, k) int32
    scores = jax.nn.sigmoid(jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32)))  # (T, E)
    biased = scores + score_bias.astype(jnp.float32)  # (T, E)
    num_tokens, num_experts = scores.shape
    group_scores = jax.lax.top_k(biased.reshape(num_tokens, num_groups, -1), 2)[0].sum(axis=-1)  # (T, G)
    _, groups = jax.lax.top_k(group_scores, top_groups)  # (T, top_groups)
    kept = jnp.zeros((num_tokens, num_groups), bool).at[jnp.arange(num_tokens)[:, None], groups].set(True)  # (T, G)
    in_kept = jnp.repeat(kept, num_experts // num_groups, axis=1)  # (T, E)
    _, experts = jax.lax.top_k(jnp.where(in_kept, biased, -jnp.inf), top_k)  # (T, k)
    weights = jnp.take_along_axis(scores, experts, axis=1)  # (T, k)
    if normalize_top_k:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return Routing(weights * scale, experts.astype(jnp.int32))


def moe_mlp(x: jax.Array, router, *weights, top_k: int, normalize_top_k: bool, round_weights: bool = False,
            mlp: ExpertMLP = SWIGLU, router_bias: jax.Array | None = None, down_bias: jax.Array | None = None,
            impl: str | None = None, block_rows: int | None = None) -> jax.Array:
    """The MoE block on one device, computing only the routed (token, expert) pairs. Mixtral:
    normalize_top_k=True, round_weights=False; Qwen3-MoE: normalize_top_k=norm_topk_prob, round_weights=True;
    `weights` are `mlp`'s (SWIGLU: w_gate, w_up (E, H, I), w_down (E, I, H)); gpt-oss adds a router bias (E,) and
    its experts' down projection's bias (E, H)."""
    # x: (T, H); router: (H, E) -> (T, H)
    chosen = routing(x, router, top_k, normalize_top_k, router_bias)
    expert_out = routed_experts(x, chosen.experts, weights, mlp, impl=impl, block_rows=block_rows)  # (T, k, H)
    return _with_down_bias(combine(expert_out, chosen.weights, round_weights), chosen, down_bias, round_weights, x)


def moe_mlp_dense(x: jax.Array, router, *weights, top_k: int, normalize_top_k: bool, round_weights: bool = False,
                  mlp: ExpertMLP = SWIGLU, router_bias: jax.Array | None = None,
                  down_bias: jax.Array | None = None) -> jax.Array:
    """`moe_mlp` computing every expert for every token, then keeping the routed outputs: the reference."""
    # x: (T, H) -> (T, H)
    chosen = routing(x, router, top_k, normalize_top_k, router_bias)
    every = jax.vmap(lambda *expert: mlp.apply(x, expert, _dense))(*weights)  # (E, T, H)
    expert_out = every[chosen.experts, jnp.arange(x.shape[0])[:, None]]  # (T, k, H)
    return _with_down_bias(combine(expert_out, chosen.weights, round_weights), chosen, down_bias, round_weights, x)


def moe_mlp_expert_parallel(x: jax.Array, router, *weights, mesh: Mesh, top_k: int, normalize_top_k: bool,
                            round_weights: bool = False, mlp: ExpertMLP = SWIGLU,
                            router_bias: jax.Array | None = None, down_bias: jax.Array | None = None,
                            axis_name: str = MODEL_AXIS, impl: str | None = None,
                            block_rows: int | None = None) -> jax.Array:
    """`moe_mlp` with the experts split over `axis_name` (E divisible by its size): every token routed (on every
    device alike), each device computes the assignments to its E / n experts, and the float32 partial sums are
    psum'd."""
    # x: (T, H) replicated; router: (H, E) replicated; weights: each split on E -> (T, H) replicated
    return experts_expert_parallel(x, routing(x, router, top_k, normalize_top_k, router_bias), *weights, mesh=mesh,
                                   round_weights=round_weights, mlp=mlp, down_bias=down_bias, axis_name=axis_name,
                                   impl=impl, block_rows=block_rows)


def experts_expert_parallel(x: jax.Array, chosen: Routing, *weights, mesh: Mesh, round_weights: bool = False,
                            mlp: ExpertMLP = SWIGLU, down_bias: jax.Array | None = None,
                            axis_name: str = MODEL_AXIS, impl: str | None = None,
                            block_rows: int | None = None) -> jax.Array:
    """`moe_mlp_expert_parallel` after its routing (`chosen`, however the model routes)."""
    # x: (T, H) replicated; weights: each split on E -> (T, H) replicated

    def local(x, chosen, *weights):
        num_local = jax.tree_util.tree_leaves(weights[0])[0].shape[0]
        offset = jax.lax.axis_index(axis_name) * num_local  # this device's first expert
        expert_out = routed_experts(x, chosen.experts, weights, mlp, expert_offset=offset, impl=impl,
                                    block_rows=block_rows)  # (T, k, H)
        return jax.lax.psum(combine(expert_out, chosen.weights, round_weights), axis_name)  # (T, H) float32

    split = lambda w: jax.tree_util.tree_map(lambda _: P(axis_name), w)  # every leaf on its expert axis
    partial_sum = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), *map(split, weights)), out_specs=P(),
                                check_vma=False)(x, chosen, *weights)
    return _with_down_bias(partial_sum, chosen, down_bias, round_weights, x)


def moe_mlp_tensor_parallel(x: jax.Array, router, *weights, mesh: Mesh, top_k: int, normalize_top_k: bool,
                            round_weights: bool = False, mlp: ExpertMLP = SWIGLU,
                            router_bias: jax.Array | None = None, down_bias: jax.Array | None = None,
                            axis_name: str = MODEL_AXIS, impl: str | None = None,
                            block_rows: int | None = None) -> jax.Array:
    """`moe_mlp` with every expert split like the dense MLP (each weight by `mlp.split`: SWIGLU's w_gate, w_up by
    I columns, w_down by I rows): each device runs the routed block on its slice of I and the float32 partial
    sums are psum'd."""
    # x: (T, H) replicated; router: (H, E) replicated; weights: each split on I -> (T, H) replicated
    return experts_tensor_parallel(x, routing(x, router, top_k, normalize_top_k, router_bias), *weights, mesh=mesh,
                                   round_weights=round_weights, mlp=mlp, down_bias=down_bias, axis_name=axis_name,
                                   impl=impl, block_rows=block_rows)


def experts_tensor_parallel(x: jax.Array, chosen: Routing, *weights, mesh: Mesh, round_weights: bool = False,
                            mlp: ExpertMLP = SWIGLU, down_bias: jax.Array | None = None,
                            axis_name: str = MODEL_AXIS, impl: str | None = None,
                            block_rows: int | None = None) -> jax.Array:
    """`moe_mlp_tensor_parallel` after its routing (`chosen`, however the model routes)."""
    # x: (T, H) replicated; weights: each split on I -> (T, H) replicated

    def local(x, chosen, *weights):
        expert_out = routed_experts(x, chosen.experts, weights, mlp, impl=impl, block_rows=block_rows)
        return jax.lax.psum(combine(expert_out, chosen.weights, round_weights), axis_name)  # (T, H) float32

    def spec(w, split: str):  # a quantized weight's scale split as model/quantize.py splits it
        rank = (w["weight"] if isinstance(w, dict) else w).ndim
        weight_spec = P(*[None] * (rank - 1), axis_name) if split == "columns" else P(*[None] * (rank - 2),
                                                                                          axis_name, None)
        return quantized_spec(weight_spec, is_grouped(w), "zero" in w, "row_groups" in w) if isinstance(w, dict) \
            else weight_spec

    specs = (P(), P(), *(spec(w, split) for w, split in zip(weights, mlp.split)))
    partial_sum = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)(x, chosen,
                                                                                                  *weights)
    return _with_down_bias(partial_sum, chosen, down_bias, round_weights, x)


def _with_down_bias(summed: jax.Array, chosen: Routing, down_bias: jax.Array | None, round_weights: bool,
                    x: jax.Array) -> jax.Array:
    """The combined expert outputs (float32) plus each token's routing-weighted down-projection biases of its
    experts (gpt-oss), cast to x's dtype."""
    # summed: (T, H) float32; down_bias: (E, H)
    if down_bias is not None:
        summed = summed + combine(down_bias[chosen.experts].astype(x.dtype), chosen.weights, round_weights)
    return summed.astype(x.dtype)


def _check_impl(impl: str | None) -> str:
    """The implementation to use: `impl`, or the backend's default."""
    impl = impl or default_impl()
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def _ragged_linear(lhs: jax.Array, rhs, group_sizes: jax.Array) -> jax.Array:
    """`grouped_matmul` by `jax.lax.ragged_dot`; a quantized rhs is cast to lhs's dtype and each row scaled by
    its group's output-channel scales (grouped scales: the weights dequantized first, `_dequantize_operand`)."""
    # lhs: (M, K); rhs: (G, K, N) or quantized; group_sizes: (G,) int32 -> (M, N)
    rows = jnp.arange(lhs.shape[0])  # (M,)
    ends = jnp.cumsum(group_sizes)  # (G,)
    rhs = _dequantize_operand(rhs, lhs.dtype)
    if isinstance(rhs, dict):
        product = jax.lax.ragged_dot(lhs, rhs["weight"], group_sizes,
                                     preferred_element_type=jnp.float32)  # (M, N)
        row_group = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), group_sizes.shape[0] - 1)  # (M,)
        out = (product * rhs["scale"][row_group]).astype(lhs.dtype)
    else:
        out = jax.lax.ragged_dot(lhs, rhs, group_sizes)  # (M, N)
    return jnp.where((rows < ends[-1])[:, None], out, 0)  # rows past every group: zero on every backend


def _dequantize_operand(weights, dtype):
    """Quantized weights (dicts, alone or in a tuple) with their "weight" cast to `dtype`, which `linear` then
    uses as is (the scale is still applied after the matmul), or dequantized whole when their scales are
    grouped; float weights unchanged."""
    def cast(w):
        if not isinstance(w, dict):
            return w
        return dequantize(w, dtype) if is_grouped(w) else {**w, "weight": weight_values(w, dtype)}

    return tuple(map(cast, weights)) if isinstance(weights, tuple) else cast(weights)


def _blocked(apply, weights, lhs: jax.Array, group_sizes: jax.Array, block_rows: int | None) -> jax.Array:
    """apply(rows (b, K), expert g's slice of `weights`) -> (b, N) for each group's rows of lhs (sorted by
    group): an outer loop over the non-empty groups slices each group's weights once, an inner loop runs
    its rows in chunks of b (the last one partial). Rows past sum(group_sizes) are zero."""
    # lhs: (M, K); weights: a pytree of (G, ...) arrays; group_sizes: (G,) int32 -> (M, N)
    num_rows, num_groups = lhs.shape[0], group_sizes.shape[0]
    b = block_rows or default_block_rows(num_rows, num_groups)
    lhs = jnp.pad(lhs, ((0, b), (0, 0)))  # (M + b, K) so no chunk's slice is clamped
    ends = jnp.cumsum(group_sizes)  # (G,)
    starts = ends - group_sizes  # (G,)
    used = jnp.argsort(group_sizes == 0, stable=True)  # (G,) the non-empty groups first, in order

    def group_step(i, out):
        g = used[i]
        expert = jax.tree_util.tree_map(lambda w: w[g], weights)  # this group's weights, sliced once
        expert = _dequantize_operand(expert, lhs.dtype)  # int8 / fp8 cast once per group, not per chunk

        def chunk_step(j, out):
            row0 = starts[g] + j * b
            result = apply(jax.lax.dynamic_slice_in_dim(lhs, row0, b), expert)  # (b, N)
            mine = (row0 + jnp.arange(b) < ends[g])[:, None]  # (b, 1) the rows of group g
            kept = jnp.where(mine, result, jax.lax.dynamic_slice_in_dim(out, row0, b))  # (b, N)
            return jax.lax.dynamic_update_slice_in_dim(out, kept, row0, 0)

        return jax.lax.fori_loop(0, (group_sizes[g] + b - 1) // b, chunk_step, out)

    one = jax.tree_util.tree_map(lambda w: jax.ShapeDtypeStruct(w.shape[1:], w.dtype), weights)
    result = jax.eval_shape(apply, jax.ShapeDtypeStruct((b, lhs.shape[1]), lhs.dtype), one)  # (b, N)
    out = jnp.zeros((num_rows + b, result.shape[1]), result.dtype)  # (M + b, N)
    out = jax.lax.fori_loop(0, jnp.sum(group_sizes > 0), group_step, out)  # only the non-empty groups
    return out[:num_rows]
