"""The mixture-of-experts block (jaxserve/model/moe.py): routing against numpy transcriptions of Hugging Face's
Mixtral and Qwen3-MoE formulas, the routed block against the all-experts reference and a numpy HF block, the
grouped matmul against `jax.lax.ragged_dot`, quantized experts, expert and tensor parallelism on 2 of the 4
virtual CPU devices, and one compilation for every routing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.model import moe
from jaxserve.model import quantize
from jaxserve.sharding import MODEL_AXIS

H, I = 32, 48  # hidden and expert intermediate sizes of every test
T, E = 37, 8  # the common layer shape, so that tests share compilations
OPTIONS = ("top_k", "normalize_top_k", "round_weights", "impl", "block_rows")
_routed = jax.jit(moe.moe_mlp, static_argnames=OPTIONS)
_dense = jax.jit(moe.moe_mlp_dense, static_argnames=OPTIONS[:3])


def routed(*layer, top_k, normalize_top_k, round_weights=False, impl=None, block_rows=None):
    """moe_mlp jitted; every option passed on, so that calls with equal options share one executable."""
    return _routed(*layer, top_k=top_k, normalize_top_k=normalize_top_k, round_weights=round_weights, impl=impl,
                   block_rows=block_rows)


def dense(*layer, top_k, normalize_top_k, round_weights=False):
    """moe_mlp_dense jitted, likewise."""
    return _dense(*layer, top_k=top_k, normalize_top_k=normalize_top_k, round_weights=round_weights)


route = jax.jit(moe.route, static_argnums=(1, 2))
quantize_weight = jax.jit(quantize.quantize_weight, static_argnums=1)
dequantize = jax.jit(quantize.dequantize, static_argnums=1)


def make_layer(rng, num_tokens, num_experts, dtype=jnp.float32, skew_to=None, unused=None):
    """Random x (T, H), router (H, E), w_gate, w_up (E, H, I), w_down (E, I, H); with `skew_to`, every token's
    first choice is that expert; with `unused`, no token picks that expert and its w_gate is NaN."""
    x = rng.standard_normal((num_tokens, H)).astype(np.float32)
    router = rng.standard_normal((H, num_experts)).astype(np.float32)
    if skew_to is not None:
        x = np.abs(x)
        router[:, skew_to] = 5.0
    w_gate = rng.standard_normal((num_experts, H, I)).astype(np.float32) / np.sqrt(H)
    w_up = rng.standard_normal((num_experts, H, I)).astype(np.float32) / np.sqrt(H)
    w_down = rng.standard_normal((num_experts, I, H)).astype(np.float32) / np.sqrt(I)
    if unused is not None:
        router[:, unused] = -50.0
        w_gate[unused] = np.nan
    return tuple(jax.device_put(a.astype(dtype)) for a in (x, router, w_gate, w_up, w_down))  # cast on the host


def softmax32(logits):
    """float32 softmax over the last axis."""
    z = logits.astype(np.float32) - logits.astype(np.float32).max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def hf_router(logits, top_k, family, norm_topk_prob=True):
    """MixtralTopKRouter / Qwen3MoeTopKRouter in numpy: softmax in float32, top-k (ties to the lower index),
    Mixtral always renormalises, Qwen3-MoE when norm_topk_prob; weights float32, experts int."""
    probs = softmax32(np.asarray(logits, np.float32))  # (T, E)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]  # (T, k)
    weights = np.take_along_axis(probs, experts, -1)  # (T, k)
    if family == "mixtral" or norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, experts


def hf_block(x, router, w_gate, w_up, w_down, top_k, family, norm_topk_prob=True):
    """The HF experts loop in float32 numpy: each expert's tokens through its SwiGLU, scaled by the routing
    weight, accumulated per token."""
    x, router, w_gate, w_up, w_down = (np.asarray(a, np.float32) for a in (x, router, w_gate, w_up, w_down))
    weights, experts = hf_router(x @ router, top_k, family, norm_topk_prob)
    out = np.zeros_like(x)
    for e in range(w_gate.shape[0]):
        tokens, slots = np.nonzero(experts == e)
        gate = x[tokens] @ w_gate[e]
        hidden = gate / (1 + np.exp(-gate)) * (x[tokens] @ w_up[e])
        np.add.at(out, tokens, (hidden @ w_down[e]) * weights[tokens, slots, None])
    return out


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_route_matches_hf_routers(top_k):
    rng = np.random.default_rng(top_k)
    logits = rng.standard_normal((9, 8)).astype(np.float32) * 3
    logits[0, [1, 5, 6]] = logits[0].max() + 1  # a tie: the lower expert index wins, as in HF's topk order
    variants = [("mixtral", True, True), ("qwen3_moe", True, True), ("qwen3_moe", False, False)]
    for family, norm, normalize in variants:
        ref_weights, ref_experts = hf_router(logits, top_k, family, norm)
        weights, experts = route(jax.device_put(logits), top_k, normalize)
        assert weights.dtype == jnp.float32 and experts.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(experts), ref_experts)
        np.testing.assert_allclose(np.asarray(weights), ref_weights, rtol=1e-6, atol=1e-7)
    bf16 = route(jax.device_put(logits.astype(jnp.bfloat16)), top_k, True)[0]  # logits in the activations' dtype
    assert bf16.dtype == jnp.float32


def test_combine_follows_hf_casts():
    """Mixtral multiplies in float32; Qwen3-MoE rounds the weights to the activations' dtype first; the k
    products are summed in float32."""
    out = np.asarray([[[1.0], [3.0]]], jnp.bfloat16)  # (T=1, k=2, H=1)
    weights = np.asarray([[0.3, 0.7]], np.float32)  # (T, k)
    combine = jax.jit(moe.combine, static_argnums=2)
    mixtral = combine(jax.device_put(out), jax.device_put(weights), False)
    np.testing.assert_allclose(mixtral, [[0.3 + 2.1]], rtol=1e-7)
    rounded = (out * weights.astype(jnp.bfloat16)[..., None]).astype(np.float32).sum(1)  # numpy: bf16 products
    np.testing.assert_array_equal(combine(jax.device_put(out), jax.device_put(weights), True), rounded)
    assert mixtral.dtype == jnp.float32 and rounded[0, 0] != np.float32(0.3 + 2.1)


FAMILIES = {  # HF block -> (normalize_top_k, round_weights)
    "mixtral": (True, False),
    "qwen3_moe": (False, True),  # norm_topk_prob false
    "qwen3_moe_norm": (True, True),  # norm_topk_prob true
}
CASES = [  # (T, E, top_k, dtype, impl, block_rows, family); impl None is the backend's default ("blocked" on CPU)
    (1, 4, 1, jnp.bfloat16, None, None, "qwen3_moe_norm"),
    (13, 4, 2, jnp.float32, None, 8, "qwen3_moe"),  # T not a multiple of the block
    (T, E, 2, jnp.float32, None, None, "mixtral"),
    (T, E, 2, jnp.bfloat16, None, 16, "qwen3_moe_norm"),
    (64, E, 1, jnp.float32, None, 8, "mixtral"),  # skewed: all 64 tokens in one group, 8 chunks
    (T, E, 2, jnp.float32, "ragged", None, "qwen3_moe"),
]


@pytest.mark.parametrize("num_tokens,num_experts,top_k,dtype,impl,block_rows,family", CASES)
def test_routed_matches_dense_and_hf(num_tokens, num_experts, top_k, dtype, impl, block_rows, family):
    """The routed block against the all-experts one on a spread and a skewed routing, and in float32 against
    the numpy HF experts loop."""
    normalize, round_weights = FAMILIES[family]
    options = dict(top_k=top_k, normalize_top_k=normalize, round_weights=round_weights)
    for skew_to in (None, num_experts - 1):  # spread; every token's first choice the last expert
        layer = make_layer(np.random.default_rng(num_tokens), num_tokens, num_experts, dtype, skew_to)
        out = routed(*layer, impl=impl, block_rows=block_rows, **options)
        assert out.shape == (num_tokens, H) and out.dtype == dtype
        if skew_to is not None:
            logits = np.asarray(layer[0], np.float32) @ np.asarray(layer[1], np.float32)  # (T, E)
            assert np.all(logits.argmax(-1) == skew_to)
        tol = 1e-5 if dtype == jnp.float32 else 2e-2
        ref = dense(*layer, **options)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol)
        if dtype == jnp.float32:
            hf = hf_block(*layer, top_k=top_k, family=family.removesuffix("_norm"), norm_topk_prob=normalize)
            np.testing.assert_allclose(np.asarray(out), hf, rtol=1e-5, atol=1e-5)


def test_blocked_grouped_matmul_matches_ragged_dot():
    rng = np.random.default_rng(7)
    lhs = jax.device_put(rng.standard_normal((50, H)).astype(np.float32))  # (M, K)
    rhs = jax.device_put(rng.standard_normal((6, H, 24)).astype(np.float32))  # (G, K, N)
    grouped = jax.jit(lambda *a: moe.grouped_matmul(*a, impl="blocked", block_rows=8))
    ragged_dot = jax.jit(jax.lax.ragged_dot)
    for sizes in ([10, 0, 20, 5, 0, 7], [50, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]):
        group_sizes = jax.device_put(np.asarray(sizes, np.int32))  # sum <= M: the rows past it come out zero
        out = grouped(lhs, rhs, group_sizes)
        np.testing.assert_allclose(out, ragged_dot(lhs, rhs, group_sizes), rtol=1e-5, atol=1e-5)
        assert not np.any(np.asarray(out)[sum(sizes):])


def test_unused_experts_are_never_multiplied():
    """An expert no token picks may hold NaNs: the blocked loop never touches it (ragged_dot's dense CPU
    expansion would: 0 * NaN)."""
    layer = make_layer(np.random.default_rng(3), T, E, skew_to=1, unused=3)  # expert 3: never chosen, NaN
    out = routed(*layer, top_k=2, normalize_top_k=True, round_weights=False)
    assert np.all(np.isfinite(np.asarray(out)))


def partly_quantized(weights):
    """w_gate int8, w_up float, w_down fp8 (model/quantize.py): every kind of expert weight in one layer."""
    w_gate, w_up, w_down = weights
    return [quantize_weight(w_gate, "int8"), w_up, quantize_weight(w_down, "fp8")]


QUANTIZED_OPTIONS = dict(top_k=3, normalize_top_k=True)  # shared by the next three tests


@pytest.mark.parametrize("impl", [None, "ragged"])
def test_quantized_experts(impl):
    x, router, *weights = make_layer(np.random.default_rng(5), T, E)
    quantized = partly_quantized(weights)  # {"weight": (E, in, out), "scale": (E, out)} or (E, in, out)
    out = routed(x, router, *quantized, impl=impl, **QUANTIZED_OPTIONS)
    dequantized = [dequantize(w, jnp.float32) if isinstance(w, dict) else w for w in quantized]
    ref = dense(x, router, *dequantized, **QUANTIZED_OPTIONS)  # the float weights they stand for
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def two_device_mesh():
    return Mesh(np.array(jax.devices()[:2]), (MODEL_AXIS,))


@pytest.mark.parametrize("dtype,quantized", [(jnp.bfloat16, False), (jnp.float32, True)])
def test_expert_parallel_matches_one_device(dtype, quantized):
    mesh = two_device_mesh()
    x, router, *weights = make_layer(np.random.default_rng(11), T, E, dtype)
    options = dict(top_k=2, normalize_top_k=True, round_weights=True)  # Qwen3-MoE in bfloat16
    if quantized:
        weights, options = partly_quantized(weights), QUANTIZED_OPTIONS  # top-3: the float32 sum reassociates
    one = routed(x, router, *weights, **options)
    host = jax.tree_util.tree_map(np.asarray, weights)
    sharded = jax.device_put(host, NamedSharding(mesh, P(MODEL_AXIS)))  # every leaf split on its expert axis
    ep = jax.jit(lambda *a: moe.moe_mlp_expert_parallel(*a, mesh=mesh, **options))(x, router, *sharded)
    # each assignment is computed on one device and the float32 partial sums hold zeros for the others, so
    # only float32 reassociation of the k products can differ (none for k=2)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(ep, np.float32), np.asarray(one, np.float32), rtol=tol, atol=tol)


def test_tensor_parallel_experts_match_one_device():
    mesh = two_device_mesh()
    x, router, *weights = make_layer(np.random.default_rng(13), T, E)
    weights = partly_quantized(weights)
    one = routed(x, router, *weights, **QUANTIZED_OPTIONS)
    tp = jax.jit(lambda *a: moe.moe_mlp_tensor_parallel(*a, mesh=mesh, **QUANTIZED_OPTIONS))(x, router, *weights)
    np.testing.assert_allclose(tp, one, rtol=1e-5, atol=1e-5)


def test_one_compilation_for_every_routing():
    options = dict(top_k=2, normalize_top_k=True)
    _, _, *weights = make_layer(np.random.default_rng(17), T, E)
    sizes = []
    for seed, skew in [(0, None), (1, 5), (2, 0)]:  # spread, all to expert 5, all to expert 0
        x, router, *_ = make_layer(np.random.default_rng(seed), T, E, skew_to=skew)
        np.testing.assert_allclose(routed(x, router, *weights, **options), dense(x, router, *weights, **options),
                                   rtol=1e-5, atol=1e-5)
        sizes.append(_routed._cache_size())
    assert sizes[0] == sizes[1] == sizes[2]  # no new executable for another routing


def test_default_impl_and_block_rows():
    assert moe.default_impl() == ("ragged" if jax.default_backend() == "tpu" else "blocked")
    assert moe.default_block_rows(32, 8) == 8  # decode: few rows per expert
    assert moe.default_block_rows(512, 8) == 32  # half the mean group
    assert moe.default_block_rows(1 << 16, 8) == 128
