"""Request bodies of the OpenAI-compatible API (pydantic), and their translation to SamplingParams.

Field names and defaults follow OpenAI's API, plus vLLM's common extras (`top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `priority`, ...). Unknown
fields are ignored, as OpenAI-compatible servers do; fields that would change the result but are
not supported (`echo`, `suffix`, `logit_bias`, `tools`, ...) are refused with a 400 that names them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    """`stream_options`: `include_usage` adds a last chunk that carries the token counts."""

    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def unsupported_fields(self) -> list[str]:
        """Names of set fields that this server cannot honour."""
        return ["logit_bias"] if self.logit_bias else []

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """SamplingParams for this request (ValueError on out-of-range values)."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        """True when a streamed response must end with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported_fields(self) -> list[str]:
        names = super().unsupported_fields()
        names += ["echo"] if self.echo else []
        names += ["suffix"] if self.suffix else []
        names += ["best_of"] if self.best_of not in (None, self.n) else []
        return names

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [prompt]
        return list(prompt)

    def to_sampling_params(self) -> SamplingParams:
        """SamplingParams for each prompt of this request."""
        return self.sampling_params(self.max_tokens, self.logprobs)


class TextPart(BaseModel):
    """A `{"type": "text", "text": ...}` part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a conversation; extra keys (`name`, `tool_call_id`, ...) go to the template."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it, with text parts joined."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        return message


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported_fields(self) -> list[str]:
        names = super().unsupported_fields()
        names += ["tools"] if self.tools else []
        names += ["response_format"] if self.response_format and self.response_format.get("type") != "text" else []
        return names

    def to_sampling_params(self) -> SamplingParams:
        """SamplingParams of this request; no max_tokens means "until max_model_len"."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template sees them."""
        return [message.for_template() for message in self.messages]


class TokenizeRequest(BaseModel):
    """POST /tokenize: either a prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]
