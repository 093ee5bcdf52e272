"""What the GPU check measures: the H200 plan (Llama-3.1-8B attention shapes) and its tiny CPU twin.

`FULL` is sized for one run of under 8 minutes on an H200. `TINY` runs the same code on the CPU in
Pallas interpret mode at shapes small enough for a test; its numbers only show that the code runs.
"""

from __future__ import annotations

import dataclasses

# the measuring steps (modules of benchmarks/gpu), in the order gpu_check.sh runs them; 14 is the summary
STEP_NAMES = ("env", "compiles", "checks", "bandwidth", "decode", "fallback", "prefill", "kv_write", "fp8", "flags",
              "profile", "hf_peer", "e2e")


@dataclasses.dataclass(frozen=True)
class Model:
    """One layer of attention: heads, KV heads, head dim and dtype (a name, so this module needs no jax)."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype: str


@dataclasses.dataclass(frozen=True)
class CopyVariant:
    """One way to measure device-to-device bandwidth: a jitted `x + 1` (`add`), `chain` times per dispatch,
    or a jitted copy of the buffer (`copy`: XLA copies the argument into a fresh output, once a dispatch)."""

    kind: str  # "add" or "copy"
    dtype: str  # "bfloat16", "float32" or "uint32" (the same bytes viewed as another element type)
    mib: int  # buffer size
    chain: int = 1  # add: calls per dispatch, each reading the previous one's output (a barrier apart)

    @property
    def name(self) -> str:
        """Short label, e.g. 'add uint32 2048 MiB x8'."""
        return f"{self.kind} {self.dtype} {self.mib} MiB x{self.chain}"


@dataclasses.dataclass(frozen=True)
class Setting:
    """Launch settings of the paged decode kernel."""

    num_splits: int | None  # None: the kernel's automatic choice
    num_warps: int
    num_stages: int
    pages_per_step: int

    def label(self, auto_splits: int) -> str:
        """e.g. 'splits auto(8) warps 4 stages 2 pages/step 1'."""
        splits = f"auto({auto_splits})" if self.num_splits is None else str(self.num_splits)
        return f"splits {splits} warps {self.num_warps} stages {self.num_stages} pages/step {self.pages_per_step}"


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every size the steps use."""

    tiny: bool
    model: Model
    page_sizes: tuple[int, ...]  # step 2 compiles every kernel for each; the first is used everywhere else
    check_names: tuple[str, ...] | None  # step 3: None = every correctness check
    copy_variants: tuple[CopyVariant, ...]
    copy_repeats: int
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_splits: tuple[int | None, ...]  # None = the kernel's automatic choice
    decode_launch: tuple[tuple[int, int], ...]  # (num_warps, num_stages); the first is the kernel's default
    decode_pages_per_step: tuple[int, ...]  # the first is the kernel's default
    decode_repeats: int
    goal_context: int  # the decision looks at decode contexts >= this
    fallback_batches: tuple[int, ...]
    fallback_contexts: tuple[int, ...]
    prefill_chunks: int  # rows of one prefill step ...
    prefill_chunk_len: int  # ... each this many new tokens ...
    prefill_prefixes: tuple[int, ...]  # ... after this many cached tokens
    kv_write_tokens: tuple[int, ...]
    kv_write_pool_pages: int  # pages of the one-layer pool the writes land in
    fp8: dict  # step 9: model_shape, batch (rows), context, warmup, repeats of the whole-model decode step
    flag_variants: tuple[str, ...] | None  # step 10: the XLA flag variants run (flags.VARIANTS' names); None = all
    # step 11: model_shape; a decode step of `batch` rows at `context`, and a mixed one adding a `chunk`-token
    # prompt; `warmup` untimed steps of each, then `repeats` profiled ones
    profile: dict
    # step 12: model_shape, device, input_len / output_len per request; `continuous_requests` requests through
    # transformers' continuous batching (`continuous_config`: ContinuousBatchingConfig fields, `continuous_warmup`:
    # capture its CUDA graphs first); `generate_batches`: static batch sizes of `generate`, in the order tried;
    # `calibration_tokens` (two short runs estimate each long one; `growth`: how much slower the average step of
    # the long run is than a short run's, its context being longer)
    hf_peer: dict
    e2e: dict  # options of `jaxserve bench throughput` (step 13)

    @property
    def interpret(self) -> bool:
        """Whether the Pallas kernels run in the interpreter (the tiny plan, on the CPU)."""
        return self.tiny

    @property
    def page_size(self) -> int:
        """The page size of every step after the compile step."""
        return self.page_sizes[0]

    def default_setting(self) -> Setting:
        """The decode kernel's defaults: automatic splits, the first launch and pages per step of the plan."""
        return Setting(None, *self.decode_launch[0], self.decode_pages_per_step[0])

    def is_default(self, row: dict) -> bool:
        """Whether a saved decode row was measured at the default setting."""
        return row.get("setting") == dataclasses.asdict(self.default_setting())


FULL = Plan(
    tiny=False,
    model=Model(heads=32, kv_heads=8, head_dim=128, dtype="bfloat16"),  # Llama-3.1-8B attention
    page_sizes=(16, 8),
    check_names=None,
    # the best three of the eight ways the 2026-11-30 run measured (4077, 3946 and 3945 GB/s)
    copy_variants=(
        CopyVariant("add", "uint32", 8192, 4),
        CopyVariant("copy", "uint32", 8192),
        CopyVariant("add", "uint32", 2048, 8),
    ),
    copy_repeats=10,
    decode_batches=(8, 64),
    decode_contexts=(32768, 8192, 2048),  # longest first: if time runs out, the decision's shapes are done
    # The kernel's defaults only (automatic splits, 4 warps, 2 stages, one page a loop step): the best settings of
    # the 2026-11-30 and 2026-12-04 sweeps (docs/benchmarks.md), which the split rule now picks.
    decode_splits=(None,),
    decode_launch=((4, 2),),
    decode_pages_per_step=(1,),
    decode_repeats=10,
    goal_context=8192,
    fallback_batches=(8, 64),  # at 8k, where 2026-12-04 measured the xla path at 2.9x and 3.8x the Pallas backend
    fallback_contexts=(8192,),
    prefill_chunks=4,
    prefill_chunk_len=512,
    prefill_prefixes=(0, 2048),
    kv_write_tokens=(64, 2048),
    kv_write_pool_pages=4096,
    fp8=dict(model_shape="llama-3.1-8b", batch=64, context=2048, warmup=2, repeats=5),
    flag_variants=None,
    profile=dict(model_shape="llama-3.1-8b", batch=128, context=1500, chunk=512, warmup=2, repeats=3),
    hf_peer=dict(
        model_shape="llama-3.1-8b", device="cuda", input_len=1000, output_len=1000, continuous_requests=64,
        continuous_config={}, continuous_warmup=True, generate_batches=(128, 64), calibration_tokens=16, growth=1.3,
    ),
    # Throughput as a user chasing it runs the engine: 256 rows a step and 4096-token steps. All 256 requests run
    # at once: with fixed lengths more requests would come in waves of 256, each as fast as this one.
    e2e=dict(
        model_shape="llama-3.1-8b", num_requests=256, input_len=1000, output_len=1000, max_model_len=2048,
        page_size=16, max_num_seqs=256, max_num_batched_tokens=4096, min_token_bucket=64,
        warmup_requests=2, warmup_tokens=4,
    ),
)

TINY = Plan(
    tiny=True,
    model=Model(heads=4, kv_heads=2, head_dim=32, dtype="bfloat16"),
    page_sizes=(16,),
    check_names=("decode float32 num_splits=3, 2 pages a step", "kv write bfloat16"),
    copy_variants=(CopyVariant("add", "bfloat16", 4), CopyVariant("add", "uint32", 4, 4),
                   CopyVariant("copy", "uint32", 4)),
    copy_repeats=3,
    decode_batches=(2,),
    decode_contexts=(64,),
    decode_splits=(None,),
    decode_launch=((4, 2), (8, 3)),
    decode_pages_per_step=(1, 2),
    decode_repeats=2,
    goal_context=64,
    fallback_batches=(2,),
    fallback_contexts=(64,),
    prefill_chunks=2,
    prefill_chunk_len=16,
    prefill_prefixes=(32,),
    kv_write_tokens=(8,),
    kv_write_pool_pages=16,
    fp8=dict(model_shape="llama-small", batch=2, context=32, warmup=2, repeats=2),
    # One variant: each runs the same child (a process starting jax and building the model, ~3.5 s here) under
    # other XLA_FLAGS, which the CPU ignores; the others are reported as not run.
    flag_variants=("dynamic-slice fusion on",),
    profile=dict(model_shape="llama-small", batch=4, context=40, chunk=16, warmup=1, repeats=2),
    hf_peer=dict(
        model_shape="llama-small", device="cpu", input_len=16, output_len=8, continuous_requests=4,
        # transformers sizes its cache from the device's memory unless told (slow on a CPU), and has no graphs here
        continuous_config=dict(page_size=16, num_blocks=64, max_batch_tokens=64, max_requests_per_batch=4),
        # one static batch size: a second would run the same code again (its runs and a gc, ~0.3 s here)
        continuous_warmup=False, generate_batches=(4,), calibration_tokens=2, growth=1.3,
    ),
    e2e=dict(
        model_shape="bundled", num_requests=4, input_len=8, output_len=4, max_model_len=16, page_size=16,
        max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=16, warmup_requests=1, warmup_tokens=1,
    ),
)


def plan_for(tiny: bool) -> Plan:
    """The tiny CPU plan or the H200 plan."""
    return TINY if tiny else FULL
