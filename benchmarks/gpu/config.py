"""What the GPU check measures: the H200 plan (Llama-3.1-8B attention shapes) and its tiny CPU twin.

`FULL` is sized for one run of under 8 minutes on an H200. `TINY` runs the same code on the CPU in
Pallas interpret mode at shapes small enough for a test; its numbers only show that the code runs.
"""

from __future__ import annotations

import dataclasses

# the measuring steps (modules of benchmarks/gpu), in the order gpu_check.sh runs them; 11 is the summary
STEP_NAMES = ("env", "compiles", "checks", "bandwidth", "decode", "fallback", "prefill", "kv_write", "fp8", "e2e")


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
    e2e: dict  # options of `jaxserve bench throughput` (step 10)

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
    copy_variants=(
        CopyVariant("add", "bfloat16", 2048),  # what the first H200 run measured (2424 GB/s)
        CopyVariant("add", "bfloat16", 2048, 8),
        CopyVariant("add", "float32", 2048, 8),
        CopyVariant("add", "uint32", 2048, 8),
        CopyVariant("add", "bfloat16", 8192, 4),
        CopyVariant("add", "uint32", 8192, 4),
        CopyVariant("copy", "uint32", 2048),
        CopyVariant("copy", "uint32", 8192),
    ),
    copy_repeats=10,
    decode_batches=(8, 64),
    decode_contexts=(32768, 8192, 2048),  # longest first: if time runs out, the decision's shapes are done
    decode_splits=(None, 1, 4, 16, 64),  # 64: one row of 8 KV heads launches 512 programs, about 4 per SM
    decode_launch=((4, 2), (8, 2), (4, 3), (8, 3)),
    decode_pages_per_step=(1, 2, 4),
    decode_repeats=10,
    goal_context=8192,
    fallback_batches=(8, 64),
    fallback_contexts=(8192, 2048),
    prefill_chunks=4,
    prefill_chunk_len=512,
    prefill_prefixes=(0, 2048),
    kv_write_tokens=(64, 2048),
    kv_write_pool_pages=4096,
    fp8=dict(model_shape="llama-3.1-8b", batch=64, context=2048, warmup=2, repeats=10),
    e2e=dict(
        model_shape="llama-3.1-8b", num_requests=128, input_len=1000, output_len=1000, max_model_len=2048,
        page_size=16, max_num_seqs=128, max_num_batched_tokens=2048, min_token_bucket=256,
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
    e2e=dict(
        model_shape="bundled", num_requests=4, input_len=8, output_len=4, max_model_len=16, page_size=16,
        max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=16, warmup_requests=1, warmup_tokens=1,
    ),
)


def plan_for(tiny: bool) -> Plan:
    """The tiny CPU plan or the H200 plan."""
    return TINY if tiny else FULL
