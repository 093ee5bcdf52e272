"""cuDNN's paged attention on step 5's decode shapes: the route issue 46 names beside the Pallas kernel.

jax 0.11 exposes cuDNN's paged attention (`jax._src.cudnn.fused_attention_stablehlo.paged_attention`): queries
(B, T, Hq, D), K and V pages (num_blocks, block_size, Hkv, D) as our pool holds a layer's, and a page table
(B, 1, blocks_per_batch, 1) per row. jax's wrapper asks the pool to hold exactly B x blocks_per_batch pages, so
the rows' page tables are padded with the null page to pool pages / B entries each; `kv_seqlen` bounds what each
row reads. Decode is one query token per row with the padding mask (a causal mask would align the query with key 0).

The pool's copies are separate arrays here (a custom call reads whole operands: slicing a layer out of the stacked
pool with a traced index would copy it first), and call i of a dispatch reads copy i % copies: every copy holds
>= 67 MB on the plan's shapes (more than the H200's 50 MB L2), so no call finds its pages in the L2. Its output is
compared with the same float32 reference as the kernel's settings (decode.spot_error).

Measured only where cuDNN runs (an NVIDIA GPU with jax's CUDA plugin); elsewhere `unavailable` says why.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu.common import per_call, time_dispatches

LABEL = "cudnn paged attention"
# Calls a timed dispatch makes (fewer than the kernel's 32: each call is a cuDNN graph XLA builds when it compiles;
# eight calls of >= 67 MB each still spread a dispatch's launch over half a gigabyte)
MAX_CALLS = 8


def unavailable() -> str | None:
    """Why cuDNN's paged attention cannot run in this process (None: it can)."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn
    except ImportError as exc:
        return f"no jax cuDNN attention module ({exc})"
    if not hasattr(cudnn, "paged_attention"):
        return f"jax {jax.__version__} has no cuDNN paged attention (jax 0.11 added it)"
    if jax.default_backend() != "gpu":
        return f"no GPU (backend {jax.default_backend()}): cuDNN runs on NVIDIA GPUs"
    try:
        cudnn.check_cudnn_version()
    except RuntimeError as exc:
        return f"cuDNN unusable: {exc}"
    return None


def padded_page_table(page_table: np.ndarray, pool_pages: int) -> np.ndarray:
    """(B, 1, pool_pages / B, 1) int32: each row's pages, then the null page 0 (jax's wrapper wants the pool to hold
    exactly B x blocks per row); ValueError when pool_pages is not a multiple of B or too few for the rows."""
    # page_table: (B, W) int32
    batch, width = page_table.shape
    if pool_pages % batch or pool_pages // batch < width:
        raise ValueError(f"a pool of {pool_pages} pages cannot be split into {batch} rows of at least {width} pages")
    padded = np.zeros((batch, pool_pages // batch), np.int32)  # (B, P / B)
    padded[:, :width] = page_table
    return padded[:, None, :, None]


def measure(inputs: dict, num_sets: int, repeats: int) -> dict:
    """Per-call time of cuDNN's paged decode on step 5's inputs (qs: (N, B, Hq, D); k, v: (sets, P', S, Hkv, D)), as
    common.per_call gives it (`output`: call 0's, (B, Hq, D))."""
    qs, seq_lens = inputs["qs"], inputs["seq_lens"]  # (N, B, Hq, D), (B,)
    k_sets = tuple(inputs["k"][i] for i in range(num_sets))  # each (P', S, Hkv, D)
    v_sets = tuple(inputs["v"][i] for i in range(num_sets))
    table = jnp.asarray(padded_page_table(np.asarray(inputs["page_table"]), k_sets[0].shape[0]))  # (B, 1, P'/B, 1)
    samples, first_s, outputs = time_dispatches(program(qs.shape[0], num_sets),
                                                lambda d: (qs, k_sets, v_sets, table, seq_lens), repeats)
    return per_call(samples, first_s, outputs[0], qs.shape[0])


def program(num_calls: int, num_sets: int):
    """The jitted dispatch: `run(qs, k_sets, v_sets, table, seq_lens)` makes `num_calls` decode calls, call i on
    copy i % num_sets (see the module docstring), and returns each call's (B, Hq, D) output."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    @jax.jit
    def run(qs, k_sets, v_sets, table, seq_lens):
        # qs: (N, B, Hq, D); k_sets, v_sets: sets x (P', S, Hkv, D); table: (B, 1, P'/B, 1); seq_lens: (B,)
        batch, head_dim = qs.shape[1], qs.shape[3]
        attend = functools.partial(cudnn.paged_attention, scale=head_dim ** -0.5, mask_type=cudnn.MaskType.PADDING,
                                   qkv_layout="BTNH")
        outputs = []
        for i in range(num_calls):
            out = attend(qs[i][:, None], k_sets[i % num_sets], v_sets[i % num_sets],
                         jnp.ones((batch,), jnp.int32), seq_lens, table, table)
            outputs.append((out[0] if isinstance(out, (tuple, list)) else out)[:, 0])  # (B, Hq, D)
        return tuple(outputs)

    return run
