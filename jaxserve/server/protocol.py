"""Request bodies of the OpenAI-compatible API (pydantic), and their translation to SamplingParams.

Field names, defaults and checks follow OpenAI's API plus vLLM's extras (`top_k`, `min_p`,
`repetition_penalty`, `prompt_logprobs`, `allowed_token_ids`, `bad_words`, `return_token_ids`,
`truncate_prompt_tokens`, ...). Sampling fields default to None ("unset"), so that the model's
generation_config.json defaults can fill them. Unknown fields are kept (`extra="allow"`) and ignored,
as OpenAI-compatible servers do, except the fields of OpenAI's and vLLM's APIs that would change the
result and that this server does not implement (`UNSUPPORTED_FIELDS`: legacy functions, custom logits processors, ...;
per route `route_unsupported`: beam search on chat, ...): those are refused with a 400 that names them unless
they hold their neutral value.

Structured output comes in vLLM's shapes (`structured_outputs`, the older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`, `structural_tag`, a `response_format` of type "structural_tag") and OpenAI's
(`response_format`), on both routes; tools (`tools`, `tool_choice`) on chat (jaxserve/server/tools.py). A request
gives at most one constraint.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxserve.engine.beam_search import BeamSearchParams
from jaxserve.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from jaxserve.server.errors import APIError
from jaxserve.server.tools import NamedToolChoice, Tool, arguments_for_template, find_tool, required_schema
from jaxserve.structured.params import StructuredOutputsParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


def _unset(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return value is None or value in ("", [], {})


def _false(value: Any) -> bool:
    return value is None or value is False


def _one_of(*neutral: Any) -> Callable[[Any], bool]:
    """A test that accepts None and the `neutral` values."""
    return lambda value: value is None or value in neutral


_GUIDED = "structured output runs on llguidance with the fields structured_outputs, guided_json, guided_regex, " \
          "guided_choice, guided_grammar, guided_whitespace_pattern, structural_tag and response_format"
_BEAM = "beam search is on /v1/completions only"

# Fields of OpenAI's and vLLM's APIs that would change the result and that this server does not
# implement: name -> (the test for values that change nothing, why the field is refused).
# OpenAI's request fields that change nothing here (accounting, storage, routing hints): accepted without a word.
IGNORED_FIELDS = frozenset({"best_of", "metadata", "store", "service_tier", "prediction", "modalities", "audio",
                            "web_search_options", "verbosity", "prompt_cache_key", "safety_identifier"})
UNSUPPORTED_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "guided_decoding_backend": (_unset, _GUIDED + "; the backend is the server's"),
    "functions": (_empty, "the legacy functions field is not supported; use tools"),
    "function_call": (_one_of("none"), "the legacy function_call field is not supported; use tool_choice"),
    "early_stopping": (_false, "beam search runs every beam to max_tokens (vLLM's algorithm)"),
    "suffix": (_empty, "the served models have no fill-in-the-middle support"),
    "prompt_embeds": (_unset, "prompts must be text or token ids"),
    "logits_processors": (_empty, "custom logits processors are not supported"),
    "vllm_xargs": (_empty, "custom extensions are not supported"),
    "logprob_token_ids": (_unset, "logprobs of given token ids are not implemented: each position returns the "
                                  "chosen token's and the top 20"),
    "watermarking": (_false, "watermarking is not implemented"),
    "repetition_detection": (_unset, "repetition detection is not implemented"),
    "kv_transfer_params": (_unset, "disaggregated serving is not implemented"),
    "chat_template": (_unset, "only the model's own chat template is used"),
    "documents": (_empty, "chat templates get no documents"),
}

# Request fields beam search does not honour (its steps are plain one-token requests): name -> the test for
# values that change nothing. Any other value is a 400 with use_beam_search.
BEAM_SEARCH_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "top_p": _one_of(1.0), "top_k": _one_of(0, -1), "min_p": _one_of(0.0), "presence_penalty": _one_of(0.0),
    "frequency_penalty": _one_of(0.0), "repetition_penalty": _one_of(1.0), "min_tokens": _one_of(0),
    "stop": _empty, "stop_token_ids": _empty, "bad_words": _empty, "logit_bias": _empty,
    "allowed_token_ids": _unset, "prompt_logprobs": _unset, "echo": _false, "thinking_token_budget": _one_of(-1),
}


class StreamOptions(BaseModel):
    """`stream_options`, with vLLM's defaults: `include_usage` adds a last chunk that carries the token
    counts, `continuous_usage_stats` puts the counts so far in every chunk too."""

    include_usage: bool = True
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: a named JSON schema."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema; or vLLM's structural tag
    (`structures` and `triggers`, judged by StructuredOutputsParams: its other keys are kept for that)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[Any] | None = None
    triggers: list[Any] | None = None


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    # Fields this route cannot honour, beyond UNSUPPORTED_FIELDS: name -> (neutral-value test, why).
    route_unsupported: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {}
    # SamplingParams field -> the request field its errors are about, where the names differ.
    param_names: ClassVar[dict[str, str]] = {}

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    echo: bool = False
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    # at most this many tokens of a reasoning model's thinking, then its end is forced (-1 or null: no bound)
    thinking_token_budget: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    # which end truncate_prompt_tokens cuts (vLLM's): "left" keeps the last tokens, "right" the first
    truncation_side: Literal["left", "right"] | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_token_ids: bool = False
    # logprobs name each token "token_id:N" instead of its text (vLLM's; None: the server's
    # --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    cache_salt: Any = None
    # structured output: vLLM's fields (guided_* its older names), OpenAI's response_format
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # JSON constraints: the whitespace allowed between tokens
    structural_tag: str | dict[str, Any] | None = None  # vLLM's: its JSON text (or the object)
    response_format: ResponseFormat | None = None

    def check(self) -> None:
        """APIError (400, naming the field) for unsupported fields and for values that SamplingParams
        cannot judge."""
        self._check_unsupported()
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise APIError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
        if self.stream and self.prompt_logprobs is not None and self.prompt_logprobs > 0:
            raise APIError(400, "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and self.cache_salt):
            raise APIError(400, "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
        if self.truncate_prompt_tokens == 0:
            raise APIError(400, "truncate_prompt_tokens must be -1 (keep as many prompt tokens as fit) or an "
                                "int >= 1, got 0", "truncate_prompt_tokens")

    def constraints(self) -> dict[str, dict[str, Any]]:
        """The output constraints the request gives, each as StructuredOutputsParams fields, by the request
        field that gives it."""
        given: dict[str, dict[str, Any]] = {}
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        for kind in ("json", "regex", "choice", "grammar"):
            if getattr(self, f"guided_{kind}") is not None:
                given[f"guided_{kind}"] = {kind: getattr(self, f"guided_{kind}")}
        if self.structural_tag is not None:
            given["structural_tag"] = {"structural_tag": self.structural_tag}
        response_format = self.response_format
        if response_format is not None and response_format.type == "json_object":
            given["response_format"] = {"json_object": True}
        elif response_format is not None and response_format.type == "json_schema":
            if response_format.json_schema is None or response_format.json_schema.json_schema is None:
                raise APIError(400, 'a response_format of type "json_schema" needs json_schema.schema',
                               "response_format")
            given["response_format"] = {"json": response_format.json_schema.json_schema}
        elif response_format is not None and response_format.type == "structural_tag":
            given["response_format"] = {"structural_tag": response_format.model_dump(exclude_none=True)}
        return given

    def structured_output(self) -> StructuredOutputsParams | None:
        """The request's one output constraint, or None; a 400 naming the field for two or a bad one."""
        given = self.constraints()
        if len(given) > 1:
            raise APIError(400, f"a request takes at most one output constraint, got {', '.join(given)}",
                           list(given)[1])
        if not given:
            if self.guided_whitespace_pattern is not None:
                raise APIError(400, "guided_whitespace_pattern shapes a JSON constraint, and the request has none",
                               "guided_whitespace_pattern")
            return None
        ((name, fields),) = given.items()
        if self.guided_whitespace_pattern is not None:
            fields = {**fields, "whitespace_pattern": self.guided_whitespace_pattern}
        try:
            return StructuredOutputsParams(**fields)
        except (TypeError, ValueError) as error:  # TypeError: a key StructuredOutputsParams does not have
            about_pattern = str(error).startswith("whitespace_pattern") and self.guided_whitespace_pattern is not None
            raise APIError(400, f"{name}: {error}", "guided_whitespace_pattern" if about_pattern else name) from error

    def unknown_fields(self) -> list[str]:
        """The request's fields this server does not know (none of the route's, OpenAI's that it ignores on purpose,
        or the unsupported ones a 400 names), each with the nearest known name when one is close: 'temprature (did
        you mean temperature?)'."""
        known = set(type(self).model_fields) | set(UNSUPPORTED_FIELDS) | set(self.route_unsupported) | IGNORED_FIELDS
        unknown = []
        for name in self.model_extra or {}:
            if name in known:
                continue
            near = difflib.get_close_matches(name, sorted(type(self).model_fields), n=1)
            unknown.append(f"{name} (did you mean {near[0]}?)" if near else name)
        return unknown

    def _check_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name, (neutral, why) in {**UNSUPPORTED_FIELDS, **self.route_unsupported}.items():
            if name in extra and not neutral(extra[name]):
                raise APIError(400, f"{name} is not supported by this server ({why}); got {extra[name]!r:.120}",
                               name)
        if extra.get("best_of") not in (None, self.n):  # a field of /v1/completions only, elsewhere an extra
            raise APIError(400, f"best_of is not supported by this route unless it equals n ({self.n}); "
                                f"/v1/completions has it; got {extra['best_of']!r:.40}", "best_of")

    def param_of(self, message: str) -> str | None:
        """The request field an error message is about: SamplingParams' and the engine's messages start
        with the field's name."""
        match = re.match(r"[a-z_]+", message)
        name = self.param_names.get(match.group(0), match.group(0)) if match else None
        return name if name in type(self).model_fields else None

    def to_sampling_params(self, defaults: dict[str, Any], max_model_len: int) -> SamplingParams:
        """SamplingParams of this request; `defaults` (the model's generation config) fill the fields it
        leaves unset. ValueError on out-of-range values."""
        values = {**self._sampling_values(), **self._route_values()}
        for name, value in defaults.items():
            if values.get(name) is None:
                values[name] = value
        max_tokens = values.pop("max_tokens", None)
        if values.get("truncate_prompt_tokens") == -1:
            values["truncate_prompt_tokens"] = max_model_len - 1
        return SamplingParams(max_tokens=max_tokens, structured_outputs=self.structured_output(),
                              **{k: v for k, v in values.items() if v is not None})

    def _sampling_values(self) -> dict[str, Any]:
        """The SamplingParams fields shared by both routes; None where the request leaves them unset."""
        return dict(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, bad_words=self.bad_words, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
            thinking_token_budget=self.thinking_token_budget,
            truncate_prompt_tokens=self.truncate_prompt_tokens, truncation_side=self.truncation_side,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def _route_values(self) -> dict[str, Any]:
        """max_tokens, logprobs and prompt_logprobs, which each route spells its own way."""
        raise NotImplementedError


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    route_unsupported: ClassVar = {
        "add_special_tokens": (_one_of(True), "text prompts are always tokenized with special tokens"),
    }
    param_names: ClassVar = {"beam_width": "n"}

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    # Samples generated per prompt, of which the n with the highest cumulative logprob are returned (None: n).
    best_of: int | None = None
    # vLLM's beam search: beam width best_of (None: n), the n best beams returned (jaxserve/engine/beam_search.py)
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def check(self) -> None:
        super().check()
        max_tokens = self.max_tokens
        if max_tokens is not None and max_tokens < 1 and not (max_tokens == 0 and self.echo):
            hint = " (0, to score the prompt without generating, needs echo=true)" if max_tokens == 0 else ""
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}{hint}", "max_tokens")
        if self.use_beam_search:
            self._check_beam_search()

    def _check_beam_search(self) -> None:
        """APIError (400, naming the field) for what beam search cannot honour: streaming (as vLLM),
        sampling controls, and more logprobs than the 2 * beam width candidates each step returns."""
        if self.stream:
            raise APIError(400, "streaming is not supported with use_beam_search", "stream")
        for name, neutral in BEAM_SEARCH_UNSUPPORTED.items():
            if not neutral(getattr(self, name)):
                raise APIError(400, f"{name} is not supported with use_beam_search; got {getattr(self, name)!r:.120}",
                               name)
        width = self.best_of or self.n
        if self.logprobs is not None and self.logprobs > 2 * width:
            raise APIError(400, f"logprobs must be at most {2 * width} (2 * the beam width) with use_beam_search, "
                                f"got {self.logprobs}", "logprobs")

    def to_beam_search_params(self) -> BeamSearchParams:
        """The beam search parameters of this request (ValueError naming the field when out of range): beam
        width best_of, else n; temperature 0 unless given (vLLM falls back to the model's default or 1)."""
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        return BeamSearchParams(beam_width=self.best_of or self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                temperature=self.temperature or 0.0, length_penalty=self.length_penalty)

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [prompt]
        return list(prompt)

    def _route_values(self) -> dict[str, Any]:
        """vLLM's rules: null max_tokens means 16, and echo with logprobs asks for the prompt's logprobs."""
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        return dict(max_tokens=max_tokens, logprobs=self.logprobs, prompt_logprobs=prompt_logprobs,
                    best_of=self.best_of)


# OpenAI's reasoning effort levels (chat's `reasoning_effort`, the Responses API's `reasoning.effort`)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


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
        """The message as the chat template sees it, with text parts joined; an assistant's reasoning (vLLM's
        `reasoning`, or `reasoning_content`) under both names, as vLLM gives it (Qwen3's template reads the
        second)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        if self.role == "assistant" and isinstance(reasoning, str) and reasoning:
            message.update(reasoning=reasoning, reasoning_content=reasoning)
        return message


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    route_unsupported: ClassVar = {
        "add_special_tokens": (_one_of(False), "the chat template alone places the special tokens"),
        "use_beam_search": (_false, _BEAM),
        "length_penalty": (_one_of(1.0), _BEAM),
    }
    param_names: ClassVar = {"logprobs": "top_logprobs"}

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    # None: "auto" with tools, else "none" (OpenAI's defaults)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # with a reasoning parser: false leaves the thinking out of the reply (vLLM's)
    reasoning_effort: ReasoningEffort | None = None  # OpenAI's: to the chat template as `reasoning_effort`

    def check(self) -> None:
        super().check()
        if self.tool_choice not in (None, "none") and not self.tools:
            raise APIError(400, f"tool_choice {self.tool_choice_name()!r} needs tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.named_tool() is None:
            raise APIError(400, f"tool_choice names the function {self.tool_choice.function.name!r}, which is not "
                                "among the tools", "tool_choice")
        if self.top_logprobs not in (None, 0) and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(self, name)
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"{name} must be at least 1, got {max_tokens}", name)

    def _route_values(self) -> dict[str, Any]:
        """No max_tokens means "the model's default, else until max_model_len"; echo asks for the prompt's
        logprobs (vLLM's rule), returned only when not streaming."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and not self.stream:
            prompt_logprobs = self.top_logprobs or 0
        return dict(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: `chat_template_kwargs`, with `reasoning_effort` where they leave it
        unset (gpt-oss's template reads it; a template that does not ignores it)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs or None

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template sees them."""
        return [arguments_for_template(message.for_template()) for message in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template sees them (OpenAI's shape), or None."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def tool_choice_name(self) -> str:
        """"none", "auto", "required" or "function" (a named function), with OpenAI's defaults."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "function"
        return self.tool_choice or ("auto" if self.tools else "none")

    def named_tool(self) -> Tool | None:
        """The tool a named tool_choice calls (None when it is not among the tools, or none is named)."""
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        return find_tool(self.tools or [], self.tool_choice.function.name)

    def constraints(self) -> dict[str, dict[str, Any]]:
        """The request's constraints, with the one `required` and a named function put on the output: a JSON
        array of calls, or the function's arguments."""
        given = super().constraints()
        choice = self.tool_choice_name()
        if choice == "required":
            given["tool_choice"] = {"json": required_schema(self.tools, self.parallel_tool_calls)}
        elif choice == "function":
            given["tool_choice"] = {"json": self.named_tool().function.parameters_schema()}
        return given

    def reply_role(self) -> str:
        """The role of the reply: the assistant's, or the last message's when the template adds no
        generation prompt (vLLM's rule)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echo_text(self) -> str:
        """What `echo` puts before the reply: the last message's content when its role is the reply's."""
        last = self.conversation()[-1]
        if not self.echo or last["role"] != self.reply_role():
            return ""
        return last.get("content") or ""


class BatchChatCompletionRequest(ChatCompletionRequest):
    """POST /v1/chat/completions/batch (vLLM's): `messages` is a list of conversations, each answered as a chat
    request of the other fields would be, one choice per conversation; not streamed, without tools, n of 1."""

    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(min_length=1)

    def check(self) -> None:
        super().check()
        for name, refused in (("stream", self.stream), ("tools", bool(self.tools)), ("n", self.n != 1)):
            if refused:
                raise APIError(400, f"batch chat completions do not support {name} (as in vLLM); got "
                                    f"{getattr(self, name)!r:.80}", name)

    def conversations(self) -> list[ChatCompletionRequest]:
        """One chat request per conversation, with the batch's other fields."""
        fields = self.model_dump(exclude={"messages"}, exclude_unset=True)
        return [ChatCompletionRequest(**fields, messages=messages) for messages in self.messages]


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt, or chat messages rendered by the chat template to text and then
    encoded (vLLM's two request shapes in one model)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: vLLM's defaults, True for a prompt, False for messages (the template adds its own)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    chat_template: str | None = None
    tools: list[dict] | None = None

    def unsupported_fields(self) -> list[str]:
        """Set fields this server refuses: a request's own chat template (vLLM refuses it too unless
        told to trust it)."""
        return ["chat_template"] if self.chat_template else []

    def special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens (BOS, ...) to the text."""
        return self.messages is None if self.add_special_tokens is None else self.add_special_tokens


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's): a PEFT folder loaded under a name requests' `model` can then give."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UpdateWeightsRequest(BaseModel):
    """POST /update_weights_from_disk (SGLang's): the folder of the new weights."""

    model_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def chat_request(fields: dict[str, Any], param_of: Callable[[str], str | None]) -> ChatCompletionRequest:
    """The chat completion request another API's request means (`fields` by the chat request's names: the
    Responses and Messages APIs); APIError (400) for a value it refuses, naming that API's field, `param_of` the
    chat request's."""
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise APIError(400, f"{where}: {first.get('msg')}", param_of(where.split(".")[0])) from error
