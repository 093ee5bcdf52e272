"""Command line: `jaxserve generate` streams a completion; `jaxserve serve` runs the OpenAI-compatible server;
`jaxserve bench` measures (jaxserve/bench/); `jaxserve check-config` lowers a config for GPU and TPU on the CPU
(jaxserve/check_config.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time

from jaxserve.bench.cli import BENCH_HELP, add_bench_commands
from jaxserve.config import VALID_DTYPES, VALID_KV_CACHE_DTYPES, VALID_QUANTIZATIONS, EngineConfig
from jaxserve.config.flags import add_engine_flags, given_engine_options
from jaxserve.logs import configure_logging
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.config import VALID_TOOL_CALL_PARSERS

# This module imports only what parsing the command line needs (no jax): `jaxserve --help` and a command whose
# options are wrong answer in a fraction of a second. The engine, the server and the commands' own modules are
# imported when a command runs.

# Each command's defaults for options neither a flag nor the config file sets: generate meets a few of its step
# buckets, so it compiles each at its first use; the server is ready after its largest buckets compile.
GENERATE_DEFAULTS = {"skip_precompile": True}
SERVE_DEFAULTS = {"background_compile": True}


# How long a server whose engine-core process died keeps answering (503 on /health, errors to requests) before it
# stops, so a load balancer's health check sees it.
CORE_DEATH_GRACE_S = 2.0


def _engine_config(args: argparse.Namespace, **command_defaults) -> EngineConfig:
    """EngineConfig from --config (YAML) with the explicitly given flags on top; `command_defaults` are the command's
    own defaults for the options that neither a flag nor the config file sets."""
    flags = given_engine_options(args)
    return EngineConfig.for_model(flags.pop("model", None), args.config, command_defaults, **flags)


def generate(args: argparse.Namespace) -> int:
    """Stream one completion to stdout. Its step buckets compile at their first use unless a flag or the config
    file says otherwise: one request meets a few of them, and compiling them all first delayed its first token."""
    config = _engine_config(args, **GENERATE_DEFAULTS)
    config.parallel_config.check_one_replica("`jaxserve generate`")
    from jaxserve.engine.llm_engine import LLMEngine

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
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {args.api_server_count}")
    if args.api_server_count > 1 and args.engine_in_process:
        raise ValueError("--api-server-count > 1 needs the engine in engine-core processes: drop --engine-in-process")
    metrics_folder = None
    if args.api_server_count > 1:  # before prometheus-client is imported (server/front_ends.py)
        from jaxserve.server.front_ends import prepare_metrics

        metrics_folder = prepare_metrics()
    try:
        import uvicorn

        from jaxserve.server.app import build_app
        from jaxserve.server.config import ServerConfig
        from jaxserve.server.front_ends import raise_open_files_limit, uvicorn_config
    except ImportError as error:
        raise ValueError(f"`jaxserve serve` needs the server packages ({error.name} is missing): "
                         f"pip install 'jaxserve[serve]'") from error
    listen = uvicorn_options(args)  # before the engine loads: a bad TLS file fails at once
    engine_config = _engine_config(args, **SERVE_DEFAULTS)
    from jaxserve.engine.llm_engine import DEFAULT_MODEL_NAME, LLMEngine
    from jaxserve.tokenizer import load_chat_template

    server_config = ServerConfig(
        host=args.host, port=args.port,
        served_model_name=(args.served_model_name or [engine_config.model_config.model or DEFAULT_MODEL_NAME])[0],
        served_model_aliases=tuple((args.served_model_name or [])[1:]),
        api_key=args.api_key or os.environ.get("JAXSERVE_API_KEY") or None,
        max_waiting_requests=args.max_waiting_requests, max_n=args.max_n, max_prompts=args.max_prompts,
        max_body_bytes=args.max_body_bytes, reject_unknown_fields=args.reject_unknown_fields,
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
        enable_dashboard=not args.disable_dashboard, timeout_keep_alive=args.timeout_keep_alive,
    )
    sleeps = engine_config.model_config.enable_sleep_mode
    if args.api_server_count > 1 and (server_config.allow_runtime_lora_updating or sleeps):
        # each front end knows only what was asked of it: the adapters loaded through it, whether it put the engine
        # to sleep
        raise ValueError("--api-server-count > 1 cannot serve runtime LoRA loading or sleep mode yet: use one front "
                         "end (--api-server-count 1) with --allow-runtime-lora-updating or --enable-sleep-mode")
    configure_logging(args.log_level)
    raise_open_files_limit()  # before the engine-core processes and the other front ends start: they inherit it
    engine = _serving_engine(engine_config, server_config, args.engine_in_process)
    app = build_app(engine, server_config)
    model = app.state.async_engine.model
    logging.getLogger("jaxserve").info(
        "serving %r from %s on %s://%s:%d%s (max_model_len %d, %d KV pages of %d tokens, max_num_seqs %d, "
        "tensor_parallel_size %d, engine %s, API key %s)",
        server_config.served_model_name, model.model_path, "https" if "ssl_certfile" in listen else "http",
        server_config.host, server_config.port, args.root_path,
        model.max_model_len, model.kv_cache.num_pages, engine_config.cache_config.page_size,
        engine_config.scheduler_config.max_num_seqs, engine_config.parallel_config.tensor_parallel_size,
        "in this process" if isinstance(engine, LLMEngine) else
        f"core process {', '.join(str(client.process.pid) for client in getattr(engine, 'replicas', [engine]))}",
        "required" if server_config.api_key else "off",
    )
    config = uvicorn_config(app, server_config, args.log_level, host=server_config.host, port=server_config.port,
                            **listen)
    server = _server_class(uvicorn)(config)
    sockets = None
    if metrics_folder is not None:
        from jaxserve.server.front_ends import FrontEnds, core_addresses, listening_socket

        sockets = [listening_socket(server_config.host, server_config.port)]
        front_ends = FrontEnds(args.api_server_count - 1, engine_config, server_config, core_addresses(engine), listen,
                               args.log_level, metrics_folder)
        server.before_shutdown = front_ends.stop  # the other front ends finish their responses before the cores stop
    if not isinstance(engine, LLMEngine):
        def core_died(error: BaseException) -> None:
            # /health answers 503 meanwhile; the responses in flight end with the error
            asyncio.get_running_loop().call_later(CORE_DEATH_GRACE_S, setattr, server, "should_exit", True)

        for client in getattr(engine, "replicas", [engine]):
            client.on_dead = core_died
    server.run(sockets=sockets)
    error = app.state.async_engine.error
    if error is not None and not isinstance(engine, LLMEngine):
        print(f"jaxserve serve: {error}", file=sys.stderr)
        return 1
    return 0


def _serving_engine(engine_config: EngineConfig, server_config, in_process: bool):
    """The engine `serve` runs: engine-core processes' clients (the default; one per data-parallel replica), or an
    LLMEngine in this process (--engine-in-process, and multi-host launches)."""
    from jaxserve.engine.llm_engine import LLMEngine

    if not in_process and engine_config.parallel_config.num_processes > 1:
        logging.getLogger("jaxserve").info("a multi-host launch runs the engine in this process")
        in_process = True
    if in_process:
        return LLMEngine(engine_config, show_progress=sys.stderr.isatty())  # no progress bars in server logs
    from jaxserve.engine.core_client import EngineCoreClient
    from jaxserve.engine.replicas import DataParallelEngine

    clients = EngineCoreClient.launch_replicas(engine_config, engine_config.parallel_config.data_parallel_size,
                                               server_config.max_waiting_requests, server_config.stream_interval)
    return clients[0] if len(clients) == 1 else DataParallelEngine(clients)


def _server_class(uvicorn):
    """uvicorn's Server, its graceful shutdown (stop accepting, let responses finish for up to
    timeout_graceful_shutdown) on SIGTERM only: SIGINT keeps the handler it had, which under the console script
    ends the process at once (jaxserve/console.py)."""

    class Server(uvicorn.Server):
        before_shutdown = None  # a blocking call to make (on a thread) before the app shuts down

        async def shutdown(self, sockets=None):
            if self.before_shutdown is not None:
                await asyncio.get_running_loop().run_in_executor(None, self.before_shutdown)
            await super().shutdown(sockets)

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


def _add_server_flags(srv: argparse.ArgumentParser) -> None:
    """`serve`'s own flags (ServerConfig's, TLS, logging)."""
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes (or set JAXSERVE_API_KEY)")
    srv.add_argument("--served-model-name", nargs="+",
                     help="the model name clients send (default: --model, or the bundled model's); several: any of "
                          "them, responses giving the first (vLLM's flag)")
    srv.add_argument("--engine-in-process", action="store_true",
                     help="run the engine on a thread of the server's process instead of in an engine-core process "
                          "of its own (multi-host launches always run it in process)")
    srv.add_argument("--api-server-count", type=int, default=1,
                     help="front-end processes serving HTTP on the port (tokenizing, detokenizing, streaming) over the "
                          "same engine-core processes: more for many streams on a host with the cores to spare")
    srv.add_argument("--max-waiting-requests", type=int, default=1024,
                     help="requests accepted but not started before the server answers 503 with Retry-After")
    srv.add_argument("--max-n", type=int, default=16, help="largest n (samples per prompt) a request may ask for")
    srv.add_argument("--max-prompts", type=int, default=64, help="most prompts in one completions request")
    srv.add_argument("--reject-unknown-fields", action="store_true",
                     help="answer 400 for a request field the server does not know, naming it (OpenAI's way); by "
                          "default it is ignored and named in the log (vLLM's)")
    srv.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="largest request body, in bytes")
    srv.add_argument("--metrics-prefix", default="jaxserve",
                     help="prefix of the Prometheus metric names (vllm for drop-in dashboards)")
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
                          "without any, no CORS headers (vLLM allows any origin) (default: none)")
    srv.add_argument("--allowed-methods", type=_json_strings, default=["*"], help="CORS: methods, as JSON")
    srv.add_argument("--allowed-headers", type=_json_strings, default=["*"], help="CORS: headers, as JSON")
    srv.add_argument("--allow-credentials", action="store_true", help="CORS: let browsers send credentials")
    srv.add_argument("--allow-runtime-lora-updating", action="store_true",
                     help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; its "
                          "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true does the same)")
    srv.add_argument("--max-stored-responses", type=int, default=0,
                     help="keep the newest N responses of /v1/responses, for previous_response_id and GET "
                          "/v1/responses/{id} (0: none, vLLM's default)")
    srv.add_argument("--enable-weight-updates", action="store_true",
                     help="serve POST /update_weights_from_disk (SGLang's route): new weights of the served model "
                          "from a folder, without a restart")
    srv.add_argument("--enable-server-load-tracking", action="store_true",
                     help="count requests in flight on the generation routes, for GET /load")
    srv.add_argument("--disable-dashboard", action="store_true",
                     help="do not serve the live page GET /dashboard (and its data, /dashboard/data)")
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
                     help="the path prefix a proxy serves this server under (ASGI root_path, vLLM's flag) "
                          "(default: none)")
    srv.add_argument("--timeout-keep-alive", type=int, default=75,
                     help="seconds an idle kept-alive connection stays open (uvicorn's flag; its default 5 races "
                          "clients that keep connections 5 s, as httpx and the openai client do)")
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                     help="the server's log level")


class _DefaultsShown(argparse.HelpFormatter):
    """Help that ends each flag's text with its default, unless the text already names it (the engine's flags)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default:" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if isinstance(action.default, bool):
            return f"{text} (default: {'on' if action.default else 'off'})"
        if action.default is None:
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


CHECK_CONFIG_HELP = ("lower a config's every step for GPU and TPU on the CPU, and estimate device memory and "
                     "start-up compile time")


def _add_check_config(commands) -> None:
    """Add `check-config` with its flags (importing jaxserve/check_config.py: jax)."""
    from jaxserve import check_config

    check = commands.add_parser("check-config", help=CHECK_CONFIG_HELP, description=check_config.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    check_config.add_arguments(check)
    check.set_defaults(handler=check_config.run)


# The commands whose flags come from modules that take seconds to import: (help, what adds them with their flags)
SLOW_COMMANDS = {"bench": (BENCH_HELP, add_bench_commands), "check-config": (CHECK_CONFIG_HELP, _add_check_config)}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `jaxserve` argument parser. Given the `command` this run parses, the other SLOW_COMMANDS are listed
    without their flags (their modules are not imported); None: every command with its flags."""
    parser = argparse.ArgumentParser(prog="jaxserve", description="A JAX LLM serving engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="stream a completion for one prompt", formatter_class=_DefaultsShown)
    add_engine_flags(gen, "generate", GENERATE_DEFAULTS)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    gen.set_defaults(handler=generate)
    srv = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server", formatter_class=_DefaultsShown)
    add_engine_flags(srv, "serve", SERVE_DEFAULTS)
    _add_server_flags(srv)
    srv.set_defaults(handler=serve)
    _add_slow_command(commands, "bench", command)
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
    _add_slow_command(commands, "check-config", command)
    return parser


def _add_slow_command(commands, name: str, command: str | None) -> None:
    """Add the slow command `name` with its flags when this run parses it (or every command), else only its name
    and help (for `jaxserve --help`)."""
    help_text, add_with_flags = SLOW_COMMANDS[name]
    if command is None or command == name:
        add_with_flags(commands)
    else:
        commands.add_parser(name, help=help_text)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxserve` console script; bad options exit with a message, not a traceback."""
    argv = sys.argv[1:] if argv is None else argv
    command = next((arg for arg in argv if not arg.startswith("-")), "")  # the top level has no options but --help
    parser = build_parser(command)
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as error:
        parser.exit(2, f"jaxserve: error: {error}\n")
