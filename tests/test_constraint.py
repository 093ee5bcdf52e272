"""A request's ReplyConstraint (structured/constraint.py) without an engine: a thinking budget's forced end, where
it goes on from in harmony's format, the rows it leaves free (`is_free`) against the masks it writes, and the
checks of `thinking_token_budget` and `reasoning_config`.

(A budget end to end, through the engine with overlap, multi-step decoding and speculation: test_reasoning.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxserve.config import EngineConfig
from jaxserve.engine.harmony import MARKERS, HarmonyReasoning
from jaxserve.engine.reasoning import ReasoningParser, with_budget_end
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured.constraint import ReplyConstraint, ThinkingSection

VOCAB = 64
START, END = 7, 8  # the marker parser's <think> and </think>
PARSER = ReasoningParser("<think>", "</think>", START, END)
IDS = {marker: 40 + i for i, marker in enumerate(MARKERS)}  # harmony's markers
ASSISTANT, FINAL, ANALYSIS = 30, 31, 32  # the token ids of "assistant", "final", "analysis"
HARMONY = HarmonyReasoning(IDS, (IDS["<|channel|>"], FINAL, IDS["<|message|>"]),
                           (IDS["<|channel|>"], ANALYSIS, IDS["<|message|>"]), (ASSISTANT,))


def _allowed(constraint: ReplyConstraint) -> set[int] | None:
    """The tokens the constraint's mask allows next; None for a row it leaves free (every bit set)."""
    bitmask = np.full((1, (VOCAB + 31) // 32), -1, np.int32)  # (1, V/32) every bit set
    constraint.fill(bitmask, 0)
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:VOCAB]  # (V,) 0 / 1
    return None if bits.all() else {int(t) for t in np.flatnonzero(bits)}


def _thinking(budget: int | None, opens_with: int | None = None, parser=PARSER,
              prompt: tuple[int, ...] = (1, 2)) -> ReplyConstraint:
    section = ThinkingSection(parser.thinking_end, opens_with, budget, parser.budget_end, prompt)
    return ReplyConstraint(None, section)


def test_a_spent_budget_forces_the_end_marker_then_the_answer_is_free():
    constraint = _thinking(3)
    for token in (20, 21, 22):
        assert _allowed(constraint) is None and constraint.accept(token)
    assert _allowed(constraint) == {END}
    assert not _thinking(0).accept(20), "a forced token must be the one sampled"
    assert constraint.accept(END) and constraint.thinking is None
    assert _allowed(constraint) is None and constraint.is_free(10 ** 6) and not constraint.is_finished


def test_the_model_s_own_end_before_the_budget_ends_the_thinking_unforced():
    constraint = _thinking(5)
    assert constraint.accept(20) and constraint.accept(END) and constraint.thinking is None
    assert all(_allowed(constraint) is None and constraint.accept(token) for token in (20, 21, 22, 23, 24, 25))


def test_a_budget_of_zero_forces_the_end_at_once_and_an_opening_marker_costs_nothing():
    assert _allowed(_thinking(0)) == {END}
    opening = _thinking(0, opens_with=START)  # Magistral: the model opens its thinking itself
    assert _allowed(opening) is None and opening.accept(START)
    assert _allowed(opening) == {END}
    not_opened = _thinking(0, opens_with=START)
    assert not_opened.accept(20) and not_opened.thinking is None and _allowed(not_opened) is None


def test_a_configured_end_is_forced_token_by_token():
    parser = ReasoningParser("<think>", "</think>", START, END, forced_end=(50, 51, END))
    constraint = _thinking(1, parser=parser)
    assert constraint.accept(20)
    for token in (50, 51, END):
        assert _allowed(constraint) == {token} and constraint.accept(token)
    assert constraint.thinking is None


@pytest.mark.parametrize("recent, forced", [
    ((IDS["<|channel|>"], ANALYSIS, IDS["<|message|>"], 20, 21), ("<|end|>", "<|start|>", "assistant", "header")),
    ((20, 21, 22), ("<|end|>", "<|start|>", "assistant", "header")),  # a long text: no marker in sight
    ((20, IDS["<|end|>"]), ("<|start|>", "assistant", "header")),
    ((IDS["<|end|>"], IDS["<|start|>"]), ("assistant", "header")),
    ((IDS["<|start|>"], ASSISTANT), ("header",)),  # the prompt's tail: the reply starts with the final message
    ((IDS["<|start|>"], ASSISTANT, IDS["<|channel|>"]), ("final", "<|message|>")),
    ((IDS["<|start|>"], ASSISTANT, IDS["<|channel|>"], ANALYSIS),
     ("<|message|>", "<|end|>", "<|start|>", "assistant", "header")),  # another channel's header: closed, empty
])
def test_harmony_forces_the_final_message_from_where_the_reply_stands(recent, forced):
    names = {**IDS, "assistant": ASSISTANT, "final": FINAL}
    want = []
    for name in forced:
        want += list(HARMONY.final_header) if name == "header" else [names[name]]
    assert HARMONY.budget_end(recent) == tuple(want)


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(0, 6), opens=st.booleans(),
       tokens=st.lists(st.sampled_from([20, 21, 22, END, START, IDS["<|end|>"]]), max_size=16))
def test_rows_called_free_are_free_and_the_thinking_never_exceeds_its_budget(budget, opens, tokens):
    """Sampling `tokens` (a forced token wherever the mask forces one): every row `is_free` promised earlier is
    left free by the mask, and the thinking has at most `budget` tokens before its end (its opening marker apart)."""
    constraint = _thinking(budget, opens_with=START if opens else None)
    promised = max((i for i in range(40) if constraint.is_free(i)), default=-1)
    reply = []
    for token in tokens:
        allowed = _allowed(constraint)
        index = len(reply)
        if index <= promised:
            assert allowed is None, f"row {index} was promised free"
        if allowed is not None:
            (token,) = allowed
        assert constraint.accept(token)
        reply.append(token)
        promised = max(promised, max((i for i in range(index, index + 40) if constraint.is_free(i)), default=-1))
    thinking = reply[1:] if opens and reply[:1] == [START] else reply
    if opens and reply[:1] != [START]:
        return  # no thinking: the reply is the answer
    ended = thinking.index(END) if END in thinking else len(thinking)
    assert ended <= budget


def test_thinking_token_budget_values():
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None  # vLLM's "no budget"
    assert SamplingParams(thinking_token_budget=0).thinking_token_budget == 0
    for bad in (-2, 1.5, "8", True):
        with pytest.raises(ValueError, match="thinking_token_budget must be an int >= 0"):
            SamplingParams(thinking_token_budget=bad)


def test_reasoning_config_values():
    config = EngineConfig(reasoning_config='{"reasoning_end_str": "Now.</think>"}')
    assert config.structured_outputs_config.reasoning_config == {"reasoning_end_str": "Now.</think>"}
    with pytest.raises(ValueError, match="unknown key.*reasoning_start_str"):
        EngineConfig(reasoning_config={"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"})
    with pytest.raises(ValueError, match="reasoning_end_str must be a non-empty string"):
        EngineConfig(reasoning_config={"reasoning_end_str": ""})


class _Tokenizer:
    """Token ids of the words of a text (the marker parser's end marker is END)."""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return [END if word == "</think>" else 50 + len(word) for word in text.replace("</think>", " </think>").split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join("</think>" if i == END else "?" for i in ids)


def test_a_configured_end_must_end_the_thinking():
    parser = with_budget_end(PARSER, "Time is up.</think>", _Tokenizer())
    assert parser.budget_end((20,)) == (54, 52, 53, END)
    with pytest.raises(ValueError, match="must end with the end of thinking"):
        with_budget_end(PARSER, "Time is up.", _Tokenizer())
