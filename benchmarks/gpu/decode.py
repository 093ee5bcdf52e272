"""Step 5: decode bandwidth of the paged decode kernel and its share of the copy bandwidth.

One decode step of one layer for every batch x context of the plan, all rows at that length, their
pages drawn at random from the pool so reads are scattered, under several settings: num_splits
(auto and fixed), Triton num_warps x num_stages (at auto splits) and pages per loop step (at auto
splits). Bytes moved per call are the K and V pages read, rows x ceil(ctx / page) x page x Hkv x D
x 2 bytes x 2, plus Q read and O written (page tables and split partials ignored). Each setting's
first output is compared with a float32 reference on two rows (`spot err`); a setting whose output
is wrong is never the best. Beside the kernel, the same inputs through cuDNN's paged attention
(benchmarks/gpu/cudnn_paged.py, where cuDNN runs): a row of its own per shape, compared with the
kernel's best, never counted as the kernel's.
"""

from __future__ import annotations

import dataclasses
import functools
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu import cudnn_paged
from benchmarks.gpu.common import BF16_TOLERANCE, random_pool, relative_error, rotation, time_calls
from benchmarks.gpu.config import Model, Plan, Setting
from benchmarks.gpu.step import Step, error_text
from pallas_kernels.paged_decode_attention.kernel import paged_decode_attention
from pallas_kernels.paged_decode_attention.tuning import choose_num_splits
from pallas_kernels.ragged_paged_attention import reference

SPOT_ROWS = 2  # rows of each setting's first output compared with a float32 reference


def settings(plan: Plan, auto_splits: int) -> list[Setting]:
    """The plan's splits at the default launch, then its other launches and pages per step at auto splits.

    A fixed split count equal to the automatic one is the same kernel, measured once (as auto)."""
    default = plan.default_setting()
    chosen = [dataclasses.replace(default, num_splits=splits) for splits in plan.decode_splits
              if splits is None or splits != auto_splits]
    chosen += [dataclasses.replace(default, num_warps=w, num_stages=s) for w, s in plan.decode_launch[1:]]
    chosen += [dataclasses.replace(default, pages_per_step=n) for n in plan.decode_pages_per_step[1:]]
    return chosen


def decode_inputs(batch: int, context: int, model: Model, page_size: int, num_sets: int, num_calls: int,
                  seed: int) -> dict:
    """Device inputs of one decode step: `num_calls` queries, a pool with `num_sets` layers, metadata."""
    dtype = jnp.dtype(model.dtype)
    width = -(-context // page_size)  # pages per row
    num_pages = 1 + batch * width  # page 0 is the null page
    page_shape = (page_size, model.kv_heads, model.head_dim)
    key_q, key_k, key_v = jax.random.split(jax.random.key(seed), 3)
    page_table = 1 + np.random.default_rng(seed).permutation(batch * width).reshape(batch, width)  # (B, W)
    return {
        "qs": jax.random.normal(key_q, (num_calls, batch, model.heads, model.head_dim), dtype),  # (N, B, Hq, D)
        "k": random_pool(key_k, num_sets, num_pages, page_shape, dtype),  # (sets, P', S, Hkv, D)
        "v": random_pool(key_v, num_sets, num_pages, page_shape, dtype),  # (sets, P', S, Hkv, D)
        "seq_lens": jnp.full((batch,), context, jnp.int32),  # (B,)
        "page_table": jnp.asarray(page_table, jnp.int32),  # (B, W)
        "positions": jnp.full((batch,), context - 1, jnp.int32),  # (B,)
    }


def kv_bytes(batch: int, context: int, model: Model, page_size: int) -> int:
    """K and V bytes one decode call reads (whole pages)."""
    pages = -(-context // page_size)
    return batch * pages * page_size * model.kv_heads * model.head_dim * jnp.dtype(model.dtype).itemsize * 2


def bytes_moved(batch: int, context: int, model: Model, page_size: int) -> int:
    """K and V pages read plus Q read and O written by one decode call."""
    q_and_o = 2 * batch * model.heads * model.head_dim * jnp.dtype(model.dtype).itemsize
    return kv_bytes(batch, context, model, page_size) + q_and_o


@jax.jit
def spot_error_parts(out: jax.Array, inputs: dict, rows: jax.Array):
    """A float32 reference for a few rows (their pages copied into a small dense pool) and the output's rows."""
    # out: (B, Hq, D) the output for qs[0] on pool layer 0; rows: (r,) int32
    table = inputs["page_table"][rows]  # (r, W)
    num_rows, width = table.shape
    small = []
    for cache in (inputs["k"], inputs["v"]):
        pages = cache[0, table.reshape(-1)]  # (r * W, S, Hkv, D): one gather, no copy of layer 0
        small.append(jnp.concatenate([cache[0, :1], pages])[None].astype(jnp.float32))  # (1, 1 + r * W, S, Hkv, D)
    small_table = 1 + jnp.arange(num_rows * width, dtype=jnp.int32).reshape(num_rows, width)  # (r, W)
    with jax.default_matmul_precision("highest"):
        ref = reference.ragged_paged_attention(
            inputs["qs"][0][rows].astype(jnp.float32), small[0], small[1], 0, inputs["positions"][rows],
            jnp.arange(num_rows + 1, dtype=jnp.int32), small_table, sm_scale=out.shape[-1] ** -0.5,
        )  # (r, Hq, D)
    return out[rows].astype(jnp.float32), ref


def spot_error(out: jax.Array, inputs: dict) -> float:
    """Relative error of the first and last rows of a decode output against a float32 reference."""
    batch = out.shape[0]
    rows = jnp.asarray(sorted({0, batch - 1})[:SPOT_ROWS], jnp.int32)  # (r,)
    got, ref = spot_error_parts(out, inputs, rows)
    return relative_error(np.asarray(got), np.asarray(ref))


def measure_setting(setting: Setting, inputs: dict, num_sets: int, step: Step) -> dict:
    """Time one setting on one decode step's inputs; its spot error."""
    model = step.plan.model
    kernel = functools.partial(
        paged_decode_attention, sm_scale=model.head_dim ** -0.5, num_splits=setting.num_splits,
        num_warps=setting.num_warps, num_stages=setting.num_stages, pages_per_step=setting.pages_per_step,
        interpret=step.plan.interpret,
    )

    def call(q, layer, ops):
        return kernel(q, ops["k"], ops["v"], layer, ops["seq_lens"], ops["page_table"])  # (B, Hq, D)

    timing = time_calls(call, inputs["qs"], inputs, num_sets, step.plan.decode_repeats)
    timing["spot_error"] = spot_error(timing.pop("output"), inputs)
    return timing


def shape_seed(step: Step, batch: int, context: int) -> int:
    """The seed of one shape's inputs: the kernel and cuDNN read the same pages."""
    return step.seed + batch * 100003 + context


def measure_shape(batch: int, context: int, step: Step, copy: float | None) -> list[dict]:
    """Every kernel setting on one (batch, context); one row each, printed as measured."""
    plan, page_size = step.plan, step.plan.page_size
    moved = bytes_moved(batch, context, plan.model, page_size)
    num_sets, num_calls = rotation(kv_bytes(batch, context, plan.model, page_size), plan.interpret)
    inputs = decode_inputs(batch, context, plan.model, page_size, num_sets, num_calls,
                           seed=shape_seed(step, batch, context))
    auto_splits = choose_num_splits(batch, plan.model.kv_heads, inputs["page_table"].shape[1])
    rows = []
    for setting in settings(plan, auto_splits):
        row = {"batch": batch, "context": context, "setting": dataclasses.asdict(setting),
               "label": setting.label(auto_splits), "bytes": moved, "sets": num_sets}
        measure_row(row, lambda: measure_setting(setting, inputs, num_sets, step), copy, step)
        rows.append(row)
        print(describe(row), flush=True)
    return rows


def measure_cudnn(batch: int, context: int, step: Step, copy: float | None, unavailable: str | None) -> dict:
    """cuDNN's paged attention on one (batch, context), the kernel's pages with at most cudnn_paged.MAX_CALLS calls a
    dispatch: its row (measured, failed, or skipped: out of time or `unavailable`), printed."""
    plan, page_size = step.plan, step.plan.page_size
    num_sets, num_calls = rotation(kv_bytes(batch, context, plan.model, page_size), plan.interpret,
                                   cudnn_paged.MAX_CALLS)
    row = {"batch": batch, "context": context, "route": "cudnn", "label": cudnn_paged.LABEL,
           "bytes": bytes_moved(batch, context, plan.model, page_size), "sets": num_sets}

    def measure() -> dict:
        inputs = decode_inputs(batch, context, plan.model, page_size, num_sets, num_calls,
                               seed=shape_seed(step, batch, context))
        timing = cudnn_paged.measure(inputs, num_sets, plan.decode_repeats)
        timing["spot_error"] = spot_error(timing.pop("output"), inputs)
        return timing

    measure_row(row, measure, copy, step, unavailable)
    print(describe(row), flush=True)
    return row


def measure_row(row: dict, measure, copy: float | None, step: Step, unavailable: str | None = None) -> None:
    """Fill a row from `measure()` (a timing with its spot error) and its bandwidth; or the error it raised, or why it
    was skipped (out of time, or `unavailable`)."""
    reason = "out of time" if step.out_of_time() else unavailable
    if reason:
        row["skipped"] = reason
        return
    try:
        row.update(measure())
        row["gb_per_s"] = row["bytes"] / (row["us"] * 1e-6) / 1e9
        row["copy_share"] = None if copy is None else row["gb_per_s"] / copy
    except Exception as exc:  # noqa: BLE001 - e.g. a setting Triton rejects: record it, go on
        traceback.print_exc(limit=-4)
        row["error"] = error_text(exc)


def describe(row: dict) -> str:
    """One log line for a measured (or failed, or skipped) setting."""
    head = f"decode B={row['batch']:<3} ctx={row['context']:<6} {row['label']:<46}"
    if "us" not in row:
        return f"{head} {'skipped: ' + row['skipped'] if 'skipped' in row else 'FAIL ' + row.get('error', '')}"
    share = "" if row["copy_share"] is None else f"{100 * row['copy_share']:5.1f}% of copy"
    wrong = "" if is_right(row) else "  WRONG"
    return (f"{head} {row['us']:9.1f} us {row['gb_per_s']:7.0f} GB/s {share}  spot err {row['spot_error']:.1e}"
            f"{wrong}  (first dispatch {row['first_dispatch_s']:.1f} s)")


def is_right(row: dict) -> bool:
    """Whether a measured row's output matched the reference."""
    return row.get("spot_error", float("nan")) < BF16_TOLERANCE


def best_rows(rows: list[dict]) -> list[dict]:
    """Per (batch, context), the kernel's fastest measured setting whose output was right."""
    best: dict[tuple[int, int], dict] = {}
    for row in kernel_rows(rows):
        if "us" in row and is_right(row):
            key = (row["batch"], row["context"])
            if key not in best or row["us"] < best[key]["us"]:
                best[key] = row
    return [best[key] for key in sorted(best)]


def kernel_rows(rows: list[dict]) -> list[dict]:
    """The rows of the Pallas kernel's settings (not cuDNN's)."""
    return [row for row in rows if row.get("route") != "cudnn"]


def cudnn_rows(rows: list[dict]) -> list[dict]:
    """cuDNN's paged attention's rows, one per shape it was tried on."""
    return [row for row in rows if row.get("route") == "cudnn"]


def cudnn_against_kernel(rows: list[dict]) -> list[dict]:
    """Per shape where cuDNN's paged attention was measured: its row's figures and its time over the kernel's best
    (`over_kernel`: None without a right kernel measurement; below 1, cuDNN is faster)."""
    best = {(row["batch"], row["context"]): row for row in best_rows(rows)}
    compared = []
    for row in cudnn_rows(rows):
        if "us" in row:
            kernel = best.get((row["batch"], row["context"]))
            compared.append({"batch": row["batch"], "context": row["context"], "us": row["us"],
                             "gb_per_s": row["gb_per_s"], "copy_share": row["copy_share"], "right": is_right(row),
                             "kernel_us": None if kernel is None else kernel["us"],
                             "over_kernel": None if kernel is None else row["us"] / kernel["us"]})
    return compared


def result(rows: list[dict], copy: float | None) -> dict:
    """The step's result from its rows so far: every row, the kernel's best per shape, cuDNN's against it, a one-line
    summary (cuDNN's rows do not decide whether the step is ok)."""
    best, kernel = best_rows(rows), kernel_rows(rows)
    wrong = sum("us" in row and not is_right(row) for row in kernel)
    failed = sum("error" in row for row in kernel)
    cudnn, tried = cudnn_against_kernel(rows), cudnn_rows(rows)
    cudnn_wrong = sum(not row["right"] for row in cudnn)
    cudnn_failed = sum("error" in row for row in tried)
    skipped = {row["skipped"] for row in tried if "skipped" in row}
    cudnn_text = (f"cuDNN measured on {len(cudnn)}/{len(tried)} shapes{f', {cudnn_wrong} WRONG' if cudnn_wrong else ''}"
                  f"{f', {cudnn_failed} failed' if cudnn_failed else ''}"
                  f"{f', skipped: {sorted(skipped)[0]}' if skipped else ''}")
    summary = (f"{sum('us' in row for row in kernel)}/{len(kernel)} settings measured on {len(best)} shapes"
               f"{f', {wrong} WRONG' if wrong else ''}{f', {failed} failed' if failed else ''}; {cudnn_text}")
    return {"ok": bool(best) and not wrong, "summary": summary, "copy_gb_per_s": copy, "rows": rows, "best": best,
            "cudnn": cudnn}


def run(step: Step) -> dict:
    """Step 5: every shape and setting, then cuDNN on every shape (the result so far saved after each); per shape, the
    kernel's best setting and its share of copy bandwidth, and cuDNN's against it."""
    plan = step.plan
    copy = step.copy_gbps()
    print(f"copy bandwidth (step 4): {'not measured: no shares' if copy is None else f'{copy:.0f} GB/s'}")
    rows = []
    shapes = [(batch, context) for context in plan.decode_contexts for batch in plan.decode_batches]
    for batch, context in shapes:
        try:
            rows += measure_shape(batch, context, step, copy)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory making the inputs
            traceback.print_exc(limit=-4)
            rows.append({"batch": batch, "context": context, "label": "inputs", "error": error_text(exc)})
            print(describe(rows[-1]), flush=True)
        step.save_partial("decode", result(rows, copy))
    unavailable = cudnn_paged.unavailable()  # after the kernel's shapes, which the decision reads
    for batch, context in shapes:
        rows.append(measure_cudnn(batch, context, step, copy, unavailable))
        step.save_partial("decode", result(rows, copy))
    final = result(rows, copy)
    for row in final["best"]:
        share = "" if row["copy_share"] is None else f", {100 * row['copy_share']:.0f}% of copy"
        print(f"best B={row['batch']} ctx={row['context']}: {row['label']}: {row['gb_per_s']:.0f} GB/s{share}")
    for row in final["cudnn"]:
        share = "" if row["copy_share"] is None else f", {100 * row['copy_share']:.0f}% of copy"
        ratio = "" if row["over_kernel"] is None else f", {row['over_kernel']:.2f}x the kernel's best time"
        print(f"cudnn B={row['batch']} ctx={row['context']}: {row['gb_per_s']:.0f} GB/s{share}{ratio}"
              f"{'' if row['right'] else ', WRONG'}")
    return final
