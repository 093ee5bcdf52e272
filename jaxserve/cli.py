"""Command line: `jaxserve generate` streams a completion; `jaxserve serve` runs the OpenAI-compatible server;
`jaxserve bench` measures (jaxserve/bench/); `jaxserve check-config` lowers a config for GPU and TPU on the CPU
(jaxserve/check_config.py)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time

from jaxserve import check_config
from jaxserve.bench.cli import add_bench_commands
from jaxserve.config import (
    VALID_ATTENTION_BACKENDS,
    VALID_BATCHING,
    VALID_DTYPES,
    VALID_KV_CACHE_DTYPES,
    VALID_LOAD_FORMATS,
    VALID_LOGPROBS_MODES,
    VALID_PAGE_SIZES,
    VALID_POLICIES,
    VALID_PREEMPTION_MODES,
    VALID_QUANTIZATIONS,
    VALID_REASONING_PARSERS,
    VALID_RUNNERS,
    VALID_TOOL_CALL_PARSERS,
    EngineConfig,
)
from jaxserve.engine.llm_engine import DEFAULT_MODEL_NAME, LLMEngine
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import load_chat_template

# Engine options that have a command-line flag (`--max-num-seqs` for `max_num_seqs`, ...).
ENGINE_FLAGS = (
    "model", "tokenizer", "dtype", "max_model_len", "page_size", "num_pages", "gpu_memory_utilization",
    "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching",
    "scheduling_policy", "tensor_parallel_size", "attention_backend", "seed", "compilation_cache_dir",
    "skip_precompile", "background_compile", "cpu_kv_cache_gib", "min_token_bucket", "generation_config", "batching",
    "load_format", "async_scheduling", "num_scheduler_steps", "preemption_mode", "swap_space", "max_preemptions",
    "speculative_config", "quantization", "kv_cache_dtype", "calculate_kv_scales", "enable_expert_parallel",
    "enable_structured_outputs", "reasoning_parser", "enable_lora", "max_loras", "max_lora_rank", "lora_modules",
    "distributed_coordinator", "num_processes", "process_id", "distributed_timeout_s", "data_parallel_size",
    "runner", "pooler_config", "enable_sleep_mode", "logprobs_mode", "structured_outputs_in_reasoning",
    "reasoning_config",
)


def _engine_config(args: argparse.Namespace, **command_defaults) -> EngineConfig:
    """EngineConfig from --config (YAML) with the explicitly given flags on top; `command_defaults` are the command's
    own defaults for the options that neither a flag nor the config file sets."""
    flags = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
    return EngineConfig.for_model(flags.pop("model", None), args.config, command_defaults, **flags)


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Hugging Face model folder (default: the bundled tiny model)")
    parser.add_argument("--config", help="YAML file whose keys are engine options; flags override it")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the model folder)")
    parser.add_argument("--dtype", choices=list(VALID_DTYPES))
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--page-size", type=int, choices=list(VALID_PAGE_SIZES))
    parser.add_argument("--num-pages", type=int)
    parser.add_argument("--gpu-memory-utilization", type=float)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    parser.add_argument("--scheduling-policy", choices=list(VALID_POLICIES))
    parser.add_argument("--tensor-parallel-size", type=int)
    parser.add_argument("--enable-structured-outputs", action=argparse.BooleanOptionalAction,
                        help="compile the sampler for constrained requests too (default on)")
    parser.add_argument("--reasoning-parser", choices=list(VALID_REASONING_PARSERS),
                        help="a reasoning model's markers (<think> ... </think>; mistral: [THINK] ... [/THINK]; "
                             "openai_gptoss: harmony's analysis and final channels): structured output constrains "
                             "the answer after the thinking, and chat replies carry the thinking in `reasoning`")
    parser.add_argument("--structured-outputs-in-reasoning", action=argparse.BooleanOptionalAction,
                        help="with a reasoning parser, constrain the whole reply, thinking included (vLLM's "
                             "structured outputs enable_in_reasoning)")
    parser.add_argument("--reasoning-config",
                        help='vLLM\'s reasoning config as JSON: \'{"reasoning_end_str": "TEXT"}\', the text forced '
                             'when a request\'s thinking_token_budget runs out (a transition phrase, then the end '
                             'of thinking, e.g. "I have to answer now.</think>"; default: the end of thinking alone)')
    parser.add_argument("--logprobs-mode", choices=list(VALID_LOGPROBS_MODES),
                        help="what logprobs report: the raw distribution's (raw_logprobs, default; raw_logits) or "
                             "the processed one each token was sampled from (processed_logprobs, processed_logits)")
    parser.add_argument("--enable-lora", action=argparse.BooleanOptionalAction,
                        help="serve LoRA adapters with the model (each request may name one)")
    parser.add_argument("--max-loras", type=int, help="LoRA adapters resident at once (default 1)")
    parser.add_argument("--max-lora-rank", type=int, help="largest LoRA rank served (default 16)")
    parser.add_argument("--lora-modules", nargs="+", action=_LoraModules, metavar="NAME=PATH",
                        help='LoRA adapters (PEFT folders) loaded at start-up, as NAME=PATH or vLLM\'s JSON '
                             '\'{"name": ..., "path": ...}\'; a request\'s `model` names one')
    parser.add_argument("--enable-expert-parallel", action=argparse.BooleanOptionalAction,
                        help="split a mixture of experts' experts whole over the tensor-parallel devices")
    parser.add_argument("--attention-backend", choices=list(VALID_ATTENTION_BACKENDS))
    parser.add_argument("--seed", type=int)
    parser.add_argument("--compilation-cache-dir",
                        help="JAX's persistent compilation cache folder, with jaxserve's executable store inside")
    parser.add_argument("--skip-precompile", action=argparse.BooleanOptionalAction,
                        help="compile each bucket at its first use instead of all at start-up (a quick start: "
                             "the first request of each new shape waits for its compile); default: on for generate, "
                             "off for serve")
    parser.add_argument("--background-compile", action=argparse.BooleanOptionalAction,
                        help="compile the largest buckets first and serve, the others on a background thread, each "
                             "step padded into the largest until its own are ready; default: on for serve")
    parser.add_argument("--cpu-kv-cache-gib", type=float, help="KV pool size on the CPU when --num-pages is not given")
    parser.add_argument("--min-token-bucket", type=int, help="smallest padded token count of a step")
    parser.add_argument("--generation-config",
                        help="sampling defaults: auto (the model's generation_config.json), vllm (none) or a folder")
    parser.add_argument("--batching", choices=list(VALID_BATCHING),
                        help="continuous (default), or static: the pre-paging baseline (a batch at a time, each "
                             "sequence reserving max_model_len of KV)")
    parser.add_argument("--quantization", choices=list(VALID_QUANTIZATIONS),
                        help="weight-only quantization of the linear layers: int8 or fp8 (e4m3), one scale per output "
                             "channel, made at load time (default none)")
    parser.add_argument("--kv-cache-dtype", choices=list(VALID_KV_CACHE_DTYPES),
                        help="the KV pages' dtype: auto (the weights') or fp8 (e4m3 with a scale per layer and KV "
                             "head: twice the tokens in the same memory)")
    parser.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction, default=None,
                        help="with --kv-cache-dtype fp8: compute the scales from a calibration pass at start-up "
                             "instead of taking the checkpoint's k_scale/v_scale (or 1.0)")
    parser.add_argument("--load-format", choices=list(VALID_LOAD_FORMATS),
                        help="auto (the folder's safetensors) or dummy (random weights, for benchmarks)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        help="plan each step while the device runs the one before it")
    parser.add_argument("--num-scheduler-steps", type=int,
                        help="decode iterations per device call when every row of a step decodes (default 1)")
    parser.add_argument("--preemption-mode", choices=list(VALID_PREEMPTION_MODES),
                        help="recompute (default), swap (KV to host memory and back) or auto (swap long contexts)")
    parser.add_argument("--swap-space", type=float, help="GiB of host memory for swapped-out KV pages (default 4)")
    parser.add_argument("--speculative-config",
                        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                             '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' or \'{"method": "draft_model", '
                             '"model": "DRAFT_FOLDER", "num_speculative_tokens": 3}\'')
    parser.add_argument("--enable-sleep-mode", action=argparse.BooleanOptionalAction, default=None,
                        help="let the engine free its KV pool and weights between uses (LLM.sleep / wake_up; the "
                             "server's POST /sleep, /wake_up and GET /is_sleeping)")
    parser.add_argument("--runner", choices=list(VALID_RUNNERS),
                        help="pooling: also serve embeddings (the prompt's final hidden states pooled into one "
                             "vector; /v1/embeddings, LLM.embed), or a sequence classifier's classes (/classify, "
                             "LLM.classify); auto (the default): pooling for a sequence classifier, else generate")
    parser.add_argument("--pooler-config",
                        help='with --runner pooling, how to pool as JSON, e.g. \'{"pooling_type": "MEAN", '
                             '"normalize": false}\' (default: the model folder\'s sentence-transformers pooling, '
                             'else LAST, normalized)')
    parser.add_argument("--distributed-coordinator", metavar="HOST:PORT",
                        help="multi-host: process 0's address, the same on every process (auto: from the cluster "
                             "launcher's environment); process 0 leads, the others follow its steps")
    parser.add_argument("--num-processes", type=int, help="multi-host: how many processes (one per host)")
    parser.add_argument("--process-id", type=int, help="multi-host: this process's rank, 0 (the leader) to N - 1")
    parser.add_argument("--distributed-timeout-s", type=float,
                        help="multi-host: seconds to wait for the coordinator and the other processes (default 60)")
    parser.add_argument("--data-parallel-size", type=int,
                        help="engine replicas over disjoint sets of --tensor-parallel-size devices behind one "
                             "server (default 1)")
    parser.add_argument("--max-preemptions", type=int,
                        help="priority policy: preemptions in a row after which a request is not preempted by "
                             "another again until it finishes (default 3)")


def generate(args: argparse.Namespace) -> int:
    """Stream one completion to stdout. Its step buckets compile at their first use unless a flag or the config
    file says otherwise: one request meets a few of them, and compiling them all first delayed its first token."""
    config = _engine_config(args, skip_precompile=True)
    config.check_one_replica("`jaxserve generate`")
    engine = LLMEngine(config, show_progress=True)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.sample_seed,
    )
    engine.add_request("cli", args.prompt, params)
    sys.stdout.write(args.prompt)
    printed = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    sys.stdout.write("\n")
    return 0


class _LoraModules(argparse.Action):
    """--lora-modules NAME=PATH or '{"name": NAME, "path": PATH}' ... (vLLM's two forms) -> {name: path}."""

    def __call__(self, parser, namespace, values, option_string=None):
        modules = {}
        for value in values:
            if value.lstrip().startswith("{"):
                try:
                    entry = json.loads(value)
                except json.JSONDecodeError as error:
                    parser.error(f"{option_string}: not JSON: {error}")
                if not isinstance(entry, dict) or not {"name", "path"} <= set(entry):
                    parser.error(f"{option_string}: a JSON entry needs name and path, got {value!r}")
                name, path = entry["name"], entry["path"]
            elif "=" in value:
                name, path = value.split("=", 1)
            else:
                parser.error(f"{option_string}: expected NAME=PATH or JSON, got {value!r}")
            modules[name] = path
        setattr(namespace, self.dest, modules)


def _json_strings(value: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's form of the CORS flags)."""
    try:
        items = json.loads(value)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return items


def _tool_call_parser(args: argparse.Namespace) -> str | None:
    """The tool call parser of `serve`'s flags; ValueError for --enable-auto-tool-choice without one."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(VALID_TOOL_CALL_PARSERS)})")
    return args.tool_call_parser


def serve(args: argparse.Namespace) -> int:
    """Load the engine (compiling every step shape), then serve HTTP until interrupted."""
    try:
        import uvicorn

        from jaxserve.server.app import build_app
        from jaxserve.server.config import ServerConfig
    except ImportError as error:
        raise ValueError(f"`jaxserve serve` needs the server packages ({error.name} is missing): "
                         f"pip install 'jaxserve[serve]'") from error
    listen = uvicorn_options(args)  # before the engine loads: a bad TLS file fails at once
    engine_config = _engine_config(args, background_compile=True)
    server_config = ServerConfig(
        host=args.host, port=args.port,
        served_model_name=(args.served_model_name or [engine_config.model or DEFAULT_MODEL_NAME])[0],
        served_model_aliases=tuple((args.served_model_name or [])[1:]),
        api_key=args.api_key or os.environ.get("JAXSERVE_API_KEY") or None,
        max_waiting_requests=args.max_waiting_requests, max_n=args.max_n, max_prompts=args.max_prompts,
        max_body_bytes=args.max_body_bytes,
        metrics_prefix=args.metrics_prefix, stream_interval=args.stream_interval,
        enable_force_include_usage=args.enable_force_include_usage,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        enable_server_load_tracking=args.enable_server_load_tracking, tool_call_parser=_tool_call_parser(args),
        chat_template=None if args.chat_template is None else load_chat_template(args.chat_template),
        allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating
        or os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
        max_stored_responses=args.max_stored_responses, enable_weight_updates=args.enable_weight_updates,
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    engine = LLMEngine(engine_config, show_progress=sys.stderr.isatty())  # no progress bars in server logs
    app = build_app(engine, server_config)
    logging.getLogger("jaxserve").info(
        "serving %r from %s on %s://%s:%d%s (max_model_len %d, %d KV pages of %d tokens, max_num_seqs %d, "
        "tensor_parallel_size %d, API key %s)",
        server_config.served_model_name, engine.model_path, "https" if "ssl_certfile" in listen else "http",
        server_config.host, server_config.port, args.root_path,
        engine.max_model_len, engine.core.num_pages, engine_config.page_size, engine_config.max_num_seqs,
        engine_config.tensor_parallel_size, "required" if server_config.api_key else "off",
    )
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, **listen)
    _server_class(uvicorn)(config).run()
    return 0


def _server_class(uvicorn):
    """uvicorn's Server, its graceful shutdown (stop accepting, let responses finish for up to
    timeout_graceful_shutdown) on SIGTERM only: SIGINT keeps the handler it had, which under the console script
    ends the process at once (jaxserve/console.py)."""

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            kept = signal.getsignal(signal.SIGINT)
            with super().capture_signals():
                signal.signal(signal.SIGINT, kept)
                yield

    return Server


def uvicorn_options(args: argparse.Namespace) -> dict:
    """uvicorn's TLS and root-path settings from `serve`'s flags (vLLM's --ssl-keyfile, --ssl-certfile,
    --ssl-ca-certs, --ssl-cert-reqs, --root-path); a ValueError for a key without its certificate (or the reverse),
    a file that is not there, or a client-certificate requirement without TLS."""
    files = {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile, "ssl_ca_certs": args.ssl_ca_certs}
    for name, path in files.items():
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--{name.replace('_', '-')} {path!r} is not a file")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("TLS needs both --ssl-keyfile and --ssl-certfile")
    if args.ssl_certfile is None and (args.ssl_ca_certs is not None or args.ssl_cert_reqs):
        raise ValueError("--ssl-ca-certs and --ssl-cert-reqs check clients' certificates: they need TLS "
                         "(--ssl-keyfile and --ssl-certfile)")
    options = {"root_path": args.root_path}
    if args.ssl_certfile is not None:
        options.update({name: path for name, path in files.items() if path is not None},
                       ssl_cert_reqs=args.ssl_cert_reqs)
    return options


def convert(args: argparse.Namespace) -> int:
    """Write a Hugging Face folder as an orbax checkpoint of the engine's params (model/checkpoint.py)."""
    from jaxserve.model.checkpoint import convert as convert_checkpoint

    started = time.perf_counter()
    metadata = convert_checkpoint(args.source, args.destination, dtype=args.dtype, quantization=args.quantization,
                                  kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
                                  tensor_parallel_size=args.tensor_parallel_size)
    print(f"wrote {args.destination} in {time.perf_counter() - started:.1f}s: {metadata['dtype']} weights, "
          f"quantization {metadata['quantization']}, {metadata['num_cache_kv_heads']} KV heads stored")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `jaxserve` argument parser."""
    parser = argparse.ArgumentParser(prog="jaxserve", description="A JAX LLM serving engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="stream a completion for one prompt")
    _add_engine_flags(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    gen.set_defaults(handler=generate)
    srv = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_engine_flags(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes (or set JAXSERVE_API_KEY)")
    srv.add_argument("--served-model-name", nargs="+",
                     help="the model name clients send (default: --model, or the bundled model's); several: any of "
                          "them, responses giving the first (vLLM's flag)")
    srv.add_argument("--max-waiting-requests", type=int, default=1024,
                     help="requests accepted but not started before the server answers 503 with Retry-After")
    srv.add_argument("--max-n", type=int, default=16, help="largest n (samples per prompt) a request may ask for")
    srv.add_argument("--max-prompts", type=int, default=64, help="most prompts in one completions request")
    srv.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="largest request body")
    srv.add_argument("--metrics-prefix", default="jaxserve", help="prefix of the Prometheus metric names (vllm for drop-in dashboards)")
    srv.add_argument("--stream-interval", type=int, default=1,
                     help="stream every N tokens (vLLM's option): larger values cost less host work per token")
    srv.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                     help="serve GET /tokenizer_info (the tokenizer's configuration and chat template)")
    srv.add_argument("--tool-call-parser", choices=list(VALID_TOOL_CALL_PARSERS),
                     help="how tool calls are found in the model's text for tool_choice \"auto\": hermes (Hermes, "
                          "Qwen 2.5 / 3), llama3_json (Llama 3.1 / 3.2), qwen3_coder (Qwen3-Coder), mistral "
                          "(Mistral's [TOOL_CALLS]) or pythonic (Llama 3.2 / 4: a Python list of calls); without it "
                          "\"auto\" is refused")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="vLLM's switch for tool_choice \"auto\", accepted for its launch commands: "
                          "--tool-call-parser alone turns it on, and this needs it")
    srv.add_argument("--chat-template",
                     help="a chat template (Jinja), or its file, used instead of the tokenizer's (vLLM's flag)")
    srv.add_argument("--allowed-origins", type=_json_strings, default=[],
                     help='CORS: origins browsers may call from, as JSON (\'["https://app.example"]\' or \'["*"]\'); '
                          "default none: no CORS headers (vLLM allows any origin)")
    srv.add_argument("--allowed-methods", type=_json_strings, default=["*"], help='CORS: methods (JSON, default ["*"])')
    srv.add_argument("--allowed-headers", type=_json_strings, default=["*"], help='CORS: headers (JSON, default ["*"])')
    srv.add_argument("--allow-credentials", action="store_true", help="CORS: let browsers send credentials")
    srv.add_argument("--allow-runtime-lora-updating", action="store_true",
                     help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; its "
                          "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true does the same)")
    srv.add_argument("--max-stored-responses", type=int, default=0,
                     help="keep the newest N responses of /v1/responses, for previous_response_id and GET "
                          "/v1/responses/{id} (default 0: none, as vLLM)")
    srv.add_argument("--enable-weight-updates", action="store_true",
                     help="serve POST /update_weights_from_disk (SGLang's route): new weights of the served model "
                          "from a folder, without a restart")
    srv.add_argument("--enable-server-load-tracking", action="store_true",
                     help="count requests in flight on the generation routes, for GET /load")
    srv.add_argument("--enable-force-include-usage", action="store_true",
                     help="end every stream with a usage chunk, whether the request asks for it or not")
    srv.add_argument("--return-tokens-as-token-ids", action="store_true",
                     help='logprobs name each token "token_id:N" instead of its text (a request may say otherwise)')
    srv.add_argument("--enable-prompt-tokens-details", action="store_true",
                     help="add usage.prompt_tokens_details (cached_tokens) to responses")
    srv.add_argument("--ssl-keyfile", help="serve HTTPS: the server's private key file (PEM), with --ssl-certfile")
    srv.add_argument("--ssl-certfile", help="serve HTTPS: the server's certificate file (PEM), with --ssl-keyfile")
    srv.add_argument("--ssl-ca-certs", help="HTTPS: the certificates (PEM) that sign the clients' certificates")
    srv.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                     help="HTTPS: whether clients must show a certificate (Python's ssl.CERT_NONE 0, CERT_OPTIONAL 1, "
                          "CERT_REQUIRED 2)")
    srv.add_argument("--root-path", default="",
                     help="the path prefix a proxy serves this server under (ASGI root_path, vLLM's flag)")
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    srv.set_defaults(handler=serve)
    add_bench_commands(commands)
    conv = commands.add_parser("convert", help="write a Hugging Face folder as an orbax checkpoint of the engine's "
                               "params (stacked, cast, optionally quantized), with its config and tokenizer")
    conv.add_argument("source", help="a Hugging Face model folder")
    conv.add_argument("destination", help="a new folder")
    conv.add_argument("--dtype", choices=list(VALID_DTYPES), default="auto")
    conv.add_argument("--quantization", choices=list(VALID_QUANTIZATIONS), default="none")
    conv.add_argument("--kv-cache-dtype", choices=list(VALID_KV_CACHE_DTYPES), default="auto",
                      help="fp8: store the fp8 KV cache's scales (the source's k_scale/v_scale, else 1.0)")
    conv.add_argument("--calculate-kv-scales", action="store_true",
                      help="with --kv-cache-dtype fp8: store scales from a calibration pass (model/kv_calibration.py)")
    conv.add_argument("--tensor-parallel-size", type=int, default=1,
                      help="store the KV heads replicated as this tensor parallelism needs (default 1)")
    conv.set_defaults(handler=convert)
    check = commands.add_parser("check-config", help="lower a config's every step for GPU and TPU on the CPU, and "
                                "estimate device memory and start-up compile time",
                                description=check_config.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    check_config.add_arguments(check)
    check.set_defaults(handler=check_config.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxserve` console script; bad options exit with a message, not a traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as error:
        parser.exit(2, f"jaxserve: error: {error}\n")

