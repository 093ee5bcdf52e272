"""The grammar engine behind structured output: llguidance (chosen by measurement, benchmarks/grammar_engines.py:
on this CPU it compiles a typical JSON schema in ~2 ms against xgrammar's ~7 ms at a like per-token mask time,
and it depends on nothing, where xgrammar needs torch and triton at run time).

`GrammarCompiler` turns `StructuredOutputsParams` into a validated grammar, once per distinct constraint (an LRU
cache), on a thread pool so the engine loop never waits for a compile (`submit`). A request's `RequestGrammar`
follows its output through its own `Matcher`: `fill` writes the (V/32,) int32 bitmask of the tokens allowed next,
`accept` advances with the sampled token. For a reasoning model the grammar applies to the answer, after the
thinking (structured/constraint.py). (Nothing rolls a matcher back: constrained rows never verify speculative
proposals, and a preempted request keeps the tokens its matcher took.)
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import re
import threading

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from jaxserve.structured.params import StructuredOutputsParams

CACHE_SIZE = 256  # distinct compiled constraints kept
COMPILE_THREADS = 2


def grammar_text(params: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer) -> str:
    """llguidance's grammar (its top-level JSON, or Lark) for a constraint; ValueError for one it cannot read."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.spec if kind == "json" else json.dumps({"type": "object"})
        return llguidance.LLMatcher.grammar_from_json_schema(schema, _json_options(params))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(choice) for choice in params.choice))
    if kind == "structural_tag":
        return _structural_tag_grammar(params, tokenizer)
    return llguidance.LLMatcher.grammar_from_lark(any_to_lark(params.grammar))  # GBNF (`::=`) converted


def _json_options(params: StructuredOutputsParams) -> dict | None:
    """llguidance's JSON options (its `x-guidance`) for the constraint's whitespace rule; None: its default, any
    JSON whitespace between tokens."""
    if params.whitespace_pattern is not None:
        return {"whitespace_pattern": params.whitespace_pattern}
    if params.disable_any_whitespace:
        return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return None


def _structural_tag_grammar(params: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer) -> str:
    """The Lark grammar of a structural tag (llguidance's `StructTag`s, as vLLM's guidance backend builds them):
    free text, in which a trigger starts the structure whose begin the text goes on with, its schema's JSON (under
    the constraint's whitespace rule) and its end. Triggers shaped `<...>` are matched as the special tokens they
    name when every one is such a token of the model (llguidance's assumption), else all as text."""
    def with_options(schema: dict) -> dict:  # the schema with its JSON options in, as the json kind's grammar has it
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, _json_options(params))
        return json.loads(grammar)["grammars"][0]["json_schema"]

    tags = [llguidance.StructTag(trigger=trigger, begin=begin, grammar=with_options(schema), end=end)
            for trigger, begin, schema, end in params.structures]
    shaped = {tag.trigger for tag in tags if tag.trigger.startswith("<") and tag.trigger.endswith(">")}
    special = all(len(ids := tokenizer.tokenize_str(trigger)) == 1 and tokenizer.is_special_token(ids[0])
                  for trigger in shaped)
    return llguidance.StructTag.to_grammar(tags, assume_special=special)


class GrammarCompiler:
    """Compiles constraints for one tokenizer: validated llguidance grammars, cached, off the caller's thread."""

    def __init__(self, hf_tokenizer, vocab_size: int):
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size
        self._cache: collections.OrderedDict[tuple, str] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")

    def compile(self, params: StructuredOutputsParams) -> str:
        """The validated grammar of `params` (from the cache when compiled before); ValueError naming what is
        wrong with a constraint the engine cannot compile."""
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            grammar = grammar_text(params, self.tokenizer)
        except (ValueError, RuntimeError, GbnfToLarkError) as error:
            raise ValueError(f"cannot compile the {params.kind} constraint: {error}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"cannot compile the {params.kind} constraint: {error}")
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """`compile` on the thread pool: a future of the grammar (or of its ValueError)."""
        return self._pool.submit(self.compile, params)

    def matcher(self, grammar: str) -> "Matcher":
        """A fresh matcher at the start of `grammar`."""
        return Matcher(llguidance.LLMatcher(self.tokenizer, grammar), self.vocab_size)

    def request_grammar(self, compiled: concurrent.futures.Future) -> "RequestGrammar":
        """One engine request's view of a compile (`submit`'s future): it gets its own matcher."""
        return RequestGrammar(self, compiled)


class RequestGrammar:
    """One engine request's grammar: its compile (a future, shared by a request's samples) and, once compiled, its
    own matcher. Where in the reply it applies (after a reasoning model's thinking) is its ReplyConstraint's
    business (structured/constraint.py)."""

    def __init__(self, compiler: GrammarCompiler, compiled: concurrent.futures.Future):
        self._compiler = compiler
        self._compiled = compiled
        self._matcher: Matcher | None = None

    @property
    def ready(self) -> bool:
        """The compile is done (or failed)."""
        return self._compiled.done()

    @property
    def compile(self) -> concurrent.futures.Future:
        """The compile (a future of the grammar), to wait on."""
        return self._compiled

    @property
    def error(self) -> str | None:
        """Why the compile failed, once it has; None otherwise."""
        if not self._compiled.done() or self._compiled.exception() is None:
            return None
        return str(self._compiled.exception())

    @property
    def matcher(self) -> "Matcher":
        """The request's matcher (made on first use, after the compile)."""
        if self._matcher is None:
            self._matcher = self._compiler.matcher(self._compiled.result())
        return self._matcher

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens the grammar allows next into row `row` of `bitmask` (R, V/32) int32."""
        self.matcher.fill(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Take a sampled token; False when the grammar does not allow it."""
        return self.matcher.accept(token_id)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete (it allows nothing more but EOS)."""
        return self.matcher.is_finished


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` (R, V/32) int32 (bit t % 32 of word t // 32)."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance with a sampled token; False (and the matcher unchanged) when the grammar does not allow it."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more (only EOS)."""
        return bool(self._matcher.is_stopped())
