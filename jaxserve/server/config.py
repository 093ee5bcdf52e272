"""Options of the HTTP server (the engine's own options are jaxserve.EngineConfig)."""

from __future__ import annotations

import dataclasses

from jaxserve.engine.harmony import HarmonyReasoning

# The tool call parsers (vLLM's names; server/tools.py's TOOL_PARSERS, which a test keeps equal), named here for the
# command line, which imports no server packages.
VALID_TOOL_CALL_PARSERS = ("hermes", "llama3_json", "qwen3_coder", "mistral", "pythonic", "granite",
                           "phi4_mini_json", "openai")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Where to listen and how to guard the API."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "tiny-stdlib-llama"  # the name responses give, and the first clients may send
    served_model_aliases: tuple[str, ...] = ()  # other names clients may send for it (vLLM's further names)
    api_key: str | None = None  # when set, every /v1 route needs `Authorization: Bearer <key>`
    max_waiting_requests: int = 1024  # accepted but not started; past it: 503 with Retry-After
    retry_after_s: int = 1
    max_n: int = 16  # largest `n` (samples per prompt) a request may ask for
    max_prompts: int = 64  # largest number of prompts in one completions request
    max_body_bytes: int = 4 * 2**20
    reject_unknown_fields: bool = False  # answer 400 for a request field the server does not know (OpenAI's way)
    metrics_prefix: str = "jaxserve"
    stream_interval: int = 1  # tokens per streamed chunk (vLLM's --stream-interval)
    enable_force_include_usage: bool = False  # a usage chunk ends every stream, asked for or not (vLLM's flag)
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details (vLLM's flag)
    # logprobs name tokens "token_id:N" unless a request says otherwise (vLLM's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool = False
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (404 when off, as in vLLM)
    enable_server_load_tracking: bool = False  # GET /load counts requests in flight on the generation routes
    # How tool calls are found in free text for tool_choice "auto" (server/tools.py TOOL_PARSERS); None: "auto"
    # is refused. vLLM's --tool-call-parser (its --enable-auto-tool-choice is implied).
    tool_call_parser: str | None = None
    chat_template: str | None = None  # a Jinja chat template used instead of the tokenizer's (vLLM's --chat-template)
    # CORS (vLLM's flags): origins browsers may call from (none: no CORS headers, where vLLM allows any), and the
    # methods, headers and credentials those calls may use.
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, behind its VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora_updating: bool = False
    # responses of /v1/responses kept for previous_response_id and GET /v1/responses/{id}: the newest this many
    # (0: none, vLLM's default)
    max_stored_responses: int = 0
    # POST /update_weights_from_disk (SGLang's route): new weights of the served model from a folder
    enable_weight_updates: bool = False
    # GET /dashboard, the live page, and /dashboard/data, its snapshot (behind the API key)
    enable_dashboard: bool = True
    # Seconds an idle kept-alive connection stays open (uvicorn's timeout_keep_alive, whose default is 5). Longer than
    # the clients' own idle limits (httpx and the openai client 5, aiohttp 15, a load balancer's often 60), so the
    # client always drops an idle connection first: at equal limits a request sent on a connection idle for just
    # under them meets the server's close and fails unanswered (a connection reset).
    timeout_keep_alive: int = 75

    def __post_init__(self):
        for name in ("max_waiting_requests", "max_n", "max_prompts", "max_body_bytes", "retry_after_s",
                     "stream_interval", "timeout_keep_alive"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_stored_responses < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {self.max_stored_responses}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.tool_call_parser is not None and self.tool_call_parser not in VALID_TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(VALID_TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if not self.metrics_prefix.replace("_", "").isalnum():
            raise ValueError(f"metrics_prefix must be letters, digits and underscores, got {self.metrics_prefix!r}")

    def check_reasoning(self, reasoning) -> None:
        """ValueError when this server's tool call parser does not fit the engine's reasoning parser (`reasoning`:
        LLMEngine.reasoning, None without one)."""
        if self.tool_call_parser == "openai" and not isinstance(reasoning, HarmonyReasoning):
            raise ValueError("tool_call_parser openai reads gpt-oss's harmony messages with the reasoning parser "
                             "openai_gptoss: start the engine with --reasoning-parser openai_gptoss")
