"""Generate jaxserve/bench/data/sharegpt_sample.json, the small ShareGPT-format sample `jaxserve bench` ships.

Pure Python, deterministic (seeded word lists and templates, no download). From the repository root:
    python scripts/make_sharegpt_sample.py
The file is a JSON list of {"id": ..., "conversations": [{"from": "human" | "gpt", "value": ...}, ...]}: about
200 conversations about Python programming, in English prose with Python code blocks (text the bundled
tiny-stdlib-llama tokenizer, trained on Python's standard library, encodes well). Prompt and reply lengths are
long-tailed, as in real ShareGPT data; some conversations have several exchanges, and a few have a prompt or
reply too short to use, or no reply at all, so that the benchmark's filtering rule has something to skip.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "jaxserve" / "bench" / "data" / "sharegpt_sample.json"
SEED = 0
NUM_CONVERSATIONS = 200

NOUNS = ["file", "list", "dictionary", "string", "function", "class", "module", "request", "response", "server",
         "client", "cache", "queue", "thread", "process", "socket", "parser", "config", "logger", "database",
         "table", "record", "path", "directory", "iterator", "generator", "decorator", "exception", "test",
         "buffer", "stream", "token", "callback", "event", "handler", "array", "number", "date", "header", "line"]
VERBS = ["read", "write", "parse", "sort", "merge", "filter", "validate", "format", "load", "save", "open",
         "close", "send", "receive", "encode", "decode", "compress", "split", "join", "count", "search",
         "replace", "convert", "copy", "delete", "update", "create", "check", "print", "cache"]
ADJECTIVES = ["large", "small", "empty", "nested", "sorted", "new", "old", "temporary", "default", "remote",
              "local", "binary", "unicode", "simple", "slow", "missing", "invalid", "shared", "global", "frozen"]
MODULES = ["os", "sys", "json", "re", "collections", "itertools", "functools", "pathlib", "logging", "threading",
           "asyncio", "subprocess", "datetime", "csv", "socket", "typing", "dataclasses", "unittest", "io", "heapq"]
ARGS = ["items", "data", "path", "text", "values", "lines", "records", "names", "config", "stream"]

SENTENCES = [
    "I have a {adj} {noun} that I need to {verb}.",
    "The {noun} should {verb} every {noun2} in the {adj} {noun3}.",
    "When I {verb} the {noun}, the program raises an exception.",
    "My {noun} works for a {adj} {noun2} but not for a {adj2} one.",
    "It is important to {verb} the {noun} before you {verb2} the {noun2}.",
    "This approach keeps the {noun} {adj} and easy to test.",
    "You can use the {module} module to {verb} the {noun}.",
    "In most cases the {noun} is {adj}, so there is nothing to {verb}.",
    "Note that the {noun} is not thread safe, so you should {verb} it under a lock.",
    "The {noun} returns None if the {noun2} is {adj}.",
    "First, {verb} the {noun}; then {verb2} each {noun2} in a loop.",
    "Python makes it easy to {verb} a {noun} with a few lines of code.",
    "If the {noun} is {adj}, the function will {verb} the {noun2} instead.",
    "The documentation of the {module} module explains how to {verb} a {noun}.",
    "A {adj} {noun} takes more memory, because each {noun2} keeps a reference to it.",
    "Remember to {verb} the {noun} in a finally block, even when an exception is raised.",
    "The second call will {verb} the same {noun} again, which is why the result looks wrong.",
]
QUESTIONS = [
    "How do I {verb} a {adj} {noun} in Python?",
    "What is the best way to {verb} a {noun} without changing the {noun2}?",
    "Why does my {noun} fail when I {verb} it twice?",
    "Can you write a function that {verbs} a {noun} and returns a {noun2}?",
    "What is the difference between a {noun} and a {noun2}?",
    "Could you explain how the {module} module handles a {adj} {noun}?",
    "Is there a faster way to {verb} every {noun} in a {adj} {noun2}?",
    "How can I test the code that {verbs} the {noun}?",
]
FOLLOW_UPS = [
    "Thanks. What if the {noun} is {adj}?",
    "Can you make it {verb} the {noun2} as well?",
    "Does this work with the {module} module?",
    "How would I write a test for that?",
    "Could you explain the second part again?",
]
INTROS = [
    "Sure! Here is how you can {verb} a {noun}.",
    "Good question. The short answer is that the {noun} is {adj}.",
    "There are a few ways to {verb} a {noun} in Python.",
    "The problem is in the way the {noun} is created.",
]
CLOSINGS = [
    "Let me know if you have any other questions.",
    "I hope this helps!",
    "This should {verb} the {noun} correctly.",
    "",
]
TRIVIAL = [("Hi", "Hello! How can I help you today?"), ("Thanks!", "You're welcome."), ("ok", "Great."),
           ("Explain the difference between a list and a tuple in one word.", "Mutability.")]
SIMPLE_STATEMENTS = [
    "result.append(item)", "count += 1", "data[key] = value", "value = {verb}_{noun}(item)",
    "logger.debug(\"{verb} %s\", item)", "raise ValueError(f\"invalid {noun}: {{item!r}}\")", "continue",
    "key = item.strip().lower()", "items = sorted({arg}, key=len)", "total = sum(len(x) for x in {arg})",
    "text = f.read()", "lines = text.splitlines()", "seen.add(key)", "return None",
]
OPENERS = [
    "for item in {arg}:", "if {arg} is None:", "if not item:", "with open(path, encoding=\"utf-8\") as f:",
    "while queue:", "for key, value in data.items():", "if isinstance(item, str):", "if key in seen:",
]


def third_person(verb: str) -> str:
    """'parse' -> 'parses', 'search' -> 'searches', 'copy' -> 'copies'."""
    if verb.endswith("y"):
        return verb[:-1] + "ies"
    if verb.endswith(("s", "sh", "ch", "x")):
        return verb + "es"
    return verb + "s"


def fill(rng: random.Random, template: str) -> str:
    """A template with random words in its {placeholders}."""
    verb = rng.choice(VERBS)
    return template.format(
        noun=rng.choice(NOUNS), noun2=rng.choice(NOUNS), noun3=rng.choice(NOUNS), verb=verb,
        verb2=rng.choice(VERBS), verbs=third_person(verb), adj=rng.choice(ADJECTIVES),
        adj2=rng.choice(ADJECTIVES), module=rng.choice(MODULES), arg=rng.choice(ARGS),
    )


def long_tailed(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    """A lognormal count with the given median, rounded and clipped to [low, high]."""
    return max(low, min(high, round(rng.lognormvariate(math.log(median), sigma))))


def prose(rng: random.Random, num_sentences: int) -> str:
    """Sentences in paragraphs of up to four."""
    sentences = [fill(rng, rng.choice(SENTENCES)) for _ in range(num_sentences)]
    return "\n\n".join(" ".join(sentences[i:i + 4]) for i in range(0, len(sentences), 4))


def code_block(rng: random.Random) -> str:
    """A Markdown Python code block: a function of a long-tailed number of statements."""
    verb, noun, arg = rng.choice(VERBS), rng.choice(NOUNS), rng.choice(ARGS)
    lines = [f"import {rng.choice(MODULES)}", "", "",
             f"def {verb}_{noun}s({arg}, path=None):",
             f"    \"\"\"{verb.capitalize()} each {noun} in {arg} and return the result.\"\"\"",
             "    result = []"]
    for _ in range(long_tailed(rng, 3, 0.7, 1, 12)):
        if rng.random() < 0.4:
            lines.append("    " + fill(rng, rng.choice(OPENERS)))
            lines += ["        " + fill(rng, rng.choice(SIMPLE_STATEMENTS)) for _ in range(rng.randint(1, 3))]
        else:
            lines.append("    " + fill(rng, rng.choice(SIMPLE_STATEMENTS)))
    lines.append("    return result")
    return "```python\n" + "\n".join(lines) + "\n```"


def human_turn(rng: random.Random) -> str:
    """A first question: some context, sometimes code, then the question."""
    parts = [prose(rng, long_tailed(rng, 2, 1.0, 0, 24))]
    if rng.random() < 0.4:
        parts.append("Here is my code:\n\n" + code_block(rng))
    parts.append(fill(rng, rng.choice(QUESTIONS)))
    return "\n\n".join(part for part in parts if part)


def gpt_turn(rng: random.Random, median_sentences: float) -> str:
    """An answer: an introduction, explanation, sometimes code, a closing line."""
    parts = [fill(rng, rng.choice(INTROS)), prose(rng, long_tailed(rng, median_sentences, 0.9, 1, 40))]
    if rng.random() < 0.5:
        parts.append(code_block(rng))
    parts.append(fill(rng, rng.choice(CLOSINGS)))
    return "\n\n".join(part for part in parts if part)


def conversation(rng: random.Random, index: int) -> dict:
    """One ShareGPT entry."""
    kind = rng.random()
    if kind < 0.05:
        prompt, reply = rng.choice(TRIVIAL)
        turns = [("human", prompt), ("gpt", reply)]
    elif kind < 0.07:
        turns = [("human", human_turn(rng))]
    else:
        turns = [("human", human_turn(rng)), ("gpt", gpt_turn(rng, 5))]
        for _ in range(rng.choice([0, 0, 0, 0, 1, 2])):
            turns += [("human", fill(rng, rng.choice(FOLLOW_UPS))), ("gpt", gpt_turn(rng, 2))]
    return {"id": f"sample_{index:04d}",
            "conversations": [{"from": speaker, "value": value} for speaker, value in turns]}


def main() -> None:
    """Write the sample file."""
    rng = random.Random(SEED)
    data = [conversation(rng, index) for index in range(NUM_CONVERSATIONS)]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    lines = ",\n".join(json.dumps(entry, ensure_ascii=False) for entry in data)  # one conversation a line
    OUT.write_text("[\n" + lines + "\n]\n", encoding="utf-8")
    print(f"wrote {len(data)} conversations, {OUT.stat().st_size} bytes, to {OUT}")


if __name__ == "__main__":
    main()
