"""What one request's next token may be: `ReplyConstraint`, the one object the scheduler and the batch builder see.

A reply may have two parts, each constrained its own way:

- the thinking of a reasoning model (`ThinkingSection`): free, unless the request gives a `thinking_token_budget`;
  once that many thinking tokens are written, the section's end is forced one token at a time (each sampling row's
  mask allows that token alone: `</think>`, or harmony's `<|end|><|start|>assistant<|channel|>final<|message|>`
  from wherever the message stands, or the engine's `reasoning_end_str`), as vLLM's thinking budget does. The
  section ends at its end tokens, the model's own or the forced ones;
- the answer: its grammar's (structured output, structured/grammar.py), or free.

The masks go through the sampler's token bitmask, filled once the step in flight has brought its tokens, so forcing
costs no executable of its own. A row whose next tokens are certainly free (`is_free`: free thinking before the
budget runs out, a free answer) needs no mask, and may sample several tokens in a row or verify speculative
proposals.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the grammar engine loads only for requests that use it
    from jaxserve.structured.grammar import RequestGrammar

HISTORY = 8  # the last tokens (prompt, then reply) a thinking section keeps: where its forced end goes on from


class ThinkingSection:
    """A reply's thinking: free until its end tokens (`ends_with`, in a row), or, with a budget, until that many
    tokens of it are written, then the end `budget_end(last tokens)` names is forced. `opens_with`: a first token
    that alone opens the thinking, for a model that opens it itself (any other first token: no thinking)."""

    def __init__(self, ends_with: Sequence[int], opens_with: int | None, budget: int | None,
                 budget_end: Callable[[tuple[int, ...]], tuple[int, ...]], prompt_tail: Sequence[int]):
        self.ends_with = tuple(ends_with)
        self.opens_with = opens_with  # None once the first token is taken (or when the reply starts in the thinking)
        self.budget = budget  # thinking tokens still free before the end is forced; None: no budget
        self.budget_end = budget_end
        self.recent = tuple(prompt_tail)[-HISTORY:]  # (<= HISTORY,) the last token ids
        self.forcing: tuple[int, ...] = ()  # the forced end's tokens still to come
        self.over = False
        if opens_with is None:
            self._force_if_spent()

    @property
    def forced_token(self) -> int | None:
        """The one token the next sample may be, once the budget is spent; None while the thinking is free."""
        return self.forcing[0] if self.forcing else None

    def take(self, token_id: int) -> bool:
        """Take one sampled token of the thinking; False for a token other than the forced one."""
        if self.forcing:
            if token_id != self.forcing[0]:
                return False
            self.forcing = self.forcing[1:]
            self.over = not self.forcing
            return True
        self.recent = (*self.recent, token_id)[-HISTORY:]
        if self.recent[-len(self.ends_with):] == self.ends_with:
            self.over = True
        elif self.opens_with is not None:  # the opening marker is not thinking: it costs no budget
            self.opens_with = None
            self._force_if_spent()
        elif self.budget is not None:
            self.budget -= 1
            self._force_if_spent()
        return True

    def free_tokens(self) -> int | None:
        """How many next tokens are certainly free (None: all of them until the section ends)."""
        if self.forcing:
            return 0
        if self.budget is None:
            return None
        return self.budget + (self.opens_with is not None)

    def _force_if_spent(self) -> None:
        if self.budget is not None and self.budget <= 0:
            self.forcing = self.budget_end(self.recent)


class ReplyConstraint:
    """One request's constraint on its next token: its thinking section's (while it lasts), then its answer
    grammar's. `grammar`: the answer's (None: a free answer); `thinking`: the reply's thinking (None: the reply
    has none, or a grammar applies from its first token)."""

    def __init__(self, grammar: RequestGrammar | None, thinking: ThinkingSection | None):
        self.grammar = grammar
        self.thinking = thinking  # None once the thinking is over
        self.num_taken = 0  # the reply's tokens taken so far (the next sample's index)

    @property
    def ready(self) -> bool:
        """The grammar's compile is done (or failed); always, without a grammar."""
        return self.grammar is None or self.grammar.ready

    @property
    def error(self) -> str | None:
        """Why the grammar's compile failed, once it has; None otherwise."""
        return None if self.grammar is None else self.grammar.error

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` (R, V/32) int32; a free row is left as it is
        (every bit set): free thinking, a free answer."""
        section = self.thinking
        if section is not None and section.opens_with is None:
            forced = section.forced_token
            if forced is not None:
                bitmask[row] = 0
                _allow(bitmask, row, forced)
            return
        if self.grammar is not None:
            self.grammar.fill(bitmask, row)
            if section is not None:  # the first token: the grammar's, or the one that opens the thinking
                _allow(bitmask, row, section.opens_with)

    def accept(self, token_id: int) -> bool:
        """Take a sampled token; False when the constraint does not allow it (the request then ends in error)."""
        self.num_taken += 1
        section = self.thinking
        if section is not None:
            if section.opens_with is not None and token_id != section.opens_with:
                self.thinking = None  # the model did not open its thinking: this is the answer's first token
            else:
                taken = section.take(token_id)
                if section.over:
                    self.thinking = None
                return taken
        return self.grammar is None or self.grammar.accept(token_id)

    def is_free(self, sample_index: int) -> bool:
        """Whether the reply's token at `sample_index` (and every one before it from the next on) is certainly
        free, whatever the tokens before it turn out to be: no mask needed up to there."""
        if self.thinking is None:
            return self.grammar is None
        if self.grammar is not None:  # the answer's grammar starts where the thinking ends, which may be soon
            return False
        free = self.thinking.free_tokens()
        return free is None or sample_index < self.num_taken + free

    @property
    def is_finished(self) -> bool:
        """The answer's grammar is complete (it allows nothing more but EOS)."""
        return self.thinking is None and self.grammar is not None and self.grammar.is_finished


def _allow(bitmask: np.ndarray, row: int, token_id: int) -> None:
    """Set `token_id`'s bit in row `row` of `bitmask` (R, V/32) int32."""
    words = bitmask.view(np.uint32)  # (R, V/32): bit arithmetic without int32's sign
    words[row, token_id // 32] |= np.uint32(1 << (token_id % 32))
