"""The scheduler part of the engine's config: how many requests and tokens a step takes, in what order, and how a
request gives its pages back when another needs them."""

from __future__ import annotations

import dataclasses

from jaxserve.config.options import SERVE_ONLY, check_bools, check_choice, check_positive_ints, option

VALID_POLICIES = ("fcfs", "priority")
# How a preempted request gives its KV pages back: recompute (drop them; its tokens are computed again when it
# resumes), swap (copy them to a host-memory pool and back when it resumes), auto (swap long contexts).
VALID_PREEMPTION_MODES = ("recompute", "swap", "auto")
# continuous: requests join and leave the running batch at every step and hold only the pages they fill;
# static: a pre-paging server, the baseline of `jaxserve bench`: a batch is admitted only when the previous
# one has finished, and each sequence reserves pages for max_model_len when it is admitted.
VALID_BATCHING = ("continuous", "static")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's options (vLLM's SchedulerConfig)."""

    max_num_seqs: int = option(64, "most requests in one step", commands=SERVE_ONLY)
    max_num_batched_tokens: int = option(512, "token budget of one step (a longer prompt is chunked)")
    enable_chunked_prefill: bool = option(True, "split long prompts across steps")
    scheduling_policy: str = option(
        "fcfs", "fcfs, or priority: lower value first, and a waiting request preempts running ones it outranks",
        choices=VALID_POLICIES, commands=SERVE_ONLY)
    batching: str = option(
        "continuous", "continuous, or static: the pre-paging baseline (a batch at a time, each sequence reserving "
        "max_model_len of KV)", choices=VALID_BATCHING, commands=SERVE_ONLY)
    async_scheduling: bool = option(True, "plan each step while the device runs the one before it")
    num_scheduler_steps: int = option(1, "decode iterations per device call when every row of a step decodes")
    preemption_mode: str = option(
        "recompute", "how a preempted request gives its KV back: recompute, swap (to host memory and back) or auto "
        "(swap contexts longer than max_num_batched_tokens)", choices=VALID_PREEMPTION_MODES, commands=SERVE_ONLY)
    max_preemptions: int = option(
        3, "priority policy: preemptions in a row after which a request is not preempted by another again until it "
        "finishes", commands=SERVE_ONLY)

    def __post_init__(self):
        check_choice("scheduling_policy", self.scheduling_policy, VALID_POLICIES)
        check_choice("batching", self.batching, VALID_BATCHING)
        check_choice("preemption_mode", self.preemption_mode, VALID_PREEMPTION_MODES)
        check_bools(self, "enable_chunked_prefill", "async_scheduling")
        check_positive_ints(self, "max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps", "max_preemptions")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) must be <= max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}): every scheduled sequence takes at least one token")


@dataclasses.dataclass(frozen=True)
class SchedulerSettings:
    """What the Scheduler reads: plain values (the scheduler never imports jax), max_model_len resolved."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    static_batching: bool = False
    num_scheduler_steps: int = 1  # decode iterations per step when every row is a plain decode
    preemption_mode: str = "recompute"  # auto: swap a victim with more computed tokens than the step budget
    # priority: a request preempted this many times in a row is not preempted by another again until it yields
    max_preemptions: int = 3
    num_speculative_tokens: int = 0  # most proposals a decode verifies per step (0: no speculative decoding)
