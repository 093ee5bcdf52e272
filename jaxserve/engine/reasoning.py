"""Reasoning models (`reasoning_parser`): where a model's thinking ends, in token ids and in text.

DeepSeek-R1 (and its Llama / Qwen distills, QwQ) and Qwen3 think between `<think>` and `</think>`, each one token
of their vocabulary, then answer. The chat template may open the thinking in the prompt (R1 writes `<think>\\n`
after the generation prompt), so the output usually holds only the closing marker. Mistral's reasoning models
(Magistral) think between `[THINK]` and `[/THINK]`, special tokens of their tokenizer, and open the thinking
themselves: a reply that does not begin with `[THINK]` is all answer (`opens_in_reply`). gpt-oss writes OpenAI's
harmony messages (engine/harmony.py): its thinking is the `analysis` channel, its answer the `final` channel
(`HarmonyReasoning`). Markers that are special tokens are kept in the chat route's decoded text
(`keeps_special_tokens`), else decoding would drop them. Every parser answers the same questions
(`starts_thinking`, `thinking_markers`, `budget_end`, `split` and its `stream`, `reasoning_tokens`) for two users:

- the engine (structured/constraint.py's `ThinkingSection`): a request's structured output constrains the answer,
  not the thinking (vLLM's rule, unless `structured_outputs_in_reasoning`), and a `thinking_token_budget` bounds the
  thinking. The thinking ends once the end marker's tokens are sampled (`thinking_markers`; harmony's are
  `<|channel|>final<|message|>`), or is over before the reply when the prompt has already closed it: Qwen3's
  template with `enable_thinking: false` writes an empty `<think>\\n\\n</think>` into the prompt
  (`prompt_ends_reasoning`); for a model that opens its thinking itself, the first token is the start marker or
  the answer's. A spent budget forces `budget_end`;
- the server: a chat reply is split into `reasoning` (the text before the end marker) and `content` (the text after
  it); an output without the end marker is all reasoning (it was cut short), unless the prompt closed the thinking
  (all content). Each parser's `stream` hands out the split's deltas while the reply streams (`ReasoningStream`
  here), reading each delta once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

# parser name (vLLM's) -> (the marker that opens the thinking, the marker that ends it, whether the model writes the
# opening marker itself, so that a reply without it has no thinking)
REASONING_MARKERS = {"deepseek_r1": ("<think>", "</think>", False), "qwen3": ("<think>", "</think>", False),
                     "mistral": ("[THINK]", "[/THINK]", True)}


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    """A reasoning model's two markers, as text and as token ids of its tokenizer."""

    start: str
    end: str
    start_token_id: int
    end_token_id: int
    opens_in_reply: bool = False  # the model writes the start marker: a reply without it is all answer
    keeps_special_tokens: bool = False  # the markers are special tokens: chat replies are decoded with them
    forced_end: tuple[int, ...] = ()  # reasoning_config's reasoning_end_str, tokenized (with_budget_end)

    @classmethod
    def load(cls, name: str, tokenizer) -> "ReasoningParser":
        """The parser `name` for `tokenizer`; ValueError when a marker is not one token of it: the model does not
        think in these markers."""
        start, end, opens_in_reply = REASONING_MARKERS[name]
        vocab = tokenizer.get_vocab()
        for marker in (start, end):
            if marker not in vocab:
                raise ValueError(f"reasoning_parser {name}: the tokenizer has no token {marker!r}; the parser is for "
                                 f"models that think between {start} and {end} (DeepSeek-R1, QwQ, Qwen3; Magistral)")
        special = set(tokenizer.all_special_tokens) | {token.content for token in
                                                        getattr(tokenizer, "added_tokens_decoder", {}).values()
                                                        if token.special}
        return cls(start, end, vocab[start], vocab[end], opens_in_reply, bool({start, end} & special))

    def starts_thinking(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the reply starts in the thinking: the prompt has not closed it."""
        return not self.prompt_ends_reasoning(prompt_token_ids)

    @property
    def thinking_end(self) -> tuple[int, ...]:
        """The token ids that end the thinking: the end marker."""
        return (self.end_token_id,)

    def thinking_markers(self, prompt_token_ids: Sequence[int]) -> tuple[tuple[int, ...] | None, int | None]:
        """Where the reply's thinking ends and how it opens (ThinkingSection's `ends_with`, `opens_with`): at the
        end marker, and a first token that may open it for a model that opens it itself; (None, None) once the
        prompt has closed the thinking."""
        if self.prompt_ends_reasoning(prompt_token_ids):
            return None, None
        return self.thinking_end, self.start_token_id if self.opens_in_reply else None

    def budget_end(self, recent: tuple[int, ...]) -> tuple[int, ...]:
        """The tokens forced when a thinking budget runs out after `recent` (the last token ids): reasoning_config's
        reasoning_end_str, else the end marker."""
        return self.forced_end or self.thinking_end

    def reasoning_tokens(self, prompt_token_ids: Sequence[int], token_ids: Sequence[int]) -> int:
        """How many of the reply's tokens are its thinking, the end marker included."""
        if self.prompt_ends_reasoning(prompt_token_ids):
            return 0
        return token_ids.index(self.end_token_id) + 1 if self.end_token_id in token_ids else len(token_ids)

    def template_message(self, message: dict) -> dict:
        """A conversation's message as this model's chat template reads it: as it is (templates of `<think>`
        models read an assistant's `reasoning_content`)."""
        return message

    def stream(self, thinking: bool) -> "ReasoningStream":
        """A reply's split as it grows, in deltas."""
        return ReasoningStream(self, thinking)

    def prompt_ends_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the prompt has closed the thinking: its last marker is the end marker."""
        for token_id in reversed(prompt_token_ids):
            if token_id == self.end_token_id:
                return True
            if token_id == self.start_token_id:
                return False
        return False

    def split(self, text: str, thinking: bool, final: bool) -> tuple[str, str]:
        """(reasoning, content) of a reply's text so far; `thinking`: the reply starts in the thinking (the prompt
        did not close it). A leading start marker is dropped. Before the reply ends (`final` false), text that may
        still become a marker is held back, so each split's parts are prefixes of the next split's."""
        if not thinking:
            return "", text
        opening = text.lstrip()
        if opening.startswith(self.start):
            text = opening[len(self.start):]
        elif not final and self.start.startswith(opening):  # the start marker in the making (or nothing yet)
            return "", ""
        elif self.opens_in_reply:  # the model did not open its thinking: the reply is the answer
            return "", text
        reasoning, marker, content = text.partition(self.end)
        if marker:
            return reasoning, content
        if final:
            return text, ""
        return text[:len(text) - partial_suffix(text, self.end)], ""


def with_budget_end(parser, text: str, tokenizer):
    """`parser` (either kind) forcing `text` (reasoning_config's reasoning_end_str) when a thinking budget runs out;
    ValueError unless its tokens end with the parser's own end of thinking (else the thinking would not end)."""
    tokens = tuple(tokenizer.encode(text, add_special_tokens=False))
    end = parser.thinking_end
    if tokens[-len(end):] != end:
        raise ValueError(f"reasoning_config reasoning_end_str {text!r} must end with the end of thinking, "
                         f"{tokenizer.decode(list(end))!r} (its tokens, {list(end)}), got the tokens {list(tokens)}")
    return dataclasses.replace(parser, forced_end=tokens)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (text held back: it may become the marker)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningStream:
    """A marker parser's split of a growing reply, handed out in (reasoning, content) deltas, in time proportional to
    what each call adds (a re-split of the whole reply at every token would be quadratic in its length). It decides
    as `split` does: first whether the reply opens with the start marker (waiting while it may), then the thinking
    until the end marker (holding back text that may still become it), then the answer."""

    def __init__(self, parser: ReasoningParser, thinking: bool):
        self.parser = parser
        self.phase = "opening" if thinking else "answer"  # then "thinking", then "answer"
        self.pending = ""  # text not handed out yet: the opening in the making, or an end marker in the making

    def advance(self, text: str, final: bool) -> tuple[str, str]:
        """The (reasoning, content) deltas after `text` more of the reply (either may be empty)."""
        self.pending += text
        if self.phase == "opening" and not self._open(final):
            return "", ""
        if self.phase == "answer":
            content, self.pending = self.pending, ""
            return "", content
        end = self.parser.end
        reasoning, marker, content = self.pending.partition(end)
        if marker:
            self.phase, self.pending = "answer", ""
            return reasoning, content
        kept = len(reasoning) if final else len(reasoning) - partial_suffix(reasoning, end)
        self.pending = reasoning[kept:]
        return reasoning[:kept], ""

    def _open(self, final: bool) -> bool:
        """Decide how the reply opens (False while the start marker may still be in the making): after the start
        marker the thinking (the whitespace before it dropped); without it the answer for a model that opens its
        thinking itself, else the thinking."""
        start = self.parser.start
        opening = self.pending.lstrip()
        if opening.startswith(start):
            self.phase, self.pending = "thinking", opening[len(start):]
        elif not final and start.startswith(opening):
            return False
        else:
            self.phase = "answer" if self.parser.opens_in_reply else "thinking"
        return True
