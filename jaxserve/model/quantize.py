"""Weight-only quantization of the decoder's linear layers (vLLM's `quantization`: int8 or fp8).

Each of a layer's projections (the leaves its model declares `quantizable`, model/registry.py; the Llama
family's q, k, v, o, gate, up, down) becomes `{"weight": (L, in, out) int8 or
float8_e4m3fn, "scale": (L, out) float32}`: one scale per output channel, the channel's largest magnitude
over the format's largest value (127, or 448 for e4m3), so `weight * scale` is the original to within the
format's rounding. A matmul dequantizes in its operand: `(x @ weight) * scale` with the weight cast to the
activations' dtype (exact: int8 and e4m3 values are bf16 values), the scale factored out of the sum. The
embeddings, the LM head and the norms stay as loaded.

A quantized checkpoint is served as it is stored (model/loader.py): fp8 weights with a scale per channel or per
tensor like the above, or with block-wise scales (model_spec.py's `checkpoint_weight_block`, DeepSeek's and
Qwen3-FP8's form), and int4 weights (compressed-tensors W4A16) with a scale per channel or per group of input
columns, and for asymmetric groups (llm-compressor's W4A16_ASYM, its AWQ's form) a zero point per group:
`{"weight", "scale", "zero": (..., groups, out) int8}`, the weight standing for (q - zero) * scale; and for GPTQ's
act-order, whose groups are not consecutive rows, `"row_groups": (..., in) int32`, each input row's group (the
scales then gathered row by row, and whole on every device). int4 weights
are kept two to a byte, uint8 (..., in / 2, out): input rows 2i and 2i + 1 in the low and high nibble of row i,
each stored plus 8 (the checkpoint's own packing, read as bytes), and unpacked where a matmul reads them
(`unpack_int4`: shifts and masks, no sub-byte dtype, whose layouts XLA's CPU executables compiled ahead of time
do not accept). Block and group scales are "grouped", (..., in // block columns, out),
one per output channel and group of input rows (a block's scale repeated over its output channels), so they are
sharded exactly like the weight. Such a matmul dequantizes the weight operand group by group (`dequantize`)
before the product: the activations stay in their dtype (weight-only, unlike vLLM's block fp8 kernels, which
quantize them per token group).

Quantizing happens on the device after loading, one leaf at a time in the leaf's sharding (the output
channels split as the weight's; a row-parallel weight's channel maxima are reduced across devices), so the
quantized tree is sharded like the float one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

FORMATS = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}  # mode -> (dtype, largest value)
# served mode -> the weight's dtype on the device (int4: two to a uint8 byte, `unpack_int4`)
WEIGHT_DTYPES = {**{mode: dtype for mode, (dtype, _) in FORMATS.items()}, "int4": jnp.uint8}
INT4_PER_BYTE = 2


def quantize_weight(weight: jax.Array, mode: str) -> dict:
    """{"weight": quantized (..., in, out), "scale": (..., out) float32} of a float weight (..., in, out)."""
    dtype, largest = FORMATS[mode]
    values = weight.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(values), axis=-2)  # (..., out)
    scale = jnp.where(absmax > 0, absmax / largest, 1.0)  # (..., out) an all-zero channel keeps scale 1
    scaled = jnp.clip(values / scale[..., None, :], -largest, largest)  # (..., in, out)
    quantized = jnp.round(scaled).astype(dtype) if dtype == jnp.int8 else scaled.astype(dtype)
    return {"weight": quantized, "scale": scale}


def quantized_shapes(weight: jax.ShapeDtypeStruct, mode: str, block_columns: int | None,
                     zero_points: bool = False, row_groups: bool = False) -> dict:
    """The shapes of a quantized weight standing for a float one (..., in, out): its scale (..., out), or grouped
    (..., in // block_columns, out) under a block, its zero points shaped like grouped scales, and each input row's
    group (..., in)."""
    *lead, rows, out = weight.shape
    scale = (*lead, rows // block_columns, out) if block_columns else (*lead, out)
    stored = (*lead, rows // INT4_PER_BYTE, out) if mode == "int4" else weight.shape
    shapes = {"weight": jax.ShapeDtypeStruct(stored, WEIGHT_DTYPES[mode]),
              "scale": jax.ShapeDtypeStruct(scale, jnp.float32)}
    if zero_points:
        shapes["zero"] = jax.ShapeDtypeStruct(scale, jnp.int8)
    if row_groups:
        shapes["row_groups"] = jax.ShapeDtypeStruct((*lead, rows), jnp.int32)
    return shapes


def unpack_int4(packed: jax.Array, dtype) -> jax.Array:
    """int4 weights kept two to a byte, uint8 (..., in / 2, out), as values in [-8, 7] of (..., in, out)."""
    low = (packed & 0xF).astype(jnp.int8) - 8  # input rows 0, 2, 4, ...
    high = (packed >> 4).astype(jnp.int8) - 8  # input rows 1, 3, 5, ...
    *lead, half, out = packed.shape
    return jnp.stack([low, high], axis=-2).reshape(*lead, half * INT4_PER_BYTE, out).astype(dtype)


def weight_values(weight: dict, dtype) -> jax.Array:
    """A quantized weight's integers or floats (..., in, out) in `dtype`, before any scale."""
    values = weight["weight"]
    return unpack_int4(values, dtype) if values.dtype == jnp.uint8 else values.astype(dtype)


def is_grouped(weight: dict) -> bool:
    """Whether a quantized weight has grouped (block-wise) scales (..., groups, out) rather than (..., out)."""
    return weight["scale"].ndim == weight["weight"].ndim


def dequantize(weight: dict, dtype) -> jax.Array:
    """The float weight (..., in, out) a quantized one stands for: values times scale, less the zero point first
    when it has them."""
    values = weight_values(weight, jnp.float32)  # (..., in, out)
    scale = weight["scale"]  # (..., out) or grouped (..., G, out)
    if not is_grouped(weight):
        return (values * scale[..., None, :]).astype(dtype)
    if "row_groups" in weight:  # (..., in) int32: each input row's group, in any order (GPTQ's act-order)
        of_rows = _rows_of(weight["row_groups"])  # (..., G, out) -> (..., in, out)
        if "zero" in weight:
            values = values - of_rows(weight["zero"].astype(jnp.float32))
        return (values * of_rows(scale)).astype(dtype)
    *lead, rows, out = values.shape
    groups = scale.shape[-2]
    grouped = values.reshape(*lead, groups, rows // groups, out)  # (..., G, in / G, out)
    if "zero" in weight:  # (..., G, out) int8
        grouped = grouped - weight["zero"][..., :, None, :].astype(jnp.float32)
    return (grouped * scale[..., :, None, :]).reshape(values.shape).astype(dtype)


def _rows_of(row_groups: jax.Array):
    """A function taking per-group values (..., G, out) to each input row's (..., in, out), rows in `row_groups`
    (..., in) groups."""
    take = lambda per_group, groups: per_group[groups]  # noqa: E731  (G, out), (in,) -> (in, out)
    for _ in range(row_groups.ndim - 1):  # the stacked leading axes (experts)
        take = jax.vmap(take)
    return lambda per_group: take(per_group, row_groups)


def linear(x: jax.Array, weight) -> jax.Array:
    """x @ weight for a float weight (in, out) or a quantized one; the result in x's dtype."""
    # x: (T, in) -> (T, out)
    if not isinstance(weight, dict):
        return x @ weight
    if is_grouped(weight):
        return jnp.dot(x, dequantize(weight, x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    product = jnp.dot(x, weight_values(weight, x.dtype), preferred_element_type=jnp.float32)  # (T, out)
    return (product * weight["scale"]).astype(x.dtype)


def quantized_spec(spec: P, grouped: bool = False, zero_points: bool = False, row_groups: bool = False) -> dict:
    """The PartitionSpecs of a quantized weight whose float form has `spec` (..., in, out): the weight keeps it; a
    scale (..., out) drops the input axis, a grouped one (..., groups, out) keeps it too, as zero points do. With
    `row_groups` (any input row in any group) the groups are whole on every device (a device's rows may belong to
    any) and the rows' groups (..., in) are split like the rows."""
    lead, rows, columns = spec[: len(spec) - 2], spec[len(spec) - 2: len(spec) - 1], spec[len(spec) - 1:]
    specs = {"weight": spec, "scale": (P(*lead, None, *columns) if row_groups else spec) if grouped
             else P(*lead, *columns)}
    if zero_points:
        specs["zero"] = specs["scale"]
    if row_groups:
        specs["row_groups"] = P(*lead, *rows)
    return specs


LeafPath = tuple[str, ...]  # a leaf's keys from the params tree's root: ("layers", "wq"), ("dense_layers", "w_up")


def leaf_at(tree: dict, path: LeafPath):
    """The leaf (or subtree) of `tree` at `path`."""
    for key in path:
        tree = tree[key]
    return tree


def replace_at(tree: dict, paths: tuple[LeafPath, ...], function) -> dict:
    """`tree` with the leaf at each of `paths` replaced by `function(leaf)`, in order; the dicts along the paths are
    copied, the rest of the tree is shared."""
    tree = dict(tree)
    for path in paths:
        node = tree
        for key in path[:-1]:
            node[key] = dict(node[key])
            node = node[key]
        node[path[-1]] = function(node[path[-1]])
    return tree


def quantized_partition_specs(specs: dict, paths: tuple[LeafPath, ...], grouped: bool = False,
                              zero_points: bool = False, row_groups: bool = False) -> dict:
    """A params PartitionSpec tree (model/registry.py) for the params with the leaves at `paths` quantized (with
    grouped scales when `grouped`, zero points, and rows in any group)."""
    return replace_at(specs, paths, lambda spec: quantized_spec(spec, grouped, zero_points, row_groups))


def quantize_params(params: dict, mode: str, paths: tuple[LeafPath, ...]) -> dict:
    """The params with the leaves at `paths` quantized (`mode` int8 or fp8), each in its weight's sharding; the
    float leaves are dropped as they are replaced."""
    def quantized(weight: jax.Array) -> dict:
        mesh = weight.sharding.mesh
        out = {part: NamedSharding(mesh, spec) for part, spec in quantized_spec(weight.sharding.spec).items()}
        return jax.jit(quantize_weight, static_argnums=1, out_shardings=out, donate_argnums=0)(weight, mode)

    return replace_at(params, paths, quantized)


def weight_bytes(params: dict) -> int:
    """Bytes of every params leaf (all devices' shards together, replicas counted once)."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(params))
