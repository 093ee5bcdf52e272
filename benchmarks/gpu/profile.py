"""Step 11: where the time of an engine step at the Llama-3.1-8B shape goes, by op, from a profiler trace.

The model is step 9's (fp8.py): Llama-3.1-8B's shape with random bf16 weights made on the device
(load_format "dummy"), the engine's forward over the `auto` attention backend (the tiny plan: llama-small
and the `xla` backend), jitted with the pool donated as the engine does. Two kinds of step, each the forward
(the KV write inside it) then the sampler in its own jit (as the runner dispatches them), synced once at the
end, at their exact sizes (no bucket padding):
- decode: B rows of one new token each at context C, pages of their own;
- mixed: the same rows plus one fresh prompt chunk of P tokens (the engine's chunked prefill beside decodes).
The sampler draws from all R rows' (R, V) logits with temperature 0.8 and top-p 0.95 (every row sampled:
its top-p sort is part of the cost; `jaxserve bench throughput` samples greedily, which skips it).

Each kind runs `warmup` untimed steps (the first compiles); then, under `jax.profiler.trace` and after one
unannotated step that takes the profiler's start-up, `repeats` steps of each kind, each inside a
`jax.profiler.TraceAnnotation` spanning its dispatch until its tokens are ready. A kind not warmed up by the
step's deadline is left out. The trace jax writes (plugins/profile/<run>/*.trace.json.gz, Chrome trace format)
is parsed here:
- device events: those of the processes named "/device:..." ("/device:GPU:0"), on their stream threads, not
  on the lines derived from them ("XLA Modules", "XLA Ops", "Steps", ...: the same time again); in a trace
  without a device process (the CPU), the host events XLA's runtime records per op (they carry `hlo_op`).
  Host events nest (a control-flow op holds the ops it runs): each event counts its own time, less that of
  the events inside it;
- each device event belongs to the step whose annotation holds its start, and to one category (CATEGORIES:
  by its module, then its name and `hlo_op`, then its `long_name`; see `category_of`). Unknown names go to
  "other" and are listed, so the next run says what to add.
Per kind, per step (means over the kind's steps): device time by category and its share of the step's wall
time (the annotation's length; the shares add up to more than the busy share where ops run side by side: the
CPU's threads, a GPU's streams), device busy time (the union of the events' intervals), the host gap (wall -
busy: dispatch, Python, the sync at the end; the engine plans its next step while the device runs, but not
the launches between and inside its two executables) and the 20 kernels that took the most time. The trace is
kept as profile.trace.json.gz.
"""

from __future__ import annotations

import bisect
import collections
import glob
import gzip
import json
import math
import os
import re
import shutil
import time

import numpy as np

from benchmarks.gpu.step import Step

ANNOTATION = "gpu_check profile"  # each profiled step: a TraceAnnotation "gpu_check profile <kind> <i>"
SAMPLER_NAME = "profile_sampler"  # the sampler's jitted function: its XLA module is "jit_profile_sampler"
TRACE_FILE = "profile.trace.json.gz"  # the raw trace, kept in the work folder (the shell copies it to $OUT)
TOP_KERNELS = 20
OTHER_NAMES = 30  # at most this many names listed for the "other" category
NAME_CHARS = 160  # kernel names (cuBLAS, CUTLASS) can be very long: cut to this
TEMPERATURE, TOP_P = 0.8, 0.95
NEST_SLACK_US = 0.002  # an event ending this little after the one holding it is still inside it (rounding)

# Lines of a device process that jax's trace derives from the stream events (each repeats their time).
DERIVED_LINES = ("Steps", "XLA Modules", "XLA Ops", "Async XLA Ops", "Framework Ops", "Framework Name Scope",
                 "TensorFlow Ops", "TensorFlow Name Scope", "Source code", "Launch Stats", "Host Offload Ops",
                 "CUPTI overhead", "_counters_", "Sparse Core Steps", "Sparse Core Modules")
MODULE_LINE = "XLA Modules"

CATEGORIES = ("attention: decode kernel", "attention: ragged kernel", "attention: xla / cuDNN", "KV write", "GEMM",
              "sampler", "norm / RoPE / elementwise", "copies / transposes / gathers", "collectives", "other")
# (category, substrings, whole words) of a lower-case name, in order: the first that matches wins. The sampler is
# first recognised by its module (SAMPLER_NAME); its rule here catches its kernels when the trace has no module.
# A scatter is a page copy (copy-on-write, which every step runs, null page onto itself when nothing is shared),
# except under the xla backend (the CPU), whose KV write is a scatter too: there the KV write counts as a copy.
RULES = (
    ("attention: decode kernel", ("paged_decode", "decode_attention", "flash_decod"), ()),
    ("attention: ragged kernel", ("ragged_paged", "ragged_attention"), ()),
    ("KV write", ("paged_kv_write", "kv_write", "write_kv"), ()),
    ("collectives", ("all-reduce", "all_reduce", "allreduce", "all-gather", "all_gather", "allgather",
                     "reduce-scatter", "reduce_scatter", "collective-permute", "collective_permute", "all-to-all",
                     "all_to_all", "nccl"), ()),
    ("attention: xla / cuDNN", ("attention", "fmha", "flash", "sdpa", "softmax"), ()),
    ("GEMM", ("gemm", "cublas", "cutlass", "nvjet", "xmma", "wgmma", "hgmma", "gemv", "matmul", "ynn_fusion",
              "__onednn$matmul"), ("dot", "convolution")),
    ("sampler", ("sort", "topk", "top_k", "radix", "cub::"), ()),
    ("copies / transposes / gathers", ("memcpy", "memset", "copy", "transpose", "gather", "scatter", "concatenate",
                                       "dynamic-slice", "dynamic_slice", "dynamic-update-slice",
                                       "dynamic_update_slice"), ("slice", "pad")),
    ("norm / RoPE / elementwise", ("fusion", "wrapped_", "elementwise", "reduce", "convert", "rsqrt",
                                   "exponential", "broadcast", "multiply", "subtract", "divide"),
     ("add", "sqrt", "exp", "log", "sine", "cosine", "select", "iota", "compare", "negate", "maximum", "minimum",
      "power", "tanh", "logistic", "and", "or", "not", "xor", "clamp", "abs", "floor", "ceil", "sign", "erf",
      "bitcast", "reshape", "rng")),
)


# ---- the trace ----------------------------------------------------------------------------------------------------

def find_trace(log_dir: str) -> str:
    """The newest *.trace.json.gz jax wrote under `log_dir` (plugins/profile/<run>/)."""
    paths = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    if not paths:
        raise FileNotFoundError(f"no plugins/profile/*/*.trace.json.gz under {log_dir}")
    return max(paths, key=os.path.getmtime)


def load_trace(path: str) -> dict:
    """A Chrome-format trace: {"traceEvents": [...], ...}."""
    with gzip.open(path, "rt") as f:
        return json.load(f)


def names_of(events: list[dict]) -> tuple[dict, dict]:
    """({pid: process name}, {(pid, tid): thread name}) from the trace's metadata events."""
    processes, threads = {}, {}
    for event in events:
        if event.get("ph") != "M":
            continue
        name = (event.get("args") or {}).get("name", "")
        if event.get("name") == "process_name":
            processes[event.get("pid")] = name
        elif event.get("name") == "thread_name":
            threads[(event.get("pid"), event.get("tid"))] = name
    return processes, threads


def is_derived_line(name: str) -> bool:
    """Whether a device thread is a line derived from the streams (its events repeat their time)."""
    return name in DERIVED_LINES or name.startswith("XLA ") or name.startswith("Framework ")


def device_events(trace: dict) -> tuple[list[dict], str]:
    """(the complete events of kernels and copies, where they came from).

    The stream threads of the "/device:..." processes when the trace has any events there; else (the CPU) the
    host events XLA's CPU runtime records for each op (they carry `hlo_op`), without their "end: ..." markers."""
    events = trace.get("traceEvents", [])
    processes, threads = names_of(events)
    devices = {pid for pid, name in processes.items() if str(name).startswith("/device:")}
    found = [e for e in events if e.get("ph") == "X" and e.get("pid") in devices and "dur" in e
             and not is_derived_line(threads.get((e.get("pid"), e.get("tid")), ""))]
    if found:
        names = sorted({str(processes[pid]) for pid in devices})
        return found, f"device streams of {', '.join(names)}"
    found = [e for e in events if e.get("ph") == "X" and "dur" in e and (e.get("args") or {}).get("hlo_op")
             and not str(e.get("name", "")).startswith("end: ")]
    return found, "host events of XLA ops (no device process in the trace)"


def module_spans(trace: dict) -> dict:
    """{pid: sorted [(start, end, module name)]} of the "XLA Modules" lines of device processes, which say
    which executable a kernel without an `hlo_module` of its own ran in."""
    events = trace.get("traceEvents", [])
    _, threads = names_of(events)
    spans = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e and threads.get((e.get("pid"), e.get("tid"))) == MODULE_LINE:
            spans[e["pid"]].append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e.get("name", ""))))
    return {pid: sorted(found) for pid, found in spans.items()}


def module_of(event: dict, spans: dict) -> str:
    """The XLA module an event ran in: its own `hlo_module` arg, else the "XLA Modules" span holding its start."""
    module = (event.get("args") or {}).get("hlo_module")
    if module:
        return str(module)
    found = spans.get(event.get("pid"), [])
    start = float(event["ts"])
    i = bisect.bisect_right(found, (start, math.inf, "")) - 1
    return found[i][2] if i >= 0 and found[i][0] <= start <= found[i][1] else ""


def step_windows(trace: dict, prefix: str = ANNOTATION) -> dict[str, list[tuple[float, float]]]:
    """{kind: [(start, end) of each annotated step, in order]} from the events named "<prefix> <kind> <i>"."""
    windows = collections.defaultdict(list)
    pattern = re.compile(rf"^{re.escape(prefix)} (\S+) (\d+)$")
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and "dur" in e and (match := pattern.match(str(e.get("name", "")))):
            windows[match[1]].append((int(match[2]), float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    return {kind: [(start, end) for _, start, end in sorted(found)] for kind, found in windows.items()}


def category_of(name: str, hlo_op: str = "", module: str = "", long_name: str = "") -> str:
    """The category (CATEGORIES) of a device event: the sampler by its module, else the first rule (RULES) matching
    its name or `hlo_op`, else one matching its `long_name` (the HLO text, where the trace has it), else "other"."""
    if SAMPLER_NAME in module:
        return "sampler"
    for text in (f"{name} {hlo_op}", long_name):
        text = text.lower()
        words = set(re.split(r"[^a-z0-9]+", text))
        for category, substrings, whole_words in RULES:
            if any(s in text for s in substrings) or words.intersection(whole_words):
                return category
    return "other"


def self_times(events: list[dict]) -> list[float]:
    """Each event's own time: its duration less that of the events nested in it on its thread (the CPU's control
    flow ops hold the ops they run; kernels on a GPU stream do not nest, and keep their whole duration)."""
    own = [float(e["dur"]) for e in events]
    by_thread = collections.defaultdict(list)
    for i, e in enumerate(events):
        by_thread[(e.get("pid"), e.get("tid"))].append(i)
    for indices in by_thread.values():
        indices.sort(key=lambda i: (float(events[i]["ts"]), -float(events[i]["dur"])))
        stack: list[tuple[float, int]] = []  # (end, index) of the events holding the current one
        for i in indices:
            start, end = float(events[i]["ts"]), float(events[i]["ts"]) + float(events[i]["dur"])
            while stack and stack[-1][0] + NEST_SLACK_US < end:  # not inside the top one: that one is closed
                stack.pop()
            if stack and start >= float(events[stack[-1][1]]["ts"]):
                own[stack[-1][1]] -= float(events[i]["dur"])
            stack.append((end, i))
    return [max(t, 0.0) for t in own]


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) intervals."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def breakdown(trace: dict, prefix: str = ANNOTATION) -> dict:
    """Per annotated kind of step: device time by category, wall time, device busy time, host gap and the top
    kernels, all per step (means over the kind's steps); and the device events no step holds."""
    events, source = device_events(trace)
    spans = module_spans(trace)
    windows = step_windows(trace, prefix)
    starts = sorted((start, end, kind, i) for kind, found in windows.items() for i, (start, end) in enumerate(found))
    opens = [start for start, *_ in starts]
    per_step = collections.defaultdict(list)  # (kind, i) -> [event]
    unassigned = []
    for e in events:
        ts = float(e["ts"])
        j = bisect.bisect_right(opens, ts) - 1
        if j >= 0 and ts <= starts[j][1]:
            per_step[(starts[j][2], starts[j][3])].append(e)
        else:
            unassigned.append(e)
    kinds = {}
    for kind, found in windows.items():
        kinds[kind] = kind_breakdown([per_step[(kind, i)] for i in range(len(found))], found, spans)
    return {"source": source, "kinds": kinds, "unassigned_events": len(unassigned),
            "unassigned_us": sum(float(e["dur"]) for e in unassigned)}


def kind_breakdown(steps: list[list[dict]], windows: list[tuple[float, float]], spans: dict) -> dict:
    """The breakdown of one kind of step from its steps' device events and annotation windows."""
    count = len(steps)
    by_category = collections.Counter()
    kernels: dict[str, dict] = {}
    busy = []
    for found in steps:
        busy.append(union_us([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in found]))
        for e, own in zip(found, self_times(found)):
            args = e.get("args") or {}
            name = str(e.get("name", ""))
            module = module_of(e, spans)
            category = category_of(name, str(args.get("hlo_op", "")), module, str(args.get("long_name", "")))
            by_category[category] += own
            kernel = kernels.setdefault(name, {"name": name[:NAME_CHARS], "category": category, "us": 0.0,
                                               "calls": 0, "hlo_op": str(args.get("hlo_op", ""))[:NAME_CHARS],
                                               "module": module[:NAME_CHARS]})
            kernel["us"] += own
            kernel["calls"] += 1
    wall = float(np.mean([end - start for start, end in windows]))
    busy_us = float(np.mean(busy))
    for kernel in kernels.values():
        kernel["us"] /= count
        kernel["calls"] /= count
    ranked = sorted(kernels.values(), key=lambda k: -k["us"])
    categories = [{"category": c, "us": by_category[c] / count, "share": by_category[c] / count / wall}
                  for c in CATEGORIES if by_category[c]]
    return {
        "steps": count, "wall_us": wall, "wall_us_each": [end - start for start, end in windows],
        "busy_us": busy_us, "device_sum_us": sum(by_category.values()) / count, "host_gap_us": wall - busy_us,
        "events_per_step": sum(len(found) for found in steps) / count, "categories": categories,
        "top_kernels": ranked[:TOP_KERNELS],
        "other_names": [{"name": k["name"], "us": k["us"], "hlo_op": k["hlo_op"]} for k in ranked
                        if k["category"] == "other"][:OTHER_NAMES],
    }


def table(kind: str, found: dict) -> list[str]:
    """The printed table of one kind: category, us per step, % of the step's wall time."""
    lines = [f"profile {kind}: {found['steps']} steps, wall {found['wall_us']:.0f} us a step",
             f"  {'category':<32} {'us/step':>10} {'% of step':>9}"]
    for row in found["categories"]:
        lines.append(f"  {row['category']:<32} {row['us']:10.1f} {100 * row['share']:8.1f}%")
    for label, key in (("device busy (union)", "busy_us"), ("host gap (wall - busy)", "host_gap_us"),
                       ("step wall", "wall_us")):
        lines.append(f"  {label:<32} {found[key]:10.1f} {100 * found[key] / found['wall_us']:8.1f}%")
    if found["other_names"]:
        names = ", ".join(f"{o['name'][:60]} ({o['us']:.1f} us)" for o in found["other_names"][:8])
        lines.append(f"  other: {names}")
    return lines


# ---- the steps ----------------------------------------------------------------------------------------------------

def step_batch(rows: list[tuple[int, int]], page_size: int, vocab: int, seed: int):
    """(BatchDescriptor, pages used) of one step whose row r computes rows[r] = (cached, new) tokens: `new`
    tokens after `cached` cached ones, on pages of its own (1, 2, ... in row order), random token ids."""
    import jax.numpy as jnp

    from jaxserve.batch.builder import padded_batch_arrays
    from jaxserve.batch.descriptor import BatchDescriptor

    num_tokens = sum(new for _, new in rows)
    width = max(-(-(cached + new) // page_size) for cached, new in rows)
    arrays = padded_batch_arrays(num_tokens, len(rows), width, page_size)
    arrays["input_ids"][:] = np.random.default_rng(seed).integers(4, vocab, num_tokens)  # (T,)
    next_page, start = 1, 0
    for row, (cached, new) in enumerate(rows):
        pages = next_page + np.arange(-(-(cached + new) // page_size), dtype=np.int32)  # (n,) the row's own pages
        next_page += len(pages)
        positions = np.arange(cached, cached + new, dtype=np.int32)  # (new,)
        arrays["positions"][start:start + new] = positions
        arrays["slot_mapping"][start:start + new] = pages[positions // page_size] * page_size + positions % page_size
        arrays["query_start_loc"][row] = start
        arrays["seq_lens"][row] = cached + new
        arrays["page_table"][row, :len(pages)] = pages
        arrays["logits_indices"][row] = start + new - 1
        start += new
    arrays["query_start_loc"][len(rows)] = num_tokens
    arrays["num_seqs"] = np.asarray(len(rows), np.int32)
    return BatchDescriptor(**{name: jnp.asarray(value) for name, value in arrays.items()}), next_page


def sampling_batch(num_rows: int, seed: int):
    """A SamplingBatch of R rows, each sampling with temperature 0.8 and top-p 0.95 (no penalties, no logprobs)."""
    import jax.numpy as jnp

    from jaxserve.batch.builder import padded_sampling_arrays
    from jaxserve.sampling.sampler import SamplingBatch

    arrays = padded_sampling_arrays(num_rows, 0)
    arrays["temperature"][:] = TEMPERATURE
    arrays["top_p"][:] = TOP_P
    arrays["seeds"][:] = np.random.default_rng(seed).integers(0, 2**32, (num_rows, 2), dtype=np.uint32)
    arrays["sample_index"][:] = 100
    return SamplingBatch(**{name: jnp.asarray(value) for name, value in arrays.items()})


def build(step: Step) -> dict:
    """The model on the device, its jitted forward and sampler, the pool and the inputs of each kind of step."""
    import jax

    from benchmarks.gpu.common import zero_kv_pool
    from jaxserve.attention import make_attention
    from jaxserve.bench.models import SHAPES, hf_config
    from jaxserve.config import EngineConfig
    from jaxserve.model.checkpoint import load_weights
    from jaxserve.model.registry import model_for
    from jaxserve.sharding import make_mesh
    from jaxserve.model.registry import spec_from_hf_config
    from jaxserve.sampling.sampler import sample

    plan, options = step.plan, step.plan.profile
    page_size, rows, context, chunk = plan.page_size, options["batch"], options["context"], options["chunk"]
    spec = spec_from_hf_config(hf_config(SHAPES[options["model_shape"]]))
    mesh = make_mesh(1)
    config = EngineConfig(model=options["model_shape"], load_format="dummy", dtype=plan.model.dtype, seed=step.seed)
    params, dtype = load_weights(config, config.model_config.model, spec, mesh, spec.num_kv_heads)
    backend = make_attention(spec, "xla" if plan.tiny else "auto", mesh, page_size)
    decode_rows = [(context - 1, 1)] * rows  # each row: its last token after context - 1 cached ones
    decode, _ = step_batch(decode_rows, page_size, spec.vocab_size, step.seed)
    mixed, num_pages = step_batch(decode_rows + [(0, chunk)], page_size, spec.vocab_size, step.seed + 1)
    shapes = backend.cache_shapes(spec.num_layers, num_pages, page_size, spec.num_kv_heads, spec.head_dim)
    caches = zero_kv_pool(shapes, dtype, mesh)  # each (L, P, S, Hkv, D)
    model_forward = model_for(spec.architecture).make_forward(spec, backend.attention, backend.write_kv, mesh)

    def profile_forward(params, caches, batch):
        return model_forward(params, caches, batch)  # (logits (R, V) float32, hidden (T, H), caches)

    def profile_sampler(logits, sampling):
        return sample(logits, sampling).token_ids  # (R,) int32

    assert profile_sampler.__name__ == SAMPLER_NAME
    return {
        "params": params, "caches": caches, "backend": backend.name, "vocab": spec.vocab_size,
        "forward": jax.jit(profile_forward, donate_argnums=1), "sampler": jax.jit(profile_sampler),
        "kinds": {"decode": (decode, sampling_batch(rows, step.seed)),
                  "mixed": (mixed, sampling_batch(rows + 1, step.seed + 1))},
        "shapes": {"decode": {"rows": rows, "tokens": rows, "context": context},
                   "mixed": {"rows": rows + 1, "tokens": rows + chunk, "context": context, "chunk": chunk}},
        "pool_pages": num_pages,
    }


def run(step: Step) -> dict:
    """Step 11: warm up each kind of step, profile `repeats` of each, and break the trace down; ok when every kind
    was profiled and its device events were found."""
    import jax

    options = step.plan.profile
    started = time.monotonic()
    built = build(step)
    print(f"profile: {options['model_shape']} weights and a pool of {built['pool_pages']} pages of "
          f"{step.plan.page_size} in {time.monotonic() - started:.1f} s; attention backend {built['backend']}",
          flush=True)
    state = {"caches": built["caches"]}

    def one_step(kind: str) -> None:
        batch, sampling = built["kinds"][kind]
        logits, _, state["caches"] = built["forward"](built["params"], state["caches"], batch)
        built["sampler"](logits, sampling).block_until_ready()

    kinds, first_s = [], {}
    for kind in built["kinds"]:
        if step.out_of_time():
            print(f"profile {kind}: skipped, out of time", flush=True)
            continue
        start = time.monotonic()
        for _ in range(options["warmup"]):
            one_step(kind)
        first_s[kind] = time.monotonic() - start
        kinds.append(kind)
        print(f"profile {kind}: {options['warmup']} warm-up steps (compiles included) in {first_s[kind]:.1f} s",
              flush=True)
    log_dir = os.path.join(step.work_dir, "profile-trace")
    trace_options = {}
    if hasattr(jax.profiler, "ProfileOptions"):
        trace_options["profiler_options"] = jax.profiler.ProfileOptions()
        trace_options["profiler_options"].python_tracer_level = 0  # Python function events would slow the host
    with jax.profiler.trace(log_dir, **trace_options):
        if kinds:
            one_step(kinds[0])  # not annotated: the profiler's own start-up lands here, outside the profiled steps
        for kind in kinds:
            for i in range(options["repeats"]):
                with jax.profiler.TraceAnnotation(f"{ANNOTATION} {kind} {i}"):
                    one_step(kind)
    path = find_trace(log_dir)
    shutil.copy(path, os.path.join(step.work_dir, TRACE_FILE))
    found = breakdown(load_trace(path))
    print(f"profile: trace {os.path.getsize(path) / 1e6:.1f} MB, device events from the {found['source']}; "
          f"{found['unassigned_events']} outside the profiled steps ({found['unassigned_us']:.0f} us)", flush=True)
    for kind in kinds:
        if kind in found["kinds"]:
            print("\n".join(table(kind, found["kinds"][kind])), flush=True)
    result = {"model_shape": options["model_shape"], "backend": built["backend"], "page_size": step.plan.page_size,
              "sampling": {"temperature": TEMPERATURE, "top_p": TOP_P}, "shapes": built["shapes"],
              "warmup_s": first_s, **found}
    profiled = [kind for kind in built["kinds"] if found["kinds"].get(kind, {}).get("events_per_step")]
    summary = "; ".join(f"{kind} {found['kinds'][kind]['wall_us'] / 1e3:.2f} ms a step, "
                        f"{100 * found['kinds'][kind]['host_gap_us'] / found['kinds'][kind]['wall_us']:.0f}% host gap"
                        for kind in profiled) or f"no device events in the profiled steps ({found['source']})"
    return {"ok": len(profiled) == len(built["kinds"]), "summary": summary, **result}
