"""`jaxserve bench throughput` (offline, several systems side by side), `jaxserve bench serve` (online) and
`jaxserve bench effects` (one engine feature on and off)."""

from __future__ import annotations

import argparse

BENCH_HELP = "benchmark jaxserve against its peers, offline or online"


def add_bench_commands(commands) -> None:
    """Add `bench` and its three commands to the `jaxserve` subcommands (importing their modules: jax, the
    engine)."""
    from jaxserve.bench import effects, offline, online

    bench = commands.add_parser("bench", help=BENCH_HELP)
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    for name, module, run, help_text in (
        ("throughput", offline, offline.run, "offline: one workload through several systems in turn, side by side"),
        ("serve", online, online.run_as_command,
         "online: timed streaming requests to a running OpenAI-compatible server"),
        ("effects", effects, effects.run,
         "A/B runs of one engine feature: chunked prefill, prefix caching, parallel sampling"),
    ):
        parser = kinds.add_parser(name, help=help_text, description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(parser)
        parser.set_defaults(handler=lambda args, run=run: 0 if run(args) is not None else 1)
