"""Command line: `jaxserve generate` streams a completion from a local model."""

from __future__ import annotations

import argparse
import sys

from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from --config (YAML) with the explicitly given flags on top."""
    flags = {
        "model": args.model,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "page_size": args.page_size,
        "num_pages": args.num_pages,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "tensor_parallel_size": args.tensor_parallel_size,
        "seed": args.seed,
    }
    flags = {key: value for key, value in flags.items() if value is not None}
    return EngineConfig.for_model(flags.pop("model", None), args.config, **flags)


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Hugging Face model folder (default: the bundled tiny model)")
    parser.add_argument("--config", help="YAML file whose keys are engine options; flags override it")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--page-size", type=int, choices=[8, 16, 32])
    parser.add_argument("--num-pages", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--tensor-parallel-size", type=int)
    parser.add_argument("--seed", type=int)


def generate(args: argparse.Namespace) -> int:
    """Stream one completion to stdout."""
    engine = LLMEngine(_engine_config(args), show_progress=True)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxserve` console script; bad options exit with a message, not a traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as error:
        parser.exit(2, f"jaxserve: error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
