"""JAX's Mosaic TPU ragged paged attention behind our backend interface, over the fused KV layout.

The kernel (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`) reads K and V from one page array
`(pages, S, 2 * Hkv, D)`, K of KV head `h` at index `2h` and V at `2h + 1`: one layer of our `fused` layout.
Its metadata is ours under other names: `kv_lens` = seq_lens, `page_indices` = page_table (R, W),
`cu_q_lens` = query_start_loc, `num_seqs` = batch.num_seqs as a (1,) array. It reads only the first
`num_seqs` rows, so our padded rows (after the real ones) are never looked at; the outputs of padded
tokens are whatever its scratch held, so they are zeroed here.

Layer selection without a copy: the kernel takes a page array with no layer axis. `cache[layer]` with a
traced layer index is a dynamic slice, and XLA would materialise it to hand it to the custom call: a copy
of the layer's whole pool (P * S * 2Hkv * D elements) for every layer of every step, far more traffic than
the attention itself. Instead the cache `(L, P, ...)` is viewed as `(L * P, ...)` (a reshape of leading
axes, no data movement) and the page table is offset by `layer * P`.

Page-table size: the kernel prefetches the whole (R, W) page table into the TPU's scalar memory (SMEM, 1 MiB
on v4 to v6e), so a step whose table is larger than `PAGE_TABLE_SMEM_BYTES` runs the kernel on groups of rows
whose table fits, each group's query tokens moved to the front of `q` (a roll) so the kernel's query blocks
start at the group's first token.

Head dimension: the kernel keeps its softmax statistics 128 lanes wide and broadcasts them over the head
dimension, so it takes only multiples of 128. The cache stores the head dimension padded with zeros to whole
lanes (as vLLM's TPU backend does), and queries are padded the same way: zeros add nothing to the scores, and
the padded output columns are dropped. Models with head_dim 128 (Llama 3, Qwen2.5) pad nothing.

The kernel runs inside `shard_map` over the `model` mesh axis like our GPU kernels: each device attends its
own query heads over its own KV heads. The fused head axis (2 * Hkv) is split in contiguous blocks, so a
device holding KV heads h0..h1 holds the K/V pairs 2h0..2h1+1 of exactly those heads.

An fp8 cache (attention/fp8.py): the kernel casts K and V to the queries' dtype only when given a scale, so it gets
k_scale = v_scale = 1.0 (the real scales are folded into q and the output by the model).

Interpret mode (`pallas-tpu-interpret`, CPU tests) runs the kernel in JAX's TPU interpreter, which in JAX
0.10.2 cannot run it as shipped; `mend_tpu_interpreter` fixes the two gaps it hits. Cross-lowering (jax.export
for 'tpu' on a host without a TPU) needs `lowering_off_tpu`: the Mosaic lowering asks the device for its chip.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as tpu_kernel
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.attention.base import AttentionBackend, LayerAttention, cache_shapes
from jaxserve.batch.descriptor import BatchDescriptor
from jaxserve.sharding import KV_CACHE_SPEC, MODEL_AXIS

HEADS_SPEC = P(None, MODEL_AXIS, None)  # (T, heads, D): heads split over the mesh
# Half of the 1 MiB SMEM of TPU v4-v6e for the page table, the budget vLLM's TPU backend gives it.
PAGE_TABLE_SMEM_BYTES = 512 * 1024
# (KV pages, query tokens) per kernel block off a TPU (interpret mode, cross-lowering): the kernel's own
# default for a TPU missing from its tuned table. On a TPU the kernel looks its tuned table up itself.
UNTUNED_BLOCK_SIZES = (128, 32)
LANE_WIDTH = 128  # a TPU vector register's minor dimension


def tpu_unsupported(kv_heads_per_device: int, cache_dtype) -> str | None:
    """Why the kernel cannot take the model's heads in a cache of `cache_dtype`, or None when it can: the fused
    heads per device (2 * Hkv) must tile the cache (the kernel's `get_min_heads_per_blk`): divide into the
    values one 32-bit word packs (1, 2 or 4 of 32, 16 or 8 bits), leaving 1, 2, 4, 8 or a multiple of 8."""
    dtype = jnp.dtype(cache_dtype)
    packing = 4 // dtype.itemsize
    fused = 2 * kv_heads_per_device
    words = fused // packing
    if fused % packing or (words not in (1, 2, 4, 8) and words % 8):
        return (f"{kv_heads_per_device} KV heads per device in a {dtype.name} cache: the TPU kernel needs "
                f"2 * Hkv / {packing} to be a whole 1, 2, 4, 8 or a multiple of 8")
    return None


def padded_head_dim(head_dim: int) -> int:
    """The head dimension the cache stores: whole lanes (the kernel's softmax statistics are 128 lanes wide
    and broadcast over the head dimension, so it takes only multiples of 128)."""
    return -(-head_dim // LANE_WIDTH) * LANE_WIDTH


@dataclasses.dataclass(frozen=True)
class LanePaddedBackend(AttentionBackend):
    """A fused-layout backend whose cache stores the head dimension padded to whole lanes (zeros)."""

    def cache_shapes(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                     head_dim: int) -> tuple[tuple[int, ...], ...]:
        """The fused shape with the padded head dimension."""
        return cache_shapes(self.layout, num_layers, num_pages, page_size, num_kv_heads, padded_head_dim(head_dim))


def make_backend(mesh: Mesh, interpret: bool) -> AttentionBackend:
    """The TPU kernel (or its run in TPU interpret mode on the CPU) as a backend over the fused layout."""

    @functools.cache
    def sharded_attention(how: LayerAttention):
        """The kernel for one way of attending, each device on its own heads."""
        attend = functools.partial(attend_shard, sm_scale=how.sm_scale, sliding_window=how.sliding_window,
                                   soft_cap=how.soft_cap, interpret=interpret)
        return jax.shard_map(
            attend, mesh=mesh,
            in_specs=(HEADS_SPEC, KV_CACHE_SPEC, P(), P(), P(), P(), P()),
            out_specs=HEADS_SPEC, check_vma=False,
        )

    sharded_write = jax.shard_map(
        write_fused, mesh=mesh,
        in_specs=(KV_CACHE_SPEC, P(), HEADS_SPEC, HEADS_SPEC, P()),
        out_specs=KV_CACHE_SPEC, check_vma=False,
    )

    def attention(q, caches, layer, batch: BatchDescriptor, how: LayerAttention, sinks=None) -> jax.Array:
        if sinks is not None:
            raise ValueError("JAX's TPU ragged paged attention has no attention sinks (gpt-oss): use "
                             "attention_backend xla")
        (kv_cache,) = caches
        return sharded_attention(how)(q, kv_cache, layer, batch.query_start_loc, batch.seq_lens, batch.page_table,
                                      batch.num_seqs)

    def write_kv(caches, layer, k, v, batch: BatchDescriptor):
        (kv_cache,) = caches
        return (sharded_write(kv_cache, layer, k, v, batch.slot_mapping),)

    name = "pallas-tpu-interpret" if interpret else "pallas"
    # an fp8 cache stays float8: the kernel reads its pages as they are stored
    return LanePaddedBackend(name, "fused", attention, write_kv, fp8_storage=np.dtype(jnp.float8_e4m3fn))


def write_fused(kv_cache, layer, k, v, slot_mapping):
    """Scatter the step's new K/V into layer `layer`, K of head h at fused index 2h and V at 2h + 1, zero
    padded to the cache's head dimension (padded tokens' slots point at the null page)."""
    # kv_cache: (L, P, S, 2 * Hkv, Dp); k, v: (T, Hkv, D); slot_mapping: (T,) int32 = page * S + offset
    num_tokens, num_kv_heads, _ = k.shape
    page_size, padded = kv_cache.shape[2], kv_cache.shape[-1]
    kv = pad_head_dim(jnp.stack([k, v], axis=2), padded)  # (T, Hkv, 2, Dp)
    kv = kv.reshape(num_tokens, 2 * num_kv_heads, padded)  # (T, 2 * Hkv, Dp)
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size  # (T,), (T,)
    return kv_cache.at[layer, pages, offsets].set(kv.astype(kv_cache.dtype))


def attend_shard(q, kv_cache, layer, query_start_loc, seq_lens, page_table, num_seqs, *, sm_scale,
                 sliding_window, soft_cap, interpret):
    """One device's attention: the kernel over layer `layer` of its fused cache, in groups of rows whose
    page table fits the kernel's SMEM budget; padded tokens get zeros."""
    # q: (T, Hq, D); kv_cache: (L, P, S, 2 * Hkv, Dp); layer: () int32; query_start_loc: (R + 1,) int32
    # seq_lens: (R,) int32; page_table: (R, W) int32; num_seqs: () int32
    head_dim = q.shape[-1]
    q = pad_head_dim(q, kv_cache.shape[-1])  # (T, Hq, Dp) zeros add nothing to the scores
    num_layers, num_pages = kv_cache.shape[:2]
    pages = kv_cache.reshape(num_layers * num_pages, *kv_cache.shape[2:])  # (L * P, S, 2 * Hkv, Dp)
    page_indices = page_table + layer * num_pages  # (R, W) pages of layer `layer` in the flat view
    kernel = functools.partial(
        run_kernel, pages=pages, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        interpret=interpret,
    )
    num_rows, width = page_table.shape
    group = max(1, PAGE_TABLE_SMEM_BYTES // (4 * width))
    if group >= num_rows:
        out = kernel(q, seq_lens, page_indices, query_start_loc, num_seqs)  # (T, Hq, Dp)
    else:
        out = jnp.zeros_like(q)  # (T, Hq, Dp)
        for first in range(0, num_rows, group):
            rows = slice(first, min(first + group, num_rows))
            out = out + row_group(q, seq_lens[rows], page_indices[rows], query_start_loc[first:rows.stop + 1],
                                  num_seqs - first, kernel=kernel)
    is_real = jnp.arange(q.shape[0]) < query_start_loc[num_rows]  # (T,) padded entries hold the real total
    return jnp.where(is_real[:, None, None], out[..., :head_dim], 0)  # (T, Hq, D)


def row_group(q, seq_lens, page_indices, query_start_loc, num_seqs, *, kernel):
    """The attention of one group of rows at its tokens' places, zeros elsewhere; no kernel call when the
    group has no real row."""
    # q: (T, Hq, Dp); seq_lens: (G,) int32; page_indices: (G, W) int32; query_start_loc: (G + 1,) int32
    # num_seqs: () int32 real rows of the group (may be <= 0 or > G)
    num_tokens = q.shape[0]
    start, stop = query_start_loc[0], query_start_loc[-1]  # () the group's tokens are start..stop-1

    def attend():
        out = kernel(jnp.roll(q, -start, axis=0), seq_lens, page_indices, query_start_loc - start,
                     jnp.minimum(num_seqs, seq_lens.shape[0]))  # (T, Hq, Dp) the group's tokens first
        token = jnp.arange(num_tokens)  # (T,)
        mine = (token >= start) & (token < stop)  # (T,)
        return jnp.where(mine[:, None, None], jnp.roll(out, start, axis=0), 0)

    return jax.lax.cond(num_seqs > 0, attend, lambda: jnp.zeros_like(q))


def run_kernel(q, seq_lens, page_indices, query_start_loc, num_seqs, *, pages, sm_scale, sliding_window, soft_cap,
               interpret):
    """The Mosaic kernel on one page table, in TPU interpret mode when `interpret`."""
    # q: (T, Hq, Dp); seq_lens: (R,) int32; page_indices: (R, W) int32 into `pages` (N, S, 2 * Hkv, Dp)
    # query_start_loc: (R + 1,) int32; num_seqs: () int32
    block_pages, block_queries = (None, None) if on_tpu() else UNTUNED_BLOCK_SIZES
    if block_pages is not None:
        block_pages, block_queries = min(block_pages, page_indices.shape[1]), min(block_queries, q.shape[0])
    with interpret_mode() if interpret else contextlib.nullcontext():
        return tpu_kernel.ragged_paged_attention(
            q, pages, seq_lens, page_indices, query_start_loc, num_seqs.reshape(1),
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            num_kv_pages_per_block=block_pages, num_queries_per_block=block_queries,
            **({"k_scale": 1.0, "v_scale": 1.0} if pages.dtype.itemsize == 1 else {}),
        )  # (T, Hq, Dp)


def pad_head_dim(x: jax.Array, padded: int) -> jax.Array:
    """Zeros appended to the last (head) axis up to `padded`."""
    # x: (..., D) -> (..., padded)
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - x.shape[-1])])


def on_tpu() -> bool:
    """Whether JAX runs on TPU devices here (the kernel's tuned block sizes read the device kind)."""
    return jax.devices()[0].platform == "tpu"


@contextlib.contextmanager
def lowering_off_tpu(chip: pltpu.ChipVersion = pltpu.ChipVersion.TPU_V5P):
    """Lets the kernel lower for 'tpu' (`jax.export(..., platforms=("tpu",))`) on a CPU host: the Mosaic
    lowering reads the chip's generation from the default device (`tpu_info.get_tpu_info`), and a CPU has
    none; this answers with `chip`'s. Off a TPU the kernel also takes UNTUNED_BLOCK_SIZES, not its tuned table."""
    from jax._src.pallas.mosaic import tpu_info

    tpu_info.registry["cpu"] = lambda: pltpu.get_tpu_info_for_chip(chip, 1)
    tpu_info.get_tpu_info.cache_clear()  # JAX caches the answer
    try:
        yield
    finally:
        del tpu_info.registry["cpu"]
        tpu_info.get_tpu_info.cache_clear()


def interpret_mode() -> contextlib.AbstractContextManager:
    """TPU interpret mode for the Pallas calls traced under it, with the interpreter mended."""
    mend_tpu_interpreter()
    return pltpu.force_tpu_interpret_mode()


@functools.cache
def mend_tpu_interpreter() -> None:
    """Fix the two gaps of JAX 0.10.2's TPU interpreter this kernel hits, by wrapping two of its callbacks
    (process-wide, once; they only change what failed):

    - a read through a reshaped or bitcast ref fails (the kernel reshapes its K/V buffer, and bitcasts a 16-bit
      one to 32-bit words, before loading K and V with strides): the interpreter turns a ref's transforms into
      index ranges, which know neither. The wrapper reads the ref up to its first such transform and applies
      the rest to the value read.
    - a masked store into a view narrower on a later axis than on the first (the kernel's `acc_ref.at[:, h:h+G]`)
      is called out of bounds: the bounds mask clips axis 0 by every axis's size. The wrapper reads the view,
      merges the stored value under the mask and stores the result unmasked.
    """
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter
    from jax._src.state.indexing import NDIndexer

    plain_get, plain_swap = interpreter.get.__wrapped__, interpreter.swap.__wrapped__

    def get(token, device_id, core_id, memory_space, buffer_id, transforms, *args, **kwargs):
        cut = next((i for i, t in enumerate(transforms) if not isinstance(t, NDIndexer)), len(transforms))
        token, value = plain_get(token, device_id, core_id, memory_space, buffer_id, transforms[:cut], *args,
                                 **kwargs)
        for transform in transforms[cut:]:
            value = transform_value(value, transform)
        return token, value

    def swap(token, device_id, core_id, memory_space, buffer_id, transforms, val, mask, **kwargs):
        if mask is not None:
            token, old = plain_get(token, device_id, core_id, memory_space, buffer_id, transforms)
            val, mask = np.where(mask, val, old), None
        return plain_swap(token, device_id, core_id, memory_space, buffer_id, transforms, val, mask, **kwargs)

    interpreter.get = interpreter.fail_on_exception(get)  # DMAs read through `get.__wrapped__`: this `get`
    interpreter.swap = interpreter.fail_on_exception(swap)


def transform_value(value: np.ndarray, transform) -> np.ndarray:
    """A ref transform (index, reshape or widening bitcast) applied to a value read from the ref. A TPU
    bitcast to a k-times wider type packs k consecutive rows of the second-minor axis, the first in the low
    bits."""
    from jax._src.pallas.mosaic.interpret import utils as interpreter_utils
    from jax._src.state.types import BitcastTransform, ReshapeTransform

    if isinstance(transform, ReshapeTransform):
        return value.reshape(transform.shape)
    if isinstance(transform, BitcastTransform):
        dtype = np.dtype(transform.dtype)
        ratio = dtype.itemsize // value.dtype.itemsize
        rows = value.reshape(*value.shape[:-2], value.shape[-2] // ratio, ratio, value.shape[-1])  # (..., R/k, k, C)
        return np.ascontiguousarray(rows.swapaxes(-1, -2)).view(dtype)[..., 0]  # (..., R/k, C)
    return value[interpreter_utils.to_range([jax.tree.map(int, transform)])]
