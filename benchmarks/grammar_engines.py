"""Choosing the grammar engine for structured output: compile time of a typical JSON schema and the host time of
one token bitmask, for llguidance and xgrammar, on the bundled model's tokenizer.

    python benchmarks/grammar_engines.py --runs 5

Each engine compiles SCHEMA (a fresh compile per run: caches cleared or a new compiler), then walks `--tokens`
steps of a constrained generation: at each step it computes the (V/32,) int32 allowed-token bitmask, and the walk
takes a random allowed token (seeded) and advances the matcher; a walk that reaches an accepting end restarts.
Both engines walk the same way, alternating runs. Reports mean and best of compile ms and of mask us per token.
xgrammar needs torch (its bitmask helpers), so it is measured only where torch is installed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "tags"],
}


def llguidance_engine(hf_tokenizer):
    """(compile(schema) -> matcher, fill(matcher, mask), advance(matcher, token), accepting(matcher))."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)

    def compile_schema(schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def fill(matcher, mask):
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)

    return compile_schema, fill, lambda m, t: m.consume_token(t), lambda m: m.is_stopped(), tokenizer.vocab_size


def xgrammar_engine(hf_tokenizer):
    """The same four functions over xgrammar (torch bitmasks)."""
    import torch
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=len(hf_tokenizer))

    def compile_schema(schema):
        compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        return xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))

    buffer = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def fill(matcher, mask):
        matcher.fill_next_token_bitmask(buffer, 0)
        mask[:] = buffer.numpy()

    del torch
    return compile_schema, fill, lambda m, t: m.accept_token(t), lambda m: m.is_terminated(), info.vocab_size


def allowed(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a (1, V/32) int32 bitmask allows."""
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def walk(engine, num_tokens: int, seed: int) -> tuple[float, list[float]]:
    """(compile seconds, mask seconds of every step) of one constrained walk."""
    compile_schema, fill, advance, finished, vocab_size = engine
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    matcher = compile_schema(SCHEMA)
    compile_seconds = time.perf_counter() - start
    mask = np.zeros((1, (vocab_size + 31) // 32), np.int32)
    mask_seconds = []
    for _ in range(num_tokens):
        start = time.perf_counter()
        fill(matcher, mask)
        mask_seconds.append(time.perf_counter() - start)
        choices = allowed(mask, vocab_size)
        advance(matcher, int(rng.choice(choices)))
        if finished(matcher):
            matcher = compile_schema(SCHEMA)
    return compile_seconds, mask_seconds


def main() -> None:
    """Measure each available engine `--runs` times, alternating, and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    from jaxserve.engine.llm_engine import default_model_path
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    engines = {"llguidance": llguidance_engine(hf_tokenizer)}
    try:
        engines["xgrammar"] = xgrammar_engine(hf_tokenizer)
    except ImportError as error:
        print(f"xgrammar not measured: {error}")
    results = {name: {"compile": [], "mask": []} for name in engines}
    for run in range(args.runs):
        for name, engine in engines.items() if run % 2 == 0 else reversed(engines.items()):
            compile_seconds, mask_seconds = walk(engine, args.tokens, seed=run)
            results[name]["compile"].append(compile_seconds)
            results[name]["mask"].append(statistics.mean(mask_seconds))
    print(f"JSON schema of {len(SCHEMA['properties'])} properties, vocabulary {hf_tokenizer.vocab_size}, "
          f"{args.runs} runs of {args.tokens} tokens\n")
    print("| engine | compile ms mean | best | mask us/token mean | best |\n|---|---|---|---|---|")
    for name, result in results.items():
        print(f"| {name} | {1e3 * statistics.mean(result['compile']):.2f} | {1e3 * min(result['compile']):.2f} | "
              f"{1e6 * statistics.mean(result['mask']):.1f} | {1e6 * min(result['mask']):.1f} |")


if __name__ == "__main__":
    main()
