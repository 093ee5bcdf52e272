"""Seeded benchmark workloads, shared by `jaxserve bench throughput` and `jaxserve bench serve`.

A workload is a tuple of requests, each a prompt (token ids, and for ShareGPT prompts the text they encode)
and an exact number of tokens to generate. Random prompts draw their ids from the tokenizer's vocabulary
without its special tokens, so every system (and a detokenize/re-encode round trip through a peer) sees
ordinary tokens. The same arguments and seed always give the same workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from jaxserve.datasets import load_sharegpt

WORKLOADS = ("random", "shared-prefix", "long-prompt-mix", "sharegpt")
LENGTH_DISTRIBUTIONS = ("fixed", "uniform", "lognormal")
LOGNORMAL_SIGMA = 0.8  # the spread of log(length): a long tail (p99 about 6.4x the median before clipping)
SHAREGPT_MIN_TOKENS = 4  # vLLM's rule: shorter prompts or replies are skipped


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """One benchmark request."""

    prompt_token_ids: tuple[int, ...]
    output_len: int  # tokens to generate (EOS ignored, so exactly this many)
    prompt_text: str | None = None  # ShareGPT prompts: the text (prompt_token_ids are its encoding)


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named, ordered set of benchmark requests."""

    name: str  # one of WORKLOADS
    requests: tuple[BenchRequest, ...]
    description: str  # one line for reports

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens over all requests."""
        return sum(len(request.prompt_token_ids) for request in self.requests)

    @property
    def num_output_tokens(self) -> int:
        """Tokens to generate over all requests."""
        return sum(request.output_len for request in self.requests)


def vocab_ids(tokenizer) -> list[int]:
    """The token ids safe for random prompts: the tokenizer's vocabulary without its special and added tokens."""
    excluded = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return [token_id for token_id in range(len(tokenizer)) if token_id not in excluded]


def sample_lengths(rng: np.random.Generator, num: int, distribution: str, mean: int, low: int, high: int,
                   name: str = "length") -> np.ndarray:
    """`num` lengths, int64 array (num,): "fixed" all `mean`; "uniform" integers in [low, high]; "lognormal"
    median `mean` with sigma LOGNORMAL_SIGMA (a long tail), rounded and clipped to [low, high]. ValueError
    naming `name` and the bad argument."""
    if distribution not in LENGTH_DISTRIBUTIONS:
        raise ValueError(f"{name}: distribution must be one of {', '.join(LENGTH_DISTRIBUTIONS)}, "
                         f"got {distribution!r}")
    if num < 0:
        raise ValueError(f"{name}: num must be >= 0, got {num}")
    if distribution == "fixed":
        if mean < 1:
            raise ValueError(f"{name}: the fixed length (mean) must be >= 1, got {mean}")
        return np.full(num, mean, dtype=np.int64)
    if not 1 <= low <= high:
        raise ValueError(f"{name}: the range needs 1 <= low <= high, got low={low}, high={high}")
    if distribution == "uniform":
        return rng.integers(low, high, size=num, endpoint=True, dtype=np.int64)
    if not low <= mean <= high:
        raise ValueError(f"{name}: the lognormal median (mean) must lie in [low, high] = [{low}, {high}], "
                         f"got {mean}")
    lengths = rng.lognormal(mean=math.log(mean), sigma=LOGNORMAL_SIGMA, size=num)  # (num,) float64
    return np.clip(np.rint(lengths), low, high).astype(np.int64)


def _vocab_array(ids: range | Sequence[int]) -> np.ndarray:
    """`ids` as an int64 array (V,); ValueError when empty."""
    array = np.asarray(ids, dtype=np.int64)
    if array.size == 0:
        raise ValueError("vocab_ids is empty: no ordinary tokens to draw prompts from")
    return array


def _draw(rng: np.random.Generator, vocab: np.ndarray, length: int) -> tuple[int, ...]:
    """`length` token ids drawn uniformly from `vocab`."""
    return tuple(vocab[rng.integers(0, len(vocab), size=length)].tolist())


def _check_positive(**values: float) -> None:
    """ValueError naming the first of `values` that is < 1."""
    for key, value in values.items():
        if value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")


def _describe_lengths(distribution: str, mean: int, low: int, high: int) -> str:
    """How lengths are drawn, in a few words."""
    if distribution == "fixed":
        return f"fixed {mean}"
    if distribution == "uniform":
        return f"uniform {low}-{high}"
    return f"lognormal median {mean} in {low}-{high}"


def _mean_lengths(requests: Sequence[BenchRequest]) -> str:
    """The mean prompt and output lengths, for a description."""
    prompt = sum(len(request.prompt_token_ids) for request in requests) / len(requests)
    output = sum(request.output_len for request in requests) / len(requests)
    return f"mean prompt {prompt:.1f} tokens, mean output {output:.1f} tokens"


def random_workload(num_requests: int, vocab_ids: range | Sequence[int], input_dist: str, input_mean: int,
                    input_low: int, input_high: int, output_dist: str, output_mean: int, output_low: int,
                    output_high: int, seed: int) -> Workload:
    """Prompts of random ordinary tokens, with input and output lengths drawn from the given distributions
    (see sample_lengths)."""
    _check_positive(num_requests=num_requests)
    vocab = _vocab_array(vocab_ids)
    rng = np.random.default_rng(seed)
    input_lens = sample_lengths(rng, num_requests, input_dist, input_mean, input_low, input_high, "input length")
    output_lens = sample_lengths(rng, num_requests, output_dist, output_mean, output_low, output_high,
                                 "output length")
    requests = tuple(BenchRequest(_draw(rng, vocab, int(input_len)), int(output_len))
                     for input_len, output_len in zip(input_lens, output_lens))
    description = (f"{num_requests} random-token requests, input "
                   f"{_describe_lengths(input_dist, input_mean, input_low, input_high)}, output "
                   f"{_describe_lengths(output_dist, output_mean, output_low, output_high)}; "
                   f"{_mean_lengths(requests)}")
    return Workload("random", requests, description)


def shared_prefix_workload(num_requests: int, vocab_ids: range | Sequence[int], prefix_len: int,
                           question_len: int, output_len: int, seed: int) -> Workload:
    """One random prefix of `prefix_len` tokens (a system prompt) shared by every request, each followed by
    its own distinct random question of `question_len` tokens."""
    _check_positive(num_requests=num_requests, prefix_len=prefix_len, question_len=question_len,
                    output_len=output_len)
    vocab = _vocab_array(vocab_ids)
    if len(vocab) ** question_len < num_requests:
        raise ValueError(f"question_len {question_len} is too short for {num_requests} distinct questions")
    rng = np.random.default_rng(seed)
    prefix = _draw(rng, vocab, prefix_len)
    questions: dict[tuple[int, ...], None] = {}  # distinct questions, in drawing order
    while len(questions) < num_requests:
        questions[_draw(rng, vocab, question_len)] = None
    requests = tuple(BenchRequest(prefix + question, output_len) for question in questions)
    description = (f"{num_requests} requests sharing a {prefix_len}-token prefix, each with its own "
                   f"{question_len}-token question, output {output_len}")
    return Workload("shared-prefix", requests, description)


def long_prompt_mix_workload(num_requests: int, vocab_ids: range | Sequence[int], short_len: int, long_len: int,
                             long_fraction: float, output_len: int, seed: int) -> Workload:
    """Mostly `short_len`-token prompts with `long_len`-token ones spread evenly among them (a share of
    `long_fraction`, at least one when it is > 0): long prefills arriving while short requests decode,
    which chunked prefill is for."""
    _check_positive(num_requests=num_requests, short_len=short_len, long_len=long_len, output_len=output_len)
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
    vocab = _vocab_array(vocab_ids)
    rng = np.random.default_rng(seed)
    num_long = max(1, round(long_fraction * num_requests)) if long_fraction > 0 else 0
    phase = rng.random()  # where in its stretch of num_requests / num_long requests each long prompt falls
    long_positions = {int((k + phase) * num_requests / num_long) for k in range(num_long)}
    requests = tuple(BenchRequest(_draw(rng, vocab, long_len if i in long_positions else short_len), output_len)
                     for i in range(num_requests))
    description = (f"{num_requests} requests: {num_long} with {long_len}-token prompts spread among "
                   f"{num_requests - num_long} with {short_len}-token prompts, output {output_len}")
    return Workload("long-prompt-mix", requests, description)


def _first_exchange(entry: dict) -> tuple[str, str] | None:
    """(first human turn, first gpt reply after it) of a ShareGPT entry; None when it has no such pair."""
    prompt = None
    for turn in entry.get("conversations", []):
        if prompt is None and turn.get("from") == "human":
            prompt = turn.get("value", "")
        elif prompt is not None and turn.get("from") == "gpt":
            return prompt, turn.get("value", "")
    return None


def sharegpt_workload(path: str | None, tokenizer, num_requests: int, seed: int, max_model_len: int) -> Workload:
    """Requests from a ShareGPT JSON file (the bundled sample when `path` is None), by vLLM's rule: the prompt
    is a conversation's first human turn, the output length the token count of the reply to it; pairs with a
    prompt or reply under 4 tokens, or together over `max_model_len`, are skipped. The conversations are
    shuffled with `seed`, and the first `num_requests` usable ones taken. Prompt ids are
    `tokenizer.encode(text)`, as the engine encodes a text prompt."""
    _check_positive(num_requests=num_requests)
    name, data = load_sharegpt(path)
    rng = np.random.default_rng(seed)
    requests = []
    for index in rng.permutation(len(data)):
        exchange = _first_exchange(data[index])
        if exchange is None:
            continue
        prompt, reply = exchange
        prompt_ids = tokenizer.encode(prompt)
        output_len = len(tokenizer.encode(reply, add_special_tokens=False))
        if (len(prompt_ids) < SHAREGPT_MIN_TOKENS or output_len < SHAREGPT_MIN_TOKENS
                or len(prompt_ids) + output_len > max_model_len):
            continue
        requests.append(BenchRequest(tuple(prompt_ids), output_len, prompt))
        if len(requests) == num_requests:
            break
    if len(requests) < num_requests:
        raise ValueError(f"{name} has only {len(requests)} usable conversations (prompt and reply of at least "
                         f"{SHAREGPT_MIN_TOKENS} tokens, together at most max_model_len {max_model_len}); "
                         f"{num_requests} requested")
    description = f"{num_requests} ShareGPT conversations from {name}; {_mean_lengths(requests)}"
    return Workload("sharegpt", tuple(requests), description)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the workload options (an argument group) to `parser`; callers may change their defaults afterwards
    with parser.set_defaults."""
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", choices=WORKLOADS, default="random",
                       help="which requests to send (default %(default)s)")
    group.add_argument("--num-requests", type=int, default=128, help="requests in the workload (default %(default)s)")
    group.add_argument("--input-len-dist", choices=LENGTH_DISTRIBUTIONS, default="uniform",
                       help="random workload: how prompt lengths are drawn (default %(default)s)")
    group.add_argument("--input-len", type=int, default=128,
                       help="random workload: the fixed prompt length, or the lognormal median (default %(default)s)")
    group.add_argument("--input-len-range", type=int, nargs=2, metavar=("LOW", "HIGH"), default=[16, 256],
                       help="random workload: bounds of uniform or lognormal prompt lengths (default %(default)s)")
    group.add_argument("--output-len-dist", choices=LENGTH_DISTRIBUTIONS, default="lognormal",
                       help="random workload: how output lengths are drawn (default %(default)s)")
    group.add_argument("--output-len", type=int, default=64,
                       help="output tokens per request: the fixed length, or the random workload's lognormal "
                            "median (default %(default)s)")
    group.add_argument("--output-len-range", type=int, nargs=2, metavar=("LOW", "HIGH"), default=[8, 384],
                       help="random workload: bounds of uniform or lognormal output lengths (default %(default)s)")
    group.add_argument("--prefix-len", type=int, default=1024,
                       help="shared-prefix: tokens of the shared prefix (default %(default)s)")
    group.add_argument("--question-len", type=int, default=32,
                       help="shared-prefix: tokens of each request's own question (default %(default)s)")
    group.add_argument("--long-prompt-len", type=int, default=1024,
                       help="long-prompt-mix: tokens of a long prompt (default %(default)s)")
    group.add_argument("--short-prompt-len", type=int, default=64,
                       help="long-prompt-mix: tokens of a short prompt (default %(default)s)")
    group.add_argument("--long-fraction", type=float, default=0.1,
                       help="long-prompt-mix: the share of long prompts (default %(default)s)")
    group.add_argument("--dataset-path", default=None,
                       help="sharegpt: a ShareGPT-format JSON file (default: the bundled generated sample)")
    group.add_argument("--seed", type=int, default=0, help="seed of the workload (default %(default)s)")


def _check_fits(workload: str, longest: int, flags: str, max_model_len: int) -> None:
    """ValueError when a request of `longest` prompt + output tokens cannot fit in `max_model_len`."""
    if longest > max_model_len:
        raise ValueError(f"the {workload} workload may need {longest} prompt + output tokens for one request, "
                         f"more than max_model_len {max_model_len}: lower {flags}")


def workload_from_args(args: argparse.Namespace, tokenizer, max_model_len: int) -> Workload:
    """The workload the options of add_workload_arguments describe; ValueError when a request could need
    more than `max_model_len` prompt + output tokens."""
    if args.workload == "sharegpt":
        return sharegpt_workload(args.dataset_path, tokenizer, args.num_requests, args.seed, max_model_len)
    ids = vocab_ids(tokenizer)
    if args.workload == "random":
        input_low, input_high = args.input_len_range
        output_low, output_high = args.output_len_range
        longest_input = args.input_len if args.input_len_dist == "fixed" else input_high
        longest_output = args.output_len if args.output_len_dist == "fixed" else output_high
        _check_fits("random", longest_input + longest_output,
                    "--input-len/--input-len-range or --output-len/--output-len-range", max_model_len)
        return random_workload(args.num_requests, ids, args.input_len_dist, args.input_len, input_low, input_high,
                               args.output_len_dist, args.output_len, output_low, output_high, args.seed)
    if args.workload == "shared-prefix":
        _check_fits("shared-prefix", args.prefix_len + args.question_len + args.output_len,
                    "--prefix-len, --question-len or --output-len", max_model_len)
        return shared_prefix_workload(args.num_requests, ids, args.prefix_len, args.question_len, args.output_len,
                                      args.seed)
    if args.workload == "long-prompt-mix":
        _check_fits("long-prompt-mix", max(args.long_prompt_len, args.short_prompt_len) + args.output_len,
                    "--long-prompt-len, --short-prompt-len or --output-len", max_model_len)
        return long_prompt_mix_workload(args.num_requests, ids, args.short_prompt_len, args.long_prompt_len,
                                        args.long_fraction, args.output_len, args.seed)
    raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, got {args.workload!r}")
