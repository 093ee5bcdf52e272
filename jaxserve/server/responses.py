"""RequestOutputs -> OpenAI response bodies and streamed chunks (plain dicts).

A request with several prompts (completions) and `n` samples each has choices numbered
`prompt_index * n + sample_index`, as in OpenAI's and vLLM's servers.
"""

from __future__ import annotations

import json

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.request import Logprob
from jaxserve.sampling_params import SamplingParams
from jaxserve.stop_checker import StopStringChecker


def sse(data: dict | str) -> bytes:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


class ChunkEncoder:
    """The SSE events of one streamed response: the fields every chunk repeats (id, object, created,
    model) are encoded once, and each chunk adds only its choice."""

    def __init__(self, head: dict):
        self.head = head
        self._prefix = "data: " + json.dumps(head, separators=(",", ":"))[:-1] + ',"choices":['

    def choice(self, choice: dict) -> bytes:
        """An event carrying one choice."""
        return (self._prefix + json.dumps(choice, separators=(",", ":")) + "]}\n\n").encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage_of(outputs: list[RequestOutput]) -> dict:
    """Token counts of finished outputs (every prompt, every sample)."""
    return usage(sum(len(o.prompt_token_ids) for o in outputs),
                 sum(len(c.token_ids) for o in outputs for c in o.outputs))


class TokenText:
    """The text of single tokens, for logprobs (decoded one by one, as vLLM does)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def completion_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[dict[int, Logprob]],
                        text_offset: int) -> dict:
    """The completions API's logprobs object for `token_ids`, whose text starts at `text_offset`."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entries in zip(token_ids, logprobs):
        text = token_text(token_id)
        tokens.append(text)
        token_logprobs.append(entries[token_id].logprob)
        top.append({token_text(tid): entry.logprob for tid, entry in entries.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[dict[int, Logprob]],
                  num_top: int) -> dict:
    """The chat API's logprobs object: per token its logprob and the `num_top` most likely tokens."""

    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, entries in zip(token_ids, logprobs):
        ranked = sorted((e.rank, tid, e.logprob) for tid, e in entries.items() if e.rank is not None and e.rank <= num_top)
        content.append({**entry(token_id, entries[token_id].logprob),
                        "top_logprobs": [entry(tid, lp) for _, tid, lp in ranked]})
    return {"content": content}


class ChoiceStream:
    """What of one sample has been streamed; hands out the next delta.

    Text that could still turn out to be the start of a stop string is held back until the
    sample finishes, so the streamed text always equals the final text.
    """

    def __init__(self, params: SamplingParams):
        self._stop = StopStringChecker(params.stop, params.include_stop_str_in_output)
        self.num_chars = 0
        self.num_tokens = 0
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
