"""The server's host time for splitting a streamed reasoning reply, per token, as the reply grows.

    python benchmarks/reply_parsing.py --runs 3

A gpt-oss reply of `--thinking` tokens of analysis and a quarter as many of answer (harmony markers, random words
from a small list, seeded) is streamed one token at a time through the chat route's two streams: the reasoning
split, then the `openai` tool call parser over its content; so is a DeepSeek-R1 style reply of the same length
(`</think>` then the answer, the Hermes tool parser). Each reasoning split is timed two ways side by side on the
same tokens: its parser's own stream (what the server runs: each token read once; `HarmonyStream`,
`ReasoningStream`) and `Resplit`, the whole reply split again at every token (how both streamed before). Each
system streams its reply once to warm up (both ways must hand out the same text), then `--runs` timed times; mean
and best microseconds per token.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from jaxserve.engine.harmony import MARKERS, HarmonyReasoning
from jaxserve.engine.reasoning import ReasoningParser
from jaxserve.server.tools import HarmonyParser, HermesParser, ToolCallStream

WORDS = ["the ", "user ", "wants ", "a ", "list ", "of ", "primes", ". ", "\n"]
HARMONY = HarmonyReasoning({marker: i for i, marker in enumerate(MARKERS)}, (), ())  # token ids unused here
THINK = ReasoningParser("<think>", "</think>", 0, 1)


class Resplit:
    """The baseline stream: the whole reply split again at every delta, the deltas cut off what was handed out."""

    def __init__(self, parser, thinking: bool):
        self.parser, self.thinking, self.text, self.sent = parser, thinking, "", (0, 0)

    def advance(self, text: str, final: bool) -> tuple[str, str]:
        self.text += text
        reasoning, content = self.parser.split(self.text, self.thinking, final)
        deltas = reasoning[self.sent[0]:], content[self.sent[1]:]
        self.sent = (len(reasoning), len(content))
        return deltas


def replies(thinking: int, seed: int) -> tuple[list[str], list[str]]:
    """(a harmony reply's tokens, a `</think>` reply's tokens): `thinking` tokens of thinking, a quarter as many of
    answer."""
    rng = random.Random(seed)
    thought = [rng.choice(WORDS) for _ in range(thinking)]
    answer = [rng.choice(WORDS) for _ in range(thinking // 4)]
    harmony = ["<|channel|>", "analysis", "<|message|>", *thought, "<|end|>", "<|start|>", "assistant", "<|channel|>",
               "final", "<|message|>", *answer]
    return harmony, [*thought, "</think>", *answer]


def stream_reply(tokens: list[str], reasoning, tools) -> tuple[float, tuple[str, str]]:
    """(seconds to stream `tokens` through a reasoning stream and a tool call stream, as the chat route does; the
    reasoning and content they handed out)."""
    thought, content = [], []
    start = time.perf_counter()
    for i, token in enumerate(tokens):
        final = i == len(tokens) - 1
        reasoning_delta, said = reasoning.advance(token, final)
        delta = tools.advance(said, final)
        thought.append(reasoning_delta)
        content.append(delta.get("content", ""))
    return time.perf_counter() - start, ("".join(thought), "".join(content))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--thinking", type=int, nargs="+", default=[2000, 8000, 20000])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    systems = {  # name -> (the reply: harmony or </think>, its two streams)
        "harmony, HarmonyStream": (0, lambda: (HARMONY.stream(False), ToolCallStream(HarmonyParser()))),
        "harmony, Resplit": (0, lambda: (Resplit(HARMONY, False), ToolCallStream(HarmonyParser()))),
        "</think>, ReasoningStream": (1, lambda: (THINK.stream(True), ToolCallStream(HermesParser()))),
        "</think>, Resplit": (1, lambda: (Resplit(THINK, True), ToolCallStream(HermesParser()))),
    }
    print(f"{'reply tokens':>12}  {'system':<28} {'mean us/token':>14} {'best us/token':>14}")
    for thinking in args.thinking:
        both = replies(thinking, args.seed)
        outputs = {}
        for name, (reply, make) in systems.items():
            tokens = both[reply]
            _, outputs[name] = stream_reply(tokens, *make())  # warm-up
            times = [stream_reply(tokens, *make())[0] * 1e6 / len(tokens) for _ in range(args.runs)]
            print(f"{len(tokens):>12}  {name:<28} {statistics.mean(times):>14.1f} {min(times):>14.1f}")
        for kind in ("harmony", "</think>"):
            if len({outputs[name] for name in systems if name.startswith(kind)}) != 1:
                raise SystemExit(f"the {kind} reply's two streams handed out different text")


if __name__ == "__main__":
    main()
