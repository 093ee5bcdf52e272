"""RequestOutputs -> OpenAI response bodies and streamed chunks (plain dicts).

A request with several prompts (completions) and `n` samples each has choices numbered
`prompt_index * n + sample_index`, as in OpenAI's and vLLM's servers. Log-probabilities of -inf (a
token that `allowed_token_ids` or `logit_bias` rules out) are sent as -9999.0, as OpenAI and vLLM do:
JSON has no infinity.
"""

from __future__ import annotations

import json

from jaxserve.engine.stop_checker import StopStringChecker
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.request import Logprob
from jaxserve.sampling_params import SamplingParams

MIN_LOGPROB = -9999.0  # what OpenAI and vLLM send for a log-probability of -inf


def sse(data: dict | str) -> bytes:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def named_sse(data: dict) -> bytes:
    """One server-sent event named by its data's `type` (the Responses and Messages APIs' events)."""
    return f"event: {data['type']}\n".encode() + sse(data)


class ChunkEncoder:
    """The SSE events of one streamed response: the fields every chunk repeats (id, object, created,
    model) are encoded once, and each chunk adds only its choice. `nulls` names the fields every chunk
    carries, null when not given (vLLM's completions chunks have `"usage": null`; its chat chunks leave it out)."""

    def __init__(self, head: dict, nulls: tuple[str, ...] = ()):
        self.head = head
        self.nulls = nulls
        self._prefix = "data: " + json.dumps(head, separators=(",", ":"))[:-1] + ',"choices":['

    def choice(self, choice: dict, **fields) -> bytes:
        """An event carrying one choice, and `fields` (usage, ...) after it, those that are not None or in
        `nulls`."""
        tail = "".join(f',"{name}":{json.dumps(value, separators=(",", ":"))}'
                       for name, value in fields.items() if value is not None or name in self.nulls)
        return (self._prefix + json.dumps(choice, separators=(",", ":")) + "]" + tail + "}\n\n").encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage_of(outputs: list[RequestOutput], prompt_tokens_details: bool = False) -> dict:
    """Token counts of finished outputs (every prompt, every sample); with `prompt_tokens_details`
    (vLLM's --enable-prompt-tokens-details) also the prompt tokens found in the prefix cache."""
    counts = usage(sum(len(o.prompt_token_ids) for o in outputs),
                   sum(len(c.token_ids) for o in outputs for c in o.outputs))
    if prompt_tokens_details:
        counts["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens for o in outputs)}
    return counts


def finite(logprob: float) -> float:
    """A log-probability JSON can carry: -inf becomes MIN_LOGPROB."""
    return max(logprob, MIN_LOGPROB)


class TokenText:
    """The text of single tokens, for logprobs (decoded one by one, as vLLM does)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def token_id_text(token_id: int) -> str:
    """A token named by its id, as logprobs show it under vLLM's return_tokens_as_token_ids."""
    return f"token_id:{token_id}"


def completion_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[dict[int, Logprob] | None],
                        num_top: int, text_offset: int) -> dict:
    """The completions API's logprobs object for `token_ids`: per token its text, its logprob and those of
    the `num_top` most likely tokens (null for an entry of None: the first prompt token), and where its
    text starts among the token texts of the choice (from `text_offset` on)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entries in zip(token_ids, logprobs):
        text = token_text(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entries is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(finite(entries[token_id].logprob))
        top.append({token_text(tid): finite(entry.logprob) for tid, entry in entries.items()
                    if tid == token_id or entry.rank <= num_top})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def prompt_logprobs_field(token_text: TokenText,
                          prompt_logprobs: list[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's `prompt_logprobs` field: per prompt token null (the first) or
    {token id: {logprob, rank, decoded_token}} for the token itself and the most likely ones."""
    if prompt_logprobs is None:
        return None
    return [None if entries is None else {
        tid: {"logprob": finite(e.logprob), "rank": e.rank,
              "decoded_token": token_text(tid) if e.decoded_token is None else e.decoded_token}
        for tid, e in entries.items()} for entries in prompt_logprobs]


def chat_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[dict[int, Logprob]],
                  num_top: int) -> dict:
    """The chat API's logprobs object: per token its logprob and the `num_top` most likely tokens."""

    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, entries in zip(token_ids, logprobs):
        ranked = sorted((e.rank, tid, e.logprob) for tid, e in entries.items()
                        if e.rank is not None and e.rank <= num_top)
        content.append({**entry(token_id, entries[token_id].logprob),
                        "top_logprobs": [entry(tid, lp) for _, tid, lp in ranked]})
    return {"content": content}


class ChoiceStream:
    """What of one sample has been streamed; hands out the next delta.

    Text that could still turn out to be the start of a stop string is held back until the
    sample finishes, so the streamed text always equals the final text. The tokens go out as they
    come, so logprob text offsets count the texts of the tokens sent (`token_chars`), not the
    characters.
    """

    def __init__(self, params: SamplingParams):
        self._stop = StopStringChecker(params.stop, params.include_stop_str_in_output)
        self.num_chars = 0
        self.num_tokens = 0
        self.token_chars = 0  # length of the texts of the tokens whose logprobs were sent
        self.started = False  # a chunk of this sample was sent (the echo and prompt ids go with the first)
        self.done = False

    def advance(self, completion: CompletionOutput) -> tuple[str, int] | None:
        """(new text, index of the first token not yet streamed), or None when there is nothing to send."""
        if self.done:
            return None
        finished = completion.finished()
        text = self._stop.streamable_delta(completion.text, self.num_chars, finished)
        if not text and not finished:
            return None
        first_token = self.num_tokens
        self.num_chars += len(text)
        self.num_tokens = len(completion.token_ids)
        self.done = finished
        return text, first_token
