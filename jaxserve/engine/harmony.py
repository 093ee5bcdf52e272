"""OpenAI's harmony format (gpt-oss): a reply as a sequence of messages, read from its text.

gpt-oss writes each message as a header, `<|message|>`, its text and a terminator, all markers special tokens of
its tokenizer (so the reply is decoded with them):

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}
    <|call|>

(the reply is one line: the breaks are this page's).

The chat template ends the prompt with `<|start|>assistant`, so the reply's first header starts at `<|channel|>`;
later ones at `<|start|>`. A header names the channel (`analysis`: the thinking; `commentary`: tool calls and their
preambles; `final`: the answer), perhaps a recipient (`to=functions.NAME`, also written before the channel) and a
content type (`<|constrain|>json`, or a bare `json`). A message ends at `<|end|>`, `<|call|>` (a tool call: the
reply stops there), `<|return|>` (the reply's end) or where the next header starts; `<|call|>` and `<|return|>`
are end-of-sequence tokens, so a reply's text usually ends without them. Text before any header belongs to the
message the prompt opened.

`parse_reply` reads a reply so far. Before the reply ends (`final` false) it holds back a header in the making and
text that may still become a marker, so every message it returns keeps its header, and its text and source grow
only by what comes after them in later reads: what a stream sends never has to be taken back. `HarmonyReasoning`
(`reasoning_parser: openai_gptoss`) splits a reply into reasoning and content by channel; its `HarmonyStream` does
so for a streamed reply, reading each delta once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
TERMINATORS = (END, CALL, RETURN)
LONGEST = max(len(marker) for marker in MARKERS)
FINAL_HEADER = f"{CHANNEL}final{MESSAGE}"  # where the answer starts
FUNCTIONS = "functions."  # the recipient prefix of the request's tools


@dataclasses.dataclass(frozen=True)
class HarmonyMessage:
    """One message of a reply: its header's fields, its text so far, and the reply's text it was read from."""

    channel: str | None  # analysis, commentary, final; None: no header (text in the message the prompt opened)
    recipient: str | None  # a tool call's addressee, e.g. functions.get_weather
    content_type: str | None  # e.g. json
    text: str  # the message's text (between `<|message|>` and its terminator)
    source: str  # the message as the reply wrote it: header, text and terminator
    complete: bool  # its terminator came, or the reply ended

    @property
    def function(self) -> str | None:
        """The name of the request's tool this message calls, or None."""
        if self.recipient is not None and self.recipient.startswith(FUNCTIONS):
            return self.recipient[len(FUNCTIONS):]
        return None


def parse_reply(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of a reply's text so far (module docstring); `final`: the reply has ended."""
    messages, position = [], 0
    while position < len(text):
        if text.startswith((START, CHANNEL), position):
            header_end = text.find(MESSAGE, position)
            if header_end < 0:  # a header in the making; once the reply has ended, a message with no text
                if final:
                    messages.append(HarmonyMessage(*_header(text[position:]), "", text[position:], True))
                break
            fields, body = _header(text[position:header_end]), header_end + len(MESSAGE)
        else:
            fields, body = (None, None, None), position
        end = _next_marker(text, body)
        if end < 0:  # the reply's last message: open unless the reply ended
            kept = len(text) if final else len(text) - _held_back(text)
            kept = max(kept, body)
            messages.append(HarmonyMessage(*fields, text[body:kept], text[position:kept], final))
            break
        closing = next((marker for marker in TERMINATORS if text.startswith(marker, end)), "")
        messages.append(HarmonyMessage(*fields, text[body:end], text[position:end + len(closing)], True))
        position = end + len(closing)
    return messages


def _header(header: str) -> tuple[str | None, str | None, str | None]:
    """(channel, recipient, content type) of a message header: `[<|start|>ROLE[ to=R]]<|channel|>CHANNEL[ to=R]
    [ <|constrain|>TYPE | TYPE]` up to `<|message|>`."""
    role, has_channel, channel_part = header.removeprefix(START).partition(CHANNEL)
    words = channel_part.replace(CONSTRAIN, " ").split()
    recipient = next((word[3:] for word in role.split() + words if word.startswith("to=")), None)
    others = [word for word in words if not word.startswith("to=")]
    channel = others[0] if has_channel and others else None
    content_type = others[1] if len(others) > 1 else None
    return channel, recipient, content_type


def _held_back(text: str) -> int:
    """How many characters at the end of `text` may still become a marker: a proper beginning of one (every marker
    starts with `<` and holds no other, so only the last `<` can start it)."""
    at = text.rfind("<", max(0, len(text) - LONGEST + 1))
    tail = text[at:]
    return len(tail) if at >= 0 and any(marker.startswith(tail) and marker != tail for marker in MARKERS) else 0


def _next_marker(text: str, start: int) -> int:
    """Where the first marker that ends a message's text (a terminator or the next header) is, from `start`;
    -1 for none."""
    found = [at for marker in (*TERMINATORS, START, CHANNEL) if (at := text.find(marker, start)) >= 0]
    return min(found, default=-1)


@dataclasses.dataclass(frozen=True)
class HarmonyReasoning:
    """`reasoning_parser: openai_gptoss`: a harmony reply's `analysis` messages are its reasoning (joined by new
    lines); its `final` messages and the `commentary` preambles without a recipient are its content. A message with
    a recipient (a tool call) stays in the content as the reply wrote it, for the `openai` tool call parser
    (server/tools.py) to read. A constraint applies to the final channel's text, after `<|channel|>final<|message|>`.
    The markers are special tokens: chat replies are decoded with them."""

    ids: dict[str, int]  # each marker's token id
    final_header: tuple[int, ...]  # the token ids of `<|channel|>final<|message|>`
    analysis_header: tuple[int, ...]  # the token ids of `<|channel|>analysis<|message|>`
    assistant: tuple[int, ...] = ()  # the token ids of `assistant`, the role after `<|start|>`
    keeps_special_tokens: bool = True
    forced_end: tuple[int, ...] = ()  # reasoning_config's reasoning_end_str, tokenized (reasoning.with_budget_end)

    @classmethod
    def load(cls, tokenizer) -> "HarmonyReasoning":
        """The parser for `tokenizer`; ValueError when a harmony marker is not one token of it."""
        vocab = tokenizer.get_vocab()
        missing = [marker for marker in MARKERS if marker not in vocab]
        if missing:
            raise ValueError(f"reasoning_parser openai_gptoss: the tokenizer has no token {missing[0]!r}; the parser "
                             f"is for models that write OpenAI's harmony format (gpt-oss)")

        def encode(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        return cls({marker: vocab[marker] for marker in MARKERS}, encode(FINAL_HEADER),
                   encode(f"{CHANNEL}analysis{MESSAGE}"), encode("assistant"))

    @property
    def _boundaries(self) -> set[int]:
        """The token ids that end a message or start the next: `<|start|>` and the terminators."""
        return {self.ids[marker] for marker in (START, *TERMINATORS)}

    def _open_channel(self, prompt_token_ids: Sequence[int]) -> str | None:
        """The channel of the message the prompt leaves open (analysis or final, for a prompt that writes the
        reply's start), None when the reply starts a message of its own."""
        boundaries = self._boundaries
        last = max((i for i, token in enumerate(prompt_token_ids) if token in boundaries), default=-1)
        tail = tuple(prompt_token_ids[last + 1:])
        for channel, header in (("final", self.final_header), ("analysis", self.analysis_header)):
            if any(tail[i:i + len(header)] == header for i in range(len(tail))):
                return channel
        return None

    def starts_thinking(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the reply goes on with an analysis message the prompt opened."""
        return self._open_channel(prompt_token_ids) == "analysis"

    @property
    def thinking_end(self) -> tuple[int, ...]:
        """The token ids that end the thinking: the final channel's header."""
        return self.final_header

    def thinking_markers(self, prompt_token_ids: Sequence[int]) -> tuple[tuple[int, ...] | None, None]:
        """The thinking lasts until the final channel's header, unless the prompt has opened the final message (no
        thinking then); nothing opens it."""
        return (None if self._open_channel(prompt_token_ids) == "final" else self.final_header), None

    def budget_end(self, recent: tuple[int, ...]) -> tuple[int, ...]:
        """The tokens forced when a thinking budget runs out after `recent` (the last token ids): reasoning_config's
        reasoning_end_str, else the final channel's message from where the reply stands: after a message's text
        `<|end|><|start|>assistant<|channel|>final<|message|>`, after `<|end|>` (or in a header that may still
        become the final one) the rest of that, in another header the `<|message|>` that closes it and an empty
        message's end first."""
        if self.forced_end:
            return self.forced_end
        start, end, message = self.ids[START], self.ids[END], self.ids[MESSAGE]
        new_final = (start, *self.assistant, *self.final_header)
        markers = set(self.ids.values())
        last = max((i for i, token in enumerate(recent) if token in markers), default=None)
        if last is None or recent[last] == message:  # in a message's text
            return (end, *new_final)
        if recent[last] == end:
            return new_final
        opened = max((i for i, token in enumerate(recent) if token == start), default=None)
        header = tuple(recent[opened:]) if opened is not None else ()  # (<= HISTORY,) the header so far
        if header and new_final[:len(header)] == header:
            return new_final[len(header):]
        return (message, end, *new_final)  # in another header

    def reasoning_tokens(self, prompt_token_ids: Sequence[int], token_ids: Sequence[int]) -> int:
        """How many of the reply's tokens are its thinking: up to the terminator of its last analysis message (all
        of them when the reply ends in one)."""
        boundaries, header = self._boundaries, self.analysis_header
        thinking, counted = self.starts_thinking(prompt_token_ids), 0
        for i, token in enumerate(token_ids):
            if tuple(token_ids[i:i + len(header)]) == header:
                thinking = True
            elif thinking and token in boundaries:
                thinking, counted = False, i + 1
        return len(token_ids) if thinking else counted

    def split(self, text: str, thinking: bool, final: bool) -> tuple[str, str]:
        """(reasoning, content) of a reply's text so far; `thinking`: text before any header is analysis (the prompt
        opened an analysis message). Each split's parts are prefixes of the next split's."""
        return self.stream(thinking).advance(text, final)

    def template_message(self, message: dict) -> dict:
        """A conversation's message as gpt-oss's chat template reads it: an assistant's reasoning (`reasoning`,
        `reasoning_content` or `thinking`) as `thinking`, the analysis that template writes before the message's
        tool call (for the last turn, the thinking the model goes on from). A tool call's message with content too
        loses its content: that template writes one analysis before a call, and refuses a message with both."""
        reasoning = next((message[key] for key in ("thinking", "reasoning", "reasoning_content") if message.get(key)),
                         None)
        if message.get("role") != "assistant" or reasoning is None:
            return message
        if message.get("tool_calls"):
            message = {key: value for key, value in message.items() if key != "content"}
        return {**message, "thinking": reasoning}

    def stream(self, thinking: bool) -> "HarmonyStream":
        """A reply's split as it grows, in deltas."""
        return HarmonyStream(thinking)


class HarmonyStream:
    """HarmonyReasoning's split of a growing reply, handed out in (reasoning, content) deltas, in time proportional
    to what each call adds: a long thinking is one message, which a re-read of the whole reply at each token would
    make quadratic. It reads the messages as `parse_reply` does: a header is taken once `<|message|>` ends it, a
    message's text until the next marker, text that may still become a marker (or a header) waits."""

    def __init__(self, thinking: bool):
        self.thinking = thinking  # text before any header is analysis
        self.pending = ""  # text not consumed yet: a header, or the end of a text that may still become a marker
        self.part: str | None = None  # the open message's part (reasoning, content, call); None between messages
        self.messages = 0  # messages begun
        self.reasoned = False  # a reasoning part has begun: the next one is joined to it by a new line

    def advance(self, text: str, final: bool) -> tuple[str, str]:
        """The (reasoning, content) deltas after `text` more of the reply (`final`: the reply has ended)."""
        self.pending += text
        reasoning, content = [], []
        while self.pending:
            if self.part is None:
                if not self._begin(final, reasoning, content):
                    break
                continue
            said = reasoning if self.part == "reasoning" else content
            end = _next_marker(self.pending, 0)
            if end < 0:  # the message goes on: all but what may still become a marker
                kept = len(self.pending) if final else len(self.pending) - _held_back(self.pending)
                said.append(self.pending[:kept])
                self.pending = self.pending[kept:]
                break
            closing = next((marker for marker in TERMINATORS if self.pending.startswith(marker, end)), "")
            said.append(self.pending[:end] + (closing if self.part == "call" else ""))
            self.pending, self.part = self.pending[end + len(closing):], None
        return "".join(reasoning), "".join(content)

    def _begin(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        """Open the next message from the pending text, its header read when it has one (a call's header goes to
        the content as written, a second reasoning part starts with a new line); False while the header is in the
        making, or the text may still become one."""
        header, fields, cut = "", (None, None, None), False
        if self.pending.startswith((START, CHANNEL)):
            header_end = self.pending.find(MESSAGE)
            if header_end < 0 and not final:
                return False
            cut = header_end < 0  # the reply ended in the header: a message with no text
            header = self.pending if cut else self.pending[:header_end + len(MESSAGE)]
            fields = _header(self.pending if cut else self.pending[:header_end])
        elif not final and any(marker.startswith(self.pending) for marker in (START, CHANNEL)):
            return False
        channel, recipient, _ = fields
        if recipient is not None:
            self.part = "call"
            content.append(header)
        elif channel == "analysis" or (channel is None and self.messages == 0 and self.thinking):
            self.part = "reasoning"
            reasoning.append("\n" if self.reasoned else "")
            self.reasoned = True
        else:
            self.part = "content"
        self.messages += 1
        self.pending = self.pending[len(header):]
        if cut:
            self.part = None
        return True
