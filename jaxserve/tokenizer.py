"""Tokenizer loading and incremental (streaming) detokenization.

Output text is the output ids decoded *in the context of the prompt*, as in
vLLM: the detokenizer is primed with the last few prompt ids, so the text is
``decode(prompt + output)[len(decode(prompt)):]``. For byte-level BPE that is
exactly ``decode(output)``. For SentencePiece-style ("▁") tokenizers it is
``decode(output)`` with the first output token's leading space kept: the
decoder strips the "▁" of the first token it decodes, and the first output
token is not first when the prompt has a token that is not skipped. When the
prompt has none (empty, or only skipped special tokens such as BOS) the space
is stripped, exactly as in ``decode(output)``. Tokenization-space clean-up is
never applied.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Sequence

import jinja2
import transformers
from tokenizers.decoders import DecodeStream

# Files from which AutoTokenizer can build a tokenizer.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "tiktoken.model",
)

# How many trailing prompt ids may prime the detokenizer (vLLM uses up to 24).
_MAX_CONTEXT_TOKENS = 24

# The message tokenizers raises when a decoder rewrites already-emitted text.
_INVALID_PREFIX = "Invalid prefix encountered"

_REPLACEMENT_CHAR = "\ufffd"


def load_tokenizer(path: str) -> transformers.PreTrainedTokenizerBase:
    """Load the tokenizer stored in the local folder `path` (never downloads)."""
    if not os.path.isdir(path):
        raise ValueError(f"Tokenizer folder {path!r} does not exist.")
    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        raise ValueError(
            f"No tokenizer files in {path!r}: expected one of {', '.join(_TOKENIZER_FILES)}."
        )
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_chat_template(value: str) -> str:
    """A chat template given as vLLM's `--chat-template` takes it: a file's path (its text), or the Jinja template
    itself; ValueError for a path that does not exist."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if not any(mark in value for mark in "{}\n"):
        raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template")
    return value


def render_chat_text(
    tokenizer, conversation: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
    chat_template_kwargs: dict | None = None, tools: list[dict] | None = None, chat_template: str | None = None,
) -> str:
    """The text of one conversation (and the `tools` it may call, OpenAI's shape) under `chat_template` (default:
    the tokenizer's); ValueError when it cannot be rendered (no template, or the template rejects the
    conversation)."""
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    try:
        return tokenizer.apply_chat_template(
            conversation, tools=tools, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=False, chat_template=chat_template,
            **(chat_template_kwargs or {}),
        )
    except jinja2.TemplateError as error:
        raise ValueError(f"the chat template rejected the conversation: {error}") from error


def render_chat(
    tokenizer, conversation: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
    chat_template_kwargs: dict | None = None, tools: list[dict] | None = None, chat_template: str | None = None,
) -> list[int]:
    """Token ids of one conversation under the chat template (the template places the special tokens,
    so none are added); ValueError when it cannot be rendered."""
    text = render_chat_text(tokenizer, conversation, add_generation_prompt, continue_final_message,
                            chat_template_kwargs, tools, chat_template)
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_text_pair(tokenizer, first: str, second: str) -> list[int]:
    """A cross-encoder's prompt: two texts encoded together as the tokenizer encodes a text pair (with its special
    tokens), as sentence-transformers' CrossEncoder does; a ValueError unless both are non-empty texts."""
    if not (isinstance(first, str) and isinstance(second, str) and first and second):
        raise ValueError("a cross-encoder scores pairs of non-empty texts; give texts, not token ids")
    return list(tokenizer(first, second)["input_ids"])


def _check_token_ids(token_ids: Sequence[int]) -> list[int]:
    """Return `token_ids` as a list of Python ints, rejecting anything but ids >= 0."""
    checked = []
    for token_id in token_ids:
        if type(token_id) is int and token_id >= 0:  # the common case, without the slower ABC check below
            checked.append(token_id)
            continue
        is_int = isinstance(token_id, numbers.Integral) and not isinstance(token_id, bool)
        if not is_int or token_id < 0:
            raise ValueError(f"Token ids must be ints >= 0, got {token_id!r}.")
        checked.append(int(token_id))
    return checked


def _prompt_context(backend, prompt_token_ids: list[int], skip_special_tokens: bool) -> list[int]:
    """The prompt ids that prime the detokenizer.

    The shortest prompt suffix whose text is non-empty and free of U+FFFD:
    the first output token then has a token before it, as after the whole
    prompt (decoders such as Metaspace treat the first token specially), and
    no character is cut in two. When the last few prompt ids decode to no
    text at all, all of them: they show nothing yet reach the decoder just as
    they do in a decode of the whole prompt. [] when every suffix with text
    holds a U+FFFD.
    """
    tail = prompt_token_ids[-_MAX_CONTEXT_TOKENS:]
    for length in range(1, len(tail) + 1):
        text = backend.decode(tail[-length:], skip_special_tokens=skip_special_tokens)
        if text and _REPLACEMENT_CHAR not in text:
            return tail[-length:]
    return [] if backend.decode(tail, skip_special_tokens=skip_special_tokens) else tail


class IncrementalDetokenizer:
    """Turns one request's stream of generated token ids into text deltas.

    Built on `tokenizers.decoders.DecodeStream`, stepped one id at a time: a
    delta never ends in a character that later ids could still complete, so
    no U+FFFD is emitted for a multi-byte character split across tokens.
    `finish()` releases what is still held back when the request ends.
    """

    def __init__(
        self,
        tokenizer: transformers.PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                f"IncrementalDetokenizer needs a tokenizers-backed (fast) tokenizer, "
                f"got {type(tokenizer).__name__}."
            )
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        context = _prompt_context(backend, _check_token_ids(prompt_token_ids), skip_special_tokens)
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        # Ids whose text the stream trims off the next chunk, and ids not yet
        # turned into text (mirrors DecodeStream's state, for finish()).
        self._window = context
        self._pending: list[int] = []
        self._raw_added_tokens = self._added_tokens_to_join(
            skip_special_tokens, spaces_between_special_tokens
        )
        self._last_was_added = False
        self._token_ids: list[int] = []
        self._deltas: list[str] = []  # the output text, joined when `text` is read (`+=` would copy it every token)
        self._finished = False

    def _added_tokens_to_join(self, skip_special_tokens: bool, spaces_between: bool) -> dict:
        """Added-token id -> content, when consecutive added tokens must not be spaced."""
        if skip_special_tokens or spaces_between:
            return {}
        return {
            token_id: added.content
            for token_id, added in self._backend.get_added_tokens_decoder().items()
        }

    @property
    def text(self) -> str:
        """All output text emitted so far (the deltas joined)."""
        if len(self._deltas) > 1:
            self._deltas = ["".join(self._deltas)]
        return self._deltas[0] if self._deltas else ""

    @property
    def token_ids(self) -> list[int]:
        """A copy of all output token ids added so far."""
        return list(self._token_ids)

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text they complete (may be '')."""
        if self._finished:
            raise ValueError("add_tokens called after finish().")
        new_token_ids = _check_token_ids(new_token_ids)
        self._token_ids.extend(new_token_ids)
        if len(new_token_ids) == 1:  # (a token a step: no join)
            delta = self._add_token(new_token_ids[0])
        else:
            delta = "".join(self._add_token(token_id) for token_id in new_token_ids)
        if delta:
            self._deltas.append(delta)
        return delta

    def finish(self) -> str:
        """End the output; return (and add to `text`) the text still held back.

        That is an incomplete character, rendered as U+FFFD the way a full
        decode renders it; '' when nothing is held back. No ids may be added
        after this.
        """
        self._finished = True
        if not self._pending:
            return ""
        decode = self._decode
        delta = decode(self._window + self._pending)[len(decode(self._window)) :]
        self._window, self._pending = self._window + self._pending, []
        if delta:
            self._deltas.append(delta)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        """Decode `token_ids` with this request's special-token setting."""
        return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _add_token(self, token_id: int) -> str:
        """Step one id through the stream and apply the special-token spacing rule."""
        chunk = self._step(token_id)
        if self._raw_added_tokens:
            raw = self._raw_added_tokens.get(token_id)
            if raw is not None and self._last_was_added:
                chunk = raw
            self._last_was_added = raw is not None
        return chunk

    def _step(self, token_id: int) -> str:
        """Feed one id to the stream; return the text it releases ('' if none yet)."""
        self._pending.append(token_id)
        try:
            chunk = self._stream.step(self._backend, token_id)
        except Exception as exc:  # tokenizers raises a bare Exception here.
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            return self._restart()
        if chunk is None:
            return ""
        self._window, self._pending = self._pending, []
        return chunk

    def _restart(self) -> str:
        """Decode the pending ids in a fresh stream, without context.

        Needed when an id changes text already emitted (a byte-fallback run
        that stops being valid UTF-8): that text stays as sent, and the
        pending ids are decoded on their own, as vLLM does.
        """
        pending = self._pending
        self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        self._window, self._pending = [], []
        return "".join(self._step(token_id) for token_id in pending)
