"""Runner: owns params and the KV pages, compiles every bucket ahead of time, runs one step.

The runner never sees a Request: it takes a BatchDescriptor and a SamplingBatch (numpy, padded)
and returns numpy samples. The KV caches are donated to the forward executable, so the pool is
updated in place.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.attention import make_attention
from jaxserve.batch.buckets import pick_bucket
from jaxserve.batch.builder import (
    BucketLadders,
    padded_batch_arrays,
    padded_decode_step_arrays,
    padded_pooling_arrays,
    padded_prompt_logprob_arrays,
    padded_proposal_arrays,
    padded_sampling_arrays,
)
from jaxserve.batch.descriptor import BatchDescriptor, DecodeSteps, PoolingBatch, PromptLogprobBatch
from jaxserve.batch.packing import Layout, pack, packed_layout
from jaxserve.batch.repad import repad_batch, repad_prompt, repad_sampling
from jaxserve.model.eagle import TargetFeatures
from jaxserve.model.loader import SafetensorsFolder, TensorMapping
from jaxserve.model.lora import write_slot
from jaxserve.model.registry import model_for
from jaxserve.model.weight_update import quantized_at_load, reload_params, undeclared_leaves
from jaxserve.model_spec import ModelSpec
from jaxserve.runner.executables import (
    CompileCounter,
    abstract_arguments,
    compile_all,
    compile_here,
    share_executable,
    shared_executable,
)
from jaxserve.runner.host_swap import HostSwap
from jaxserve.runner.step_functions import StepProgram, build_step_functions
from jaxserve.sampling.sampler import SamplingBatch, bitmask_width
from jaxserve.sampling.verify import Proposals
from jaxserve.sharding import KV_CACHE_SPEC, put_global

logger = logging.getLogger("jaxserve")


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Raw-distribution logprobs of some tokens (numpy, real entries only)."""

    logprobs: np.ndarray  # (N,) float32 log-prob of each token
    ranks: np.ndarray  # (N,) int32 exact rank of each token (1 = most likely)
    top_token_ids: np.ndarray  # (N, K) int32 the K most likely tokens, most likely first
    top_logprobs: np.ndarray  # (N, K) float32 their logprobs

    @classmethod
    def fetch(cls, device_values, count: int) -> "TokenLogprobs":
        """The first `count` entries of (logprobs, ranks, top ids, top logprobs) device arrays."""
        logprobs, ranks, top_ids, top_lps = jax.device_get(device_values)
        return cls(logprobs[:count], ranks[:count], top_ids[:count], top_lps[:count])


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """Samples for the real rows of one step (numpy, on the host)."""

    token_ids: np.ndarray  # (S, num_seqs) int32: iteration s's sample of each row (S = 1 but in multi-step decodes)
    # of token_ids, logprobs_per_row entries a row (a verification's row r, position j at r * S + j); fetched
    # only when some row asked
    sampled_logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None  # of the PromptLogprobBatch's targets, when there was one
    logprobs_per_row: int = 1  # S in a verification, else 1
    pooled: np.ndarray | None = None  # (R or T, H) float32 each segment's sum of pooled states, when a row pooled


@dataclasses.dataclass
class ForwardStep:
    """A dispatched forward whose sampler is not dispatched yet."""

    logits: jax.Array  # (R, V) float32, on the device
    hidden: jax.Array  # (T, H) final hidden states of every step token, on the device (a verification reads them)
    prompt_scored: tuple | None  # the prompt-logprob executable's outputs, when the step scored prompt tokens
    num_seqs: int  # real rows
    num_prompt_targets: int  # real prompt-logprob entries
    pooled: jax.Array | None = None  # (R or T, H) float32 each segment's sum of pooled states ((R or T, labels) of a
    # classifier's class logits), when a row pooled


@dataclasses.dataclass
class PendingStep:
    """A dispatched step: device arrays the host has not fetched yet."""

    token_ids: jax.Array  # (R,) int32 samples of every row, or (K, R) for the K iterations of a multi-step decode
    # (logprobs, ranks, top ids, top logprobs) device arrays, when some row asked: one entry per row, or per
    # verified position (row r's position j at r * S + j) in a verification
    logprobs: tuple | None
    prompt_scored: tuple | None  # the prompt-logprob executable's outputs, when the step scored prompt tokens
    num_seqs: int  # real rows
    num_prompt_targets: int  # real prompt-logprob entries
    logprobs_per_row: int = 1  # logprobs entries of each row: S in a verification, else 1
    pooled: jax.Array | None = None  # (R or T, H) float32 each segment's sum of pooled states ((R or T, labels) of a
    # classifier's class logits), when a row pooled
    ready: concurrent.futures.Future | None = None  # resolves to time.perf_counter() when the device is done

    def fetch(self) -> StepOutput:
        """Wait for the device and copy the real rows' results to the host."""
        count = self.num_seqs
        sampled_logprobs = None
        if self.logprobs is not None:
            sampled_logprobs = TokenLogprobs.fetch(self.logprobs, count * self.logprobs_per_row)
        prompt_logprobs = None
        if self.prompt_scored is not None:
            prompt_logprobs = TokenLogprobs.fetch(self.prompt_scored, self.num_prompt_targets)
        pooled = None if self.pooled is None else np.asarray(jax.device_get(self.pooled))
        return StepOutput(np.atleast_2d(np.asarray(self.token_ids))[:, :count], sampled_logprobs, prompt_logprobs,
                          self.logprobs_per_row, pooled)


def activation_bytes(function: Callable, args: tuple) -> int:
    """Per-device bytes an executable needs beyond its inputs: temporaries plus outputs that do not alias a
    donated input (XLA's memory analysis)."""
    memory = function.lower(*args).compile().memory_analysis()
    return memory.temp_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes


def _subtree(tree: dict, like: dict) -> dict:
    """The part of the nested dict `tree` with the keys of `like` (a tree of its leaves' places)."""
    return {key: _subtree(tree[key], value) if isinstance(value, dict) else tree[key] for key, value in like.items()}


def _ready_time(arrays) -> float:
    """Block until `arrays` are computed; the time.perf_counter() at which they were."""
    jax.block_until_ready(arrays)
    return time.perf_counter()


_COMPILING_RUNNERS: weakref.WeakSet[Runner] = weakref.WeakSet()  # runners whose background thread was started


@atexit.register
def _stop_background_compiles() -> None:
    """At the process's exit, end every runner's background compiles first (after their current compile)."""
    for runner in list(_COMPILING_RUNNERS):
        runner.stop_background_compiles()


class Runner:
    """Holds the device state of one engine and the compiled step executables."""

    def __init__(
        self,
        spec: ModelSpec,
        params: dict,
        mesh: Mesh,
        *,
        page_size: int,
        num_cache_kv_heads: int,
        cache_dtype: jnp.dtype,
        ladders: BucketLadders,
        attention_backend: str,
        platform: str | None = None,
        num_scheduler_steps: int = 1,
        num_speculative_tokens: int = 0,
        structured_outputs: bool = True,
        pooling: bool = False,
        logprobs_mode: str = "raw_logprobs",
        features: TargetFeatures | None = None,
    ):
        self.spec = spec
        self.params = params
        self.page_size = page_size
        self.ladders = ladders
        self.num_scheduler_steps = num_scheduler_steps
        self.num_speculative_tokens = num_speculative_tokens
        self.pooling = pooling  # the pooling buckets (embeddings) are built too
        # a sequence classifier's head scores classes, not tokens: it only pools (no sampler, no verification)
        self.generates = spec.classifier is None
        # the sampler buckets with a structured-output token bitmask are built too (else only those without)
        self.mask_widths = (0, bitmask_width(spec.vocab_size)) if structured_outputs else (0,)
        self._replicated = NamedSharding(mesh, P())
        self.attention = make_attention(spec, attention_backend, mesh, page_size, platform, cache_dtype)
        self.cache_dtype = jnp.dtype(cache_dtype)  # what the pages hold (float8_e4m3fn for an fp8 cache)
        self._cache_dtype = self.attention.storage_dtype(cache_dtype)  # the arrays' dtype (attention/fp8.py)
        self._num_cache_kv_heads = num_cache_kv_heads
        # EAGLE's features (spec_decode/eagle.py): what each computed token gives the head (its final hidden state, or
        # EAGLE-3's layer inputs) kept in a page-shaped array (1, P, S, 1, F) after the attention's, so page
        # copies, swaps and the prefix cache carry it with the KV
        self.features = features
        feature_width = features.width if features else 0
        self.feature_width = feature_width
        num_kv_arrays = len(self.attention.cache_shapes(spec.num_layers, 1, page_size, num_cache_kv_heads,
                                                         spec.head_dim))
        self._kv_sharding = (*(NamedSharding(mesh, KV_CACHE_SPEC) for _ in range(num_kv_arrays)),
                             *((self._replicated,) if feature_width else ()))
        self.kv_caches: tuple[jax.Array, ...] = ()  # allocate_kv: the backend's layout, each (L, P, S, heads, D)
        self.host_swap: HostSwap | None = None  # allocate_host_kv: the swap space in host memory
        self.num_pages = 0  # of the allocated KV pool
        self._zero_pool: Callable[[], tuple[jax.Array, ...]] | None = None  # makes that pool, zeroed
        self.weight_dtype = params["embed"].dtype  # what weights are read in (a weight update, a wake-up)
        self.quantized_at_load = quantized_at_load(params, spec)  # int8 / fp8 applied to a float checkpoint, or None
        self.host_params: dict | None = None  # while asleep (`sleep`): what of the params waits in host memory

        self.max_rows = max(ladders.row_buckets())
        # Each leaf's own sharding (the loader's, or a quantized leaf's): params of any layout the model takes.
        self.param_shardings = jax.tree_util.tree_map(lambda leaf: leaf.sharding, params)
        program = StepProgram(model_for(spec.architecture), spec, self.attention, mesh, page_size, num_cache_kv_heads,
                              self.cache_dtype, self.max_rows, num_kv_arrays, num_scheduler_steps, logprobs_mode,
                              features)
        self.trace_key = program.trace_key()  # runners with equal keys trace equal executables
        self.model_forward = program.model_forward()  # (params, caches, batch) -> (logits (R, V), hidden, caches)
        self.steps = build_step_functions(program, self.param_shardings, self._kv_sharding, self._replicated)
        # The last step's sampled token of each row, where the next step reads the ids the host has not seen.
        self.last_tokens = put_global(np.zeros((self.max_rows,), np.int32), self._replicated)  # (max rows,)
        self._ready_clock = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxserve-ready")
        self._forward_exec: dict[tuple[int, int], jax.stages.Compiled] = {}  # (T, W) -> executable
        self._sample_exec: dict[tuple[int, int, int], jax.stages.Compiled] = {}  # (R, P, M) -> executable
        self._prompt_exec: dict[tuple[int], jax.stages.Compiled] = {}  # (T,) -> executable
        self._steps_exec: dict[tuple[int, int], jax.stages.Compiled] = {}  # (T, W) -> multi-step executable
        self._verify_rows_exec: dict[tuple[int], jax.stages.Compiled] = {}  # (T,) -> verified positions' states
        self._verify_exec: dict[tuple[int, int, int], jax.stages.Compiled] = {}  # (R, P, M) -> verification
        self._pool_exec: dict[tuple[int, int], jax.stages.Compiled] = {}  # (T, R or T) -> the segments' sums
        self.num_lazy_compiles = 0
        # background_compile: the buckets the background thread still compiles (forward (T, W), sampler (R, P, M),
        # prompt (T,)); while any is left, a step whose buckets are not all ready runs in the largest ones
        self._compiling: set[tuple] = set()
        self._background: threading.Thread | None = None
        self._stop_background = threading.Event()  # set at the process's exit: the thread stops between compiles
        self.num_background_compiles = 0  # compiled on the background thread (not on a step's path)
        self.num_repadded_steps = 0  # steps run in the largest buckets while theirs compiled
        CompileCounter.install()

    # ---- the KV pool --------------------------------------------------------------------------

    def _cache_shapes(self, num_pages: int) -> tuple[tuple[int, ...], ...]:
        """The pool's arrays: the attention backend's, then EAGLE's features (1, P, S, 1, F) when it keeps them."""
        spec = self.spec
        kv = self.attention.cache_shapes(spec.num_layers, num_pages, self.page_size, self._num_cache_kv_heads,
                                         spec.head_dim)
        return (*kv, *([(1, num_pages, self.page_size, 1, self.feature_width)] if self.feature_width else []))

    def cache_structs(self, num_pages: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The KV pool of `num_pages` pages as abstract arrays (shape, dtype, sharding)."""
        return tuple(jax.ShapeDtypeStruct(shape, self._cache_dtype, sharding=sharding)
                     for shape, sharding in zip(self._cache_shapes(num_pages), self._kv_sharding))

    def caches(self, num_pages: int | None) -> tuple:
        """The allocated KV pool (num_pages None) or an abstract one of `num_pages` pages, for a bucket's call."""
        return self.kv_caches if num_pages is None else self.cache_structs(num_pages)

    def page_bytes(self) -> int:
        """Bytes of one page of every layer in the backend's cache arrays (and of EAGLE's features) (all devices
        together)."""
        spec = self.spec
        features = self.page_size * self.feature_width * jnp.dtype(self._cache_dtype).itemsize
        return self.attention.page_bytes(spec.num_layers, self.page_size, self._num_cache_kv_heads, spec.head_dim,
                                         self._cache_dtype) + features

    def set_lora(self, slot: int, adapter: dict) -> None:
        """Write a LoRA adapter (model/lora.py `read_adapter`'s host arrays by leaf; {} frees the slot) into slot
        `slot` of the params; steps dispatched later run with it."""
        layers = self.params["layers"]
        self.params = {**self.params, "layers": {**layers, "lora": write_slot(layers["lora"], slot, adapter,
                                                                               self._replicated.mesh)}}

    def update_weights(self, source: str | TensorMapping) -> None:
        """Read the model's weights anew from a Hugging Face folder or arrays by name (model/weight_update.py) into
        the params being served; steps dispatched later run with them, on the same executables."""
        self.params = self._reload(self.params, source)

    def _reload(self, params: dict, source: str | TensorMapping) -> dict:
        """`params` with the model's weights read from `source` (model/weight_update.py)."""
        folder = SafetensorsFolder(source) if isinstance(source, str) else source
        return reload_params(params, folder, self.spec, self._replicated.mesh, self._num_cache_kv_heads,
                             self.weight_dtype, self.quantized_at_load)

    def sleep(self, keep_weights: bool) -> None:
        """Free the device memory of the KV pool and the weights (sleep mode): the params are copied to host memory
        first (`keep_weights`), else only the leaves no checkpoint gives (LoRA slots, KV scales), and `wake_up` must
        read the weights again."""
        kept = self.params if keep_weights else undeclared_leaves(self.params, self.spec, self._num_cache_kv_heads,
                                                                  self._replicated.mesh.devices.size)
        self.host_params = jax.device_get(kept)
        for array in jax.tree_util.tree_leaves((self.params, self.kv_caches)):
            array.delete()
        self.params, self.kv_caches = None, ()

    def wake_up(self, source: str | TensorMapping | None = None) -> None:
        """Undo `sleep`: the params back from host memory, the weights among them read from `source` instead when it
        is given (checked by the caller; required after a sleep that discarded them), and a zeroed KV pool of the
        size it had."""
        host, self.host_params = self.host_params, None
        if source is not None:
            host = undeclared_leaves(host, self.spec, self._num_cache_kv_heads, self._replicated.mesh.devices.size)
        params = jax.device_put(host, _subtree(self.param_shardings, host))
        self.params = params if source is None else self._reload(params, source)
        self.allocate_kv(self.num_pages)

    def allocate_kv(self, num_pages: int) -> None:
        """Allocate the KV pool of `num_pages` pages (zeros, sharded on the KV-head axis; the same pool again after a
        sleep compiles nothing)."""
        if num_pages != self.num_pages or self._zero_pool is None:
            shapes, dtype = self._cache_shapes(num_pages), self._cache_dtype
            self._zero_pool = jax.jit(lambda: tuple(jnp.zeros(shape, dtype) for shape in shapes),
                                      out_shardings=self._kv_sharding)
        self.num_pages = num_pages
        self.kv_caches = self._zero_pool()

    def allocate_host_kv(self, num_pages: int, max_pages_per_request: int) -> None:
        """Make the host swap pool of `num_pages` pages in the device pool's layout and compile the copies
        between the two (after allocate_kv)."""
        self.host_swap = HostSwap(self._cache_shapes(num_pages), self._cache_dtype, self._kv_sharding,
                                  max_pages_per_request)
        self.host_swap.compile(self.kv_caches)

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Dispatch a step's copies to the host pool ((device page, host page) pairs) and back ((host page,
        device page) pairs), before the step's forward."""
        self.kv_caches = self.host_swap.swap(self.kv_caches, swap_out, swap_in)

    def peak_activation_bytes(self, num_pages: int) -> int:
        """Per-device bytes the largest step needs beyond its inputs, from XLA's memory analysis of the
        largest forward bucket and then the larger of the largest sampler and verification buckets
        (temporaries plus outputs that do not alias a donated input; a classifier's: the largest pooling bucket);
        compiled against an abstract pool of `num_pages` pages, which they do not depend on."""
        largest_forward = self.forward_call(self.ladders.tokens[-1], self.ladders.page_widths[-1], num_pages)
        if not self.generates:
            largest = self.ladders.tokens[-1]
            return activation_bytes(*largest_forward) + activation_bytes(*self.pooling_call(largest, largest))
        largest_samplers = [self.sampler_call(max(self.ladders.row_buckets()), self.ladders.aux_widths[-1],
                                              self.mask_widths[-1])]
        if self.num_speculative_tokens:
            largest_samplers.append(self.verify_call(max(self.ladders.row_buckets()), self.ladders.aux_widths[-1],
                                                     self.mask_widths[-1]))
        return activation_bytes(*largest_forward) + max(activation_bytes(*call) for call in largest_samplers)

    # ---- compilation -------------------------------------------------------------------------

    def shapes(self) -> tuple[list[tuple[int, ...]], ...]:
        """Every (T, W) forward shape, (R, P, M) sampler shape (M: no token bitmask, or one word per 32 tokens),
        (T,) prompt-logprob shape, the (T, W) shapes of multi-step decodes (T up to the token rung holding
        max_num_seqs decodes), with speculative decoding the (T,) shapes that take the verified positions'
        hidden states out of a forward and the (R, P, M) shapes of the verification, and with pooling the (T, S)
        shapes that pool the T tokens' states into S segments (its rows, or the tokens one by one), that the
        ladders allow (a classifier's: forward and pooling shapes only)."""
        forward = list(itertools.product(self.ladders.tokens, self.ladders.page_widths))
        sampler = list(itertools.product(self.ladders.row_buckets(), self.ladders.aux_widths, self.mask_widths))
        prompt = [(num_tokens,) for num_tokens in self.ladders.tokens]
        steps = verify_rows = verify = pool = []
        if self.pooling:
            pool = sorted({(t, segments) for t in self.ladders.tokens for segments in (self.ladders.rows_for(t), t)})
        if not self.generates:  # a classifier: the forward and the pooling alone
            return forward, [], [], [], [], [], pool
        if self.num_scheduler_steps > 1:
            steps = [(t, w) for t, w in forward if t <= self._decode_tokens_rung(1)]
        if self.num_speculative_tokens:
            verify_rows, verify = prompt, sampler
        return forward, sampler, prompt, steps, verify_rows, verify, pool

    def _decode_tokens_rung(self, tokens_per_row: int) -> int:
        """The token rung holding max_num_seqs rows of `tokens_per_row` tokens (the top rung when none does)."""
        tokens = min(self.ladders.max_num_seqs * tokens_per_row, self.ladders.tokens[-1])
        return pick_bucket(self.ladders.tokens, tokens)

    def warmup(self, show_progress: bool = True, background: bool = False) -> None:
        """AOT-compile every bucket, tracing here and compiling on a thread pool (XLA releases the GIL).

        With the persistent compilation cache on, a restart loads these instead of compiling. With `background`
        (plain generation only: no multi-step decode, speculation or pooling), only the buckets that serve any step
        compile here: the largest forward and prompt-logprob buckets and the largest rows' samplers at no aux tokens
        and at the most; the rest compile on a background thread while steps run, each step padded into the
        largest buckets until its own are ready (`wait_for_background_compiles`).
        """
        forward, sampler, prompt, steps, verify_rows, verify, pool = self.shapes()
        if background and (steps or verify_rows or verify or pool):
            logger.info("background_compile: multi-step decoding, speculation and pooling compile every bucket first")
        elif background:
            largest_tokens, largest_rows = self.ladders.tokens[-1], max(self.ladders.row_buckets())
            early = {("forward", (largest_tokens, self.ladders.page_widths[-1])), ("prompt", (largest_tokens,))}
            early |= {("sampler", (largest_rows, aux, mask)) for aux in (0, self.ladders.aux_widths[-1])
                      for mask in self.mask_widths}
            groups = self._bucket_groups(forward, sampler, prompt)
            self.compile_buckets([(table, call, [key for key in keys if (kind, key) in early])
                                  for kind, table, call, keys in groups], "compiling the largest buckets",
                                 show_progress)
            rest = [(kind, table, call, [key for key in keys if (kind, key) not in early])
                    for kind, table, call, keys in groups]
            self._compiling = {(kind, key) for kind, _, _, keys in rest for key in keys}
            self._background = threading.Thread(target=self._compile_in_background, args=(rest,),
                                                name="jaxserve-background-compile", daemon=True)
            _COMPILING_RUNNERS.add(self)
            self._background.start()
            return
        self.compile_buckets([(self._forward_exec, self.forward_call, forward),
                              (self._steps_exec, self.decode_steps_call, steps),
                              (self._verify_rows_exec, self.verify_rows_call, verify_rows),
                              (self._verify_exec, self.verify_call, verify),
                              (self._sample_exec, self.sampler_call, sampler),
                              (self._prompt_exec, self.prompt_logprobs_call, prompt),
                              (self._pool_exec, self.pooling_call, pool)],
                             "compiling step buckets", show_progress)

    def _bucket_groups(self, forward: list, sampler: list, prompt: list) -> list[tuple[str, dict, Callable, list]]:
        """(kind, table, call, keys) of plain generation's buckets, in the order the background compiles them: each
        row bucket's samplers before the forwards that give it logits, smallest first."""
        return [("sampler", self._sample_exec, self.sampler_call, sorted(sampler)),
                ("forward", self._forward_exec, self.forward_call, sorted(forward)),
                ("prompt", self._prompt_exec, self.prompt_logprobs_call, sorted(prompt))]

    def _compile_in_background(self, groups: list[tuple[str, dict, Callable, list]]) -> None:
        """Trace and compile every bucket of `groups` one by one (the serving threads keep the other cores), each
        ready for steps once compiled. A bucket that fails twice is logged and left out: its steps keep running in
        the largest buckets, and the thread goes on with the others. A compile that fails once the process exits
        (the stop event set meanwhile) ends the thread without a word: jax's lowering raised a KeyError in 15 of 71
        exits during a compile, and in none of 14 runs that stayed alive."""
        for kind, table, call, keys in groups:
            for key in keys:  # (a forward against an abstract pool: the steps donate the real one meanwhile)
                for attempt in (1, 2):
                    if self._stop_background.is_set():
                        return
                    try:
                        function, args = call(*key, self.num_pages) if kind == "forward" else call(*key)
                        self.num_background_compiles += self._compile_into(table, key, function, args)
                    except Exception as error:
                        if self._stop_background.is_set():  # the process is exiting: nothing is left to serve
                            logger.debug("background_compile: the %s bucket %s failed while stopping (%s: %s)", kind,
                                         key, type(error).__name__, error)
                            return
                        logger.warning("background_compile: the %s bucket %s failed (%s: %s)%s", kind, key,
                                       type(error).__name__, error, "; trying again" if attempt == 1 else
                                       "; its steps keep running in the largest buckets")
                        continue
                    self._compiling.discard((kind, key))
                    break

    def wait_for_background_compiles(self, timeout: float | None = None) -> bool:
        """Wait until the background compiles are done (at once without background_compile); True when they are."""
        if self._background is not None:
            self._background.join(timeout)
        return not self._compiling

    def stop_background_compiles(self) -> None:
        """Stop the background thread after the compile it is in (a process must not exit while XLA compiles on
        another thread: the runtime aborts)."""
        self._stop_background.set()
        if self._background is not None:
            self._background.join()

    def background_compiles_left(self) -> int:
        """Buckets the background thread has still to compile."""
        return len(self._compiling)

    def _ready(self, num_tokens: int, width: int, prompt: bool) -> bool:
        """Whether a step of this bucket can run in it: its forward compiled, and every sampler of its rows (any aux
        width it may need) and its prompt-logprob bucket when it scores prompt tokens."""
        if not self._compiling:
            return True
        rows = self.ladders.rows_for(num_tokens)
        pending = {("forward", (num_tokens, width))} | {("sampler", (rows, aux, mask)) for aux in
                                                       self.ladders.aux_widths for mask in self.mask_widths}
        if prompt:
            pending.add(("prompt", (num_tokens,)))
        return not (pending & self._compiling)

    def num_executables(self) -> int:
        """How many bucket executables this runner holds (compiled here, loaded from the cache or shared)."""
        return sum(len(table) for table in (self._forward_exec, self._sample_exec, self._prompt_exec,
                                            self._steps_exec, self._verify_rows_exec, self._verify_exec,
                                            self._pool_exec))

    def compile_buckets(self, groups: list[tuple[dict, Callable, list[tuple[int, ...]]]], description: str,
                        show_progress: bool) -> None:
        """Fill each (table, call, keys) group's `table[key]` with the executable of `call(*key)` (a function and
        its arguments): a shared one where this process has it, else traced here and compiled on a thread pool."""
        lowered = []
        for table, call, keys in groups:
            for key in keys:
                function, args = call(*key)
                shared_key = self._shared_key(function, args)
                shared = shared_executable(shared_key)
                if shared is None:
                    lowered.append(((table, key, shared_key), function.lower(*args)))
                else:
                    table[key] = shared
        compile_all(lowered, description, show_progress)

    def _shared_key(self, function: Callable, args: tuple) -> tuple:
        """The key of a step function's executable for `args` among the process's shared executables."""
        return self.trace_key, function.__wrapped__.__name__, abstract_arguments(args)

    # Each *_call gives a bucket's jitted step function and its arguments (the step inputs abstract):
    # `function.lower(*args)` lowers it for this process's backend, `jax.export.export(function,
    # platforms=[...])(*args)` for another (`jaxserve check-config`).

    def forward_call(self, num_tokens: int, width: int, num_pages: int | None = None) -> tuple[Callable, tuple]:
        """The forward bucket (T, W), against the allocated pool or an abstract one of `num_pages`."""
        example = BatchDescriptor(
            **padded_batch_arrays(num_tokens, self.ladders.rows_for(num_tokens), width, self.page_size)
        )
        (buffer,), (layout,) = self.abstract_packed(example)
        last_tokens = jax.ShapeDtypeStruct((self.max_rows,), jnp.int32, sharding=self._replicated)
        return self.steps.forward, (self.params, self.caches(num_pages), last_tokens, buffer, layout)

    def decode_steps_call(self, num_tokens: int, width: int, num_pages: int | None = None) -> tuple[Callable, tuple]:
        """The multi-step decode bucket (T, W): T tokens, one per row, sampled with no per-row token lists."""
        num_rows = self.ladders.rows_for(num_tokens)
        buffers, layouts = self.abstract_packed(
            BatchDescriptor(**padded_batch_arrays(num_tokens, num_rows, width, self.page_size)),
            SamplingBatch(**padded_sampling_arrays(num_rows, 0)), DecodeSteps(**padded_decode_step_arrays(num_rows)))
        last_tokens = jax.ShapeDtypeStruct((self.max_rows,), jnp.int32, sharding=self._replicated)
        return self.steps.decode_steps, (self.params, self.caches(num_pages), last_tokens, buffers, layouts)

    def verify_rows_call(self, num_tokens: int) -> tuple[Callable, tuple]:
        """The bucket (T,) that takes the hidden states of each row's 1 + k verified positions out of a forward's
        T: the rows of that token rung."""
        (buffer,), (layout,) = self.abstract_packed(
            Proposals(**padded_proposal_arrays(self.ladders.rows_for(num_tokens), 1 + self.num_speculative_tokens)))
        return self.steps.verify_rows, (self._hidden_struct(num_tokens), buffer, layout)

    def verify_call(self, num_rows: int, aux_width: int, mask_width: int = 0) -> tuple[Callable, tuple]:
        """The speculative verification bucket (R, P, M): R rows of 1 + k verified positions each (their hidden
        states in), P aux tokens and M bitmask words per row."""
        width = 1 + self.num_speculative_tokens
        buffers, layouts = self.abstract_packed(
            SamplingBatch(**padded_sampling_arrays(num_rows, aux_width, mask_width)),
            Proposals(**padded_proposal_arrays(num_rows, width)))
        return self.steps.verify, (self.params, self._hidden_struct(num_rows * width), buffers, layouts)

    def sampler_call(self, num_rows: int, aux_width: int, mask_width: int = 0) -> tuple[Callable, tuple]:
        """The sampler bucket (R, P, M)."""
        (buffer,), (layout,) = self.abstract_packed(SamplingBatch(**padded_sampling_arrays(num_rows, aux_width,
                                                                                            mask_width)))
        logits = jax.ShapeDtypeStruct((num_rows, self.spec.vocab_size), jnp.float32, sharding=self._replicated)
        return self.steps.sample, (logits, buffer, layout)

    def prompt_logprobs_call(self, num_tokens: int) -> tuple[Callable, tuple]:
        """The prompt-logprob bucket (T,)."""
        (buffer,), (layout,) = self.abstract_packed(PromptLogprobBatch(**padded_prompt_logprob_arrays(num_tokens)))
        return self.steps.prompt_logprobs, (self.params, self._hidden_struct(num_tokens), buffer, layout)

    def pooling_call(self, num_tokens: int, num_segments: int) -> tuple[Callable, tuple]:
        """The pooling bucket (T, S): the step's T tokens' states summed into S segments (its rows, or S = T: the
        tokens one by one)."""
        (buffer,), (layout,) = self.abstract_packed(PoolingBatch(**padded_pooling_arrays(num_tokens, num_segments)))
        return self.steps.pool, (self.params, self._hidden_struct(num_tokens), buffer, layout, num_segments)

    def _hidden_struct(self, num_tokens: int) -> jax.ShapeDtypeStruct:
        """Final hidden states of `num_tokens` tokens (N, H) as an abstract array: a forward's T, or the R * S
        verified positions."""
        return jax.ShapeDtypeStruct((num_tokens, self.spec.hidden_size), self.params["embed"].dtype,
                                    sharding=self._replicated)

    def abstract_packed(self, *parts) -> tuple[tuple[jax.ShapeDtypeStruct, ...], tuple[Layout, ...]]:
        """Each dataclass of host arrays in `parts` as the abstract int32 buffer `pack` makes of it (W,), replicated,
        and its layout; nothing is copied."""
        sizes, layouts = zip(*(packed_layout(part) for part in parts))
        buffers = tuple(jax.ShapeDtypeStruct((size,), jnp.int32, sharding=self._replicated) for size in sizes)
        return buffers, layouts

    # ---- one step ----------------------------------------------------------------------------

    def dispatch(
        self, batch: BatchDescriptor, sampling: SamplingBatch, prompt: PromptLogprobBatch | None = None,
        decode_steps: DecodeSteps | None = None, proposals: Proposals | None = None,
        pooling: PoolingBatch | None = None,
    ) -> "PendingStep":
        """Start the model and the sampler (and the scoring of prompt tokens when `prompt` is given, the pooling
        of the rows' states when `pooling` is) on the device and return at once; `PendingStep.fetch()` waits for
        the samples. A token whose id the host does not have yet is read from the previous dispatch's samples
        (`batch.device_token_index`). With `decode_steps`, a decode-only batch runs several iterations in one call
        (runner/decode_steps.py); with `proposals`, the rows that propose tokens verify them (`dispatch_sampler`)."""
        if decode_steps is not None:
            return self._dispatch_decode_steps(batch, sampling, decode_steps)
        return self.dispatch_sampler(self.dispatch_forward(batch, prompt, pooling), sampling, proposals)

    def dispatch_forward(self, batch: BatchDescriptor, prompt: PromptLogprobBatch | None = None,
                         pooling: PoolingBatch | None = None) -> "ForwardStep":
        """The first half of `dispatch` (a plain step): start the model (and the scoring of prompt tokens, the
        pooling of states) and return at once; the host may then finish the sampling batch (the grammar masks)
        while it runs."""
        num_tokens, width = batch.input_ids.shape[0], batch.page_table.shape[1]
        if not self._ready(num_tokens, width, prompt is not None):  # its buckets compile in the background
            num_tokens, width = self.ladders.tokens[-1], self.ladders.page_widths[-1]
            batch = repad_batch(batch, num_tokens, self.ladders.rows_for(num_tokens), width, self.page_size)
            prompt = None if prompt is None else repad_prompt(prompt, num_tokens)
            self.num_repadded_steps += 1
        forward = self._executable(self._forward_exec, (num_tokens, width), self.forward_call)
        batch_words = put_global(pack(batch)[0], self._replicated)
        logits, hidden, self.kv_caches = forward(self.params, self.kv_caches, self.last_tokens, batch_words)
        scored, num_targets = None, 0
        if prompt is not None:
            scorer = self._executable(self._prompt_exec, (num_tokens,), self.prompt_logprobs_call)
            scored = scorer(self.params, hidden, put_global(pack(prompt)[0], self._replicated))
            num_targets = int(prompt.num_targets)
        pooled = None
        if pooling is not None:
            pool = self._executable(self._pool_exec, (num_tokens, int(pooling.num_segments)), self.pooling_call)
            pooled = pool(self.params, hidden, put_global(pack(pooling)[0], self._replicated))
        return ForwardStep(logits, hidden, scored, int(batch.num_seqs), num_targets, pooled)

    def dispatch_sampler(self, step: "ForwardStep", sampling: SamplingBatch,
                         proposals: Proposals | None = None) -> "PendingStep":
        """The second half of `dispatch`: start the sampler on a dispatched forward's logits. With `proposals`, a
        speculative verification instead: the target's logits at each row's last token and proposals decide
        the row's accepted proposals and the token after them, (S, R) with -1 after a row's last token; a row
        without proposals samples its one token as the plain sampler would."""
        if not self.generates:  # a classifier's rows pool and sample nothing: their placeholder samples are 0
            return self._pending(np.zeros((step.num_seqs,), np.int32), None, step.prompt_scored, step.num_seqs,
                                 step.num_prompt_targets, 1, step.pooled)
        num_rows, aux_width = step.logits.shape[0], sampling.aux_token_ids.shape[1]
        if ("sampler", (num_rows, aux_width, sampling.token_bitmask.shape[1])) in self._compiling:
            aux_width = self.ladders.aux_widths[-1]  # compiled with the largest buckets
        if (num_rows, aux_width) != sampling.aux_token_ids.shape:  # the forward ran in the largest bucket
            sampling = repad_sampling(sampling, num_rows, aux_width)
        words = put_global(pack(sampling)[0], self._replicated)
        key = (sampling.temperature.shape[0], *sampling.aux_token_ids.shape[1:], *sampling.token_bitmask.shape[1:])
        if proposals is None:
            out, self.last_tokens = self._executable(self._sample_exec, key, self.sampler_call)(step.logits, words)
            token_ids, per_row = out.token_ids, 1
        else:
            per_row = proposals.logits_index.shape[1]
            proposal_words = put_global(pack(proposals)[0], self._replicated)
            take_rows = self._executable(self._verify_rows_exec, step.hidden.shape[:1], self.verify_rows_call)
            verifier = self._executable(self._verify_exec, key, self.verify_call)
            rows = take_rows(step.hidden, proposal_words)  # (R * S, H)
            token_ids, self.last_tokens, out = verifier(self.params, rows, (words, proposal_words))
        logprobs = (out.logprobs, out.ranks, out.top_token_ids, out.top_logprobs) if sampling.need_logprobs else None
        return self._pending(token_ids, logprobs, step.prompt_scored, step.num_seqs, step.num_prompt_targets,
                             per_row, step.pooled)

    def _dispatch_decode_steps(self, batch: BatchDescriptor, sampling: SamplingBatch,
                               steps: DecodeSteps) -> "PendingStep":
        """A multi-step decode, sampled from its logits alone: every iteration's samples come back as one (K, R)
        array."""
        if sampling.aux_token_ids.shape[1] or sampling.need_logprobs:
            raise RuntimeError("a multi-step decode samples from the logits alone (no token lists, no logprobs)")
        key = (batch.input_ids.shape[0], batch.page_table.shape[1])
        executable = self._executable(self._steps_exec, key, self.decode_steps_call)
        buffers = put_global(tuple(pack(part)[0] for part in (batch, sampling, steps)), self._replicated)
        tokens, self.last_tokens, self.kv_caches = executable(self.params, self.kv_caches, self.last_tokens, buffers)
        return self._pending(tokens, None, None, int(batch.num_seqs), 0)

    def _pending(self, token_ids: jax.Array, logprobs, scored, num_seqs: int, num_targets: int,
                 logprobs_per_row: int = 1, pooled: jax.Array | None = None) -> "PendingStep":
        """A PendingStep whose `ready` the helper thread resolves when its outputs are computed."""
        pending = PendingStep(token_ids, logprobs, scored, num_seqs, num_targets, logprobs_per_row, pooled)
        pending.ready = self._ready_clock.submit(_ready_time, (token_ids, scored, pooled))
        return pending

    def _executable(self, table: dict, key: tuple[int, ...], call: Callable) -> jax.stages.Compiled:
        """Look up a compiled bucket (`call(*key)` gives its function and arguments): a shared one where this
        process has it, else compiled here (counted: warm-up missed the shape, or `skip_precompile` skipped it)."""
        if key not in table:
            self.num_lazy_compiles += self._compile_into(table, key, *call(*key))
        return table[key]

    def _compile_into(self, table: dict, key: tuple[int, ...], function: Callable, args: tuple) -> bool:
        """Put the executable of `function(*args)` in `table[key]`: the process's shared one, else compiled here and
        shared (True). A failed compile leaves no entry (never a None parked in the table)."""
        shared_key = self._shared_key(function, args)
        executable = shared_executable(shared_key)
        compiled = executable is None
        if compiled:
            executable, storable, cached = compile_here(function.lower(*args))
            share_executable(shared_key, executable, storable, cached)
        table[key] = executable
        return compiled
