"""User-facing results, shaped like vLLM's RequestOutput / CompletionOutput and PoolingRequestOutput."""

from __future__ import annotations

import dataclasses

from jaxserve.request import Logprob


@dataclasses.dataclass
class CompletionOutput:
    """One sample of a request (`index` among its `n`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # 'stop', 'length', 'abort', 'error' or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        """True once this sample has a finish reason."""
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Monotonic timestamps of a request's life (seconds)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    max_tokens: int | None = None  # the resolved output budget of each sample


@dataclasses.dataclass
class RequestOutput:
    """What one request has generated: everything so far, or only what is new since its previous output, as its
    SamplingParams.output_kind says."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # One entry per prompt token when SamplingParams.prompt_logprobs is set: None for the first token,
    # else the prompt token's logprob and the top-k, each with its exact rank. None when not asked.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # why the engine failed this request alone (finish_reason 'error')
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission (vLLM's field)

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """This DELTA output and the next of the same request (RequestOutputKind.DELTA) as one output, as if they had
        come together: each sample's text, token ids and logprobs joined, the later state (finish, metrics) kept.
        Neither output changes."""
        samples = {completion.index: completion for completion in self.outputs}
        for new in later.outputs:
            old = samples.get(new.index)
            samples[new.index] = new if old is None else dataclasses.replace(
                new, text=old.text + new.text, token_ids=old.token_ids + new.token_ids,
                logprobs=None if new.logprobs is None else (old.logprobs or []) + new.logprobs)
        prompt_logprobs = self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs
        return dataclasses.replace(later, outputs=[samples[index] for index in sorted(samples)],
                                   prompt_logprobs=prompt_logprobs)


@dataclasses.dataclass
class PoolingOutput:
    """A pooling request's result (vLLM's EmbeddingOutput)."""

    embedding: list[float]  # (H,) or (dimensions,): the pooled final hidden states, L2-normalized when asked

    @property
    def data(self) -> list[float]:
        """The embedding, under the name `LLM.encode`'s outputs give every task's result (vLLM's PoolingOutput)."""
        return self.embedding


@dataclasses.dataclass
class ClassificationOutput:
    """A sequence classifier's result for one prompt (vLLM's ClassificationOutput)."""

    probs: list[float]  # (labels,): each class's probability (the model's activation of its logits, or the logits)

    @property
    def data(self) -> list[float]:
        """The probabilities, under the name `LLM.encode`'s outputs give every task's result."""
        return self.probs

    @property
    def num_classes(self) -> int:
        """How many classes the model scores."""
        return len(self.probs)


@dataclasses.dataclass
class TokenPoolingOutput:
    """A token-wise pooling task's result for one prompt (vLLM's PoolingOutput of token_embed or token_classify):
    one entry per prompt token."""

    data: list[list[float]]  # (prompt tokens, H or dimensions) embeddings, or (prompt tokens, labels) probabilities


@dataclasses.dataclass
class PoolingRequestOutput:
    """One embedding or classification request (vLLM's EmbeddingRequestOutput, ClassificationRequestOutput):
    `outputs` once its whole prompt is pooled."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # None until finished, and for a request aborted or failed
    outputs: PoolingOutput | ClassificationOutput | TokenPoolingOutput | None
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # why the engine failed this request alone
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission


@dataclasses.dataclass
class ScoringOutput:
    """A pair's score (vLLM's ScoringOutput)."""

    score: float  # the cosine similarity of the two texts' embeddings, in [-1, 1]; a cross-encoder's pair score


@dataclasses.dataclass
class ScoringRequestOutput:
    """One scored pair (vLLM's ScoringRequestOutput)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # the first text's tokens, then the second's
    finished: bool = True
