"""The runner's step functions: what each compiled bucket runs, jitted over packed inputs (batch/packing.py).

All of them are built from one description, `StepProgram`: the model, its attention, the mesh and the few static
choices the functions close over. Two runners with equal programs trace equal executables, so the program is also
the key under which executables are shared and stored (runner/executables.py, runner/executable_store.py).

    function         inputs (besides params)                  outputs
    forward          caches, last tokens, BatchDescriptor     logits (R, V), hidden (T, H), caches (donated)
    sample           logits, SamplingBatch                    SamplerOutput, last tokens (max_rows,)
    decode_steps     caches, last tokens, batch+sampling+K    samples (K, R), last tokens, caches (donated)
    verify_rows      hidden, Proposals                        hidden states of rows' proposals (R * S, H)
    verify           rows' states, SamplingBatch+Proposals    tokens (S, R), last tokens, logprobs
    prompt_logprobs  hidden, PromptLogprobBatch               raw logprobs of the prompt's targets
    pool             hidden, PoolingBatch                     each segment's summed final states
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.batch.descriptor import BatchDescriptor, DecodeSteps, PoolingBatch, PromptLogprobBatch
from jaxserve.batch.packing import Layout, unpack
from jaxserve.model.eagle import TargetFeatures
from jaxserve.model.registry import copy_pages
from jaxserve.model_spec import ModelSpec
from jaxserve.runner.decode_steps import run_decode_steps, sampled_by
from jaxserve.sampling.sampler import SamplingBatch, raw_logprobs, sample
from jaxserve.sampling.verify import Proposals, verify


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """What the step functions close over (all static at trace time)."""

    model: Any  # the registered Model (model/registry.py)
    spec: ModelSpec
    attention: Any  # the attention backend (attention/): its attention and KV write
    mesh: Mesh
    page_size: int
    num_cache_kv_heads: int
    cache_dtype: jnp.dtype  # what the pages hold
    max_rows: int  # the largest row bucket: the last tokens' length
    num_kv_arrays: int  # the attention's arrays in the pool (EAGLE's features come after them)
    num_scheduler_steps: int = 1
    logprobs_mode: str = "raw_logprobs"
    features: TargetFeatures | None = None  # what an EAGLE head reads of this model (kept beside the KV)

    def trace_key(self) -> tuple:
        """The program as a key: runners with equal keys trace equal executables."""
        return (self.model, self.spec, self.attention.name, self.attention.options, self.mesh, self.page_size,
                self.num_cache_kv_heads, jnp.dtype(self.cache_dtype), self.max_rows, self.num_scheduler_steps,
                self.logprobs_mode, self.features)

    def model_forward(self, tap_layers: tuple[int, ...] = ()) -> Callable:
        """(params, caches, BatchDescriptor) -> (logits (R, V), hidden (T, H), caches[, the inputs of the layers
        `tap_layers`])."""
        return self.model.make_forward(self.spec, self.attention.attention, self.attention.write_kv, self.mesh,
                                       tap_layers)


@dataclasses.dataclass(frozen=True)
class StepFunctions:
    """The jitted step functions of one program (the module docstring's table), each compiled per bucket."""

    forward: Callable
    sample: Callable
    decode_steps: Callable
    verify_rows: Callable
    verify: Callable
    prompt_logprobs: Callable
    pool: Callable


def build_step_functions(program: StepProgram, param_shardings, kv_sharding: tuple, replicated) -> StepFunctions:
    """Jit the step functions of `program` with the params' shardings, the pool's (`kv_sharding`, one per array) and
    the replicated sharding of everything else; the pool is donated to the functions that write it.

    The functions close over `program`'s parts only, never a runner: JAX's jit objects would otherwise keep the
    runner, its executables and their memory mappings alive after the engine is dropped."""
    spec, page_size, max_rows = program.spec, program.page_size, program.max_rows
    num_kv_arrays, logprobs_mode, features = program.num_kv_arrays, program.logprobs_mode, program.features
    token_logits = program.model.token_logits  # (params, hidden (N, H), spec) -> (N, V) float32
    final_states = program.model.final_states  # (params, hidden (N, H), spec) -> (N, H) after the final norm
    forward = program.model_forward()
    tap_layers = features.layers if features else ()  # EAGLE-3's: the forward gives those layers' inputs
    tapped = program.model_forward(tap_layers)

    def forward_packed(params, caches, last_tokens, buffer, layout: Layout):
        batch = with_device_tokens(unpack(buffer, layout, BatchDescriptor), last_tokens)
        if features is None:
            return forward(params, caches, batch)
        logits, hidden, kv, *taps = tapped(params, caches[:num_kv_arrays], batch)
        pages = copy_pages(caches[num_kv_arrays:], batch.copy_src, batch.copy_dst)[0]  # (1, P, S, 1, F)
        slots = batch.slot_mapping  # (T,)
        states = taps[0] if tap_layers else final_states(params, hidden, spec)  # (T, F)
        pages = pages.at[0, slots // page_size, slots % page_size, 0].set(states.astype(pages.dtype))
        return logits, hidden, (*kv, pages)

    def sample_packed(logits, buffer, layout: Layout):
        out = sample(logits, unpack(buffer, layout, SamplingBatch), logprobs_mode)
        return out, padded_rows(out.token_ids, max_rows)

    def last_of_rows(tokens, counts):
        """Each row's last token of `tokens` (K, R), of which it has `counts` (R,), padded to (max_rows,)."""
        last_index = jnp.maximum(counts - 1, 0)[None]  # (1, R)
        return padded_rows(jnp.take_along_axis(tokens, last_index, axis=0)[0], max_rows)

    def decode_steps_packed(params, caches, last_tokens, buffers, layouts: tuple[Layout, Layout, Layout]):
        if features is not None:  # (speculative decoding, which EAGLE is, and multi-step decodes are alternatives)
            raise ValueError("multi-step decodes do not keep EAGLE's features")
        batch = with_device_tokens(unpack(buffers[0], layouts[0], BatchDescriptor), last_tokens)
        sampling, steps = unpack(buffers[1], layouts[1], SamplingBatch), unpack(buffers[2], layouts[2], DecodeSteps)
        samples, caches = run_decode_steps(forward, params, caches, batch, sampled_by(sampling), steps,
                                           program.num_scheduler_steps, page_size)  # samples: (K, R)
        return samples, last_of_rows(samples, steps.num_steps), caches

    def verify_rows_packed(hidden, buffer, layout: Layout):
        """The hidden states (R * S, H) of each row's last token and proposals, out of the step's (T, H)."""
        return hidden[unpack(buffer, layout, Proposals).logits_index.reshape(-1)]

    def verify_packed(params, rows, buffers, layouts: tuple[Layout, Layout]):
        """A speculative verification after the step's forward: the target's logits at each row's last token and
        proposals (from their hidden states `rows`, (R * S, H)) decide the tokens (S, R), -1 after each row's last;
        also each row's last token, padded to (max_rows,), and the logprobs of every (row, position)."""
        sampling = unpack(buffers[0], layouts[0], SamplingBatch)
        proposals = unpack(buffers[1], layouts[1], Proposals)
        num_rows, width = proposals.logits_index.shape
        logits = token_logits(params, rows, spec)  # (R * S, V)
        tokens, out = verify(logits.reshape(num_rows, width, -1), sampling, proposals, logprobs_mode)  # (S, R)
        return tokens, last_of_rows(tokens, jnp.sum(tokens >= 0, axis=0)), out

    def prompt_logprobs_packed(params, hidden, buffer, layout: Layout):
        prompt = unpack(buffer, layout, PromptLogprobBatch)
        logits = token_logits(params, hidden[prompt.token_index], spec)  # (Q, V) float32
        return raw_logprobs(logits, prompt.target_ids)

    pooled_states = final_states if spec.classifier is None else token_logits  # a classifier pools its class logits

    def pool_packed(params, hidden, buffer, layout: Layout, num_segments: int):
        """Each of the step's segments' (its R rows', or its T tokens') sum (R or T, H) float32 of the final states
        of its tokens (a classifier's: (R or T, labels) of their class logits, the score head being linear)."""
        segments = unpack(buffer, layout, PoolingBatch).token_segments  # (T,) segment, or num_segments: none
        states = pooled_states(params, hidden, spec).astype(jnp.float32)  # (T, H) or (T, labels)
        return jax.ops.segment_sum(states, segments, num_segments=num_segments + 1)[:num_segments]

    # (params, caches, last tokens, packed inputs, layouts) -> (outputs, last tokens or hidden states, caches)
    step_jit = functools.partial(
        jax.jit, in_shardings=(param_shardings, kv_sharding, replicated, replicated),
        out_shardings=(replicated, replicated, kv_sharding), donate_argnums=(1,), static_argnums=(4,))
    with_params = functools.partial(jax.jit, in_shardings=(param_shardings, replicated, replicated),
                                    out_shardings=replicated)
    return StepFunctions(
        forward=step_jit(forward_packed),
        sample=jax.jit(sample_packed, in_shardings=(replicated, replicated), out_shardings=replicated,
                       static_argnums=(2,)),
        decode_steps=step_jit(decode_steps_packed),
        verify_rows=jax.jit(verify_rows_packed, in_shardings=(replicated, replicated), out_shardings=replicated,
                            static_argnums=(2,)),
        verify=with_params(verify_packed, static_argnums=(3,)),
        prompt_logprobs=with_params(prompt_logprobs_packed, static_argnums=(3,)),
        pool=with_params(pool_packed, static_argnums=(3, 4)),
    )


def padded_rows(token_ids: jax.Array, max_rows: int) -> jax.Array:
    """(R,) samples -> (max_rows,), where the next step reads the ids the host has not seen yet."""
    return jnp.zeros((max_rows,), jnp.int32).at[: token_ids.shape[0]].set(token_ids)


def with_device_tokens(batch: BatchDescriptor, last_tokens: jax.Array) -> BatchDescriptor:
    """The batch with each token whose id is still on the device read from the last step's samples."""
    # last_tokens: (max rows,) int32; batch.device_token_index: (T,) int32 row there, or -1
    index = batch.device_token_index
    input_ids = jnp.where(index >= 0, last_tokens[jnp.maximum(index, 0)], batch.input_ids)  # (T,)
    return dataclasses.replace(batch, input_ids=input_ids)
