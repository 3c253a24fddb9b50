"""The one `kvprefix` command. Each subcommand lives next to the code it drives, in a light `cli` module that
imports heavy parts (torch, the server) only when that subcommand runs."""

from __future__ import annotations

import argparse
import importlib
import sys

from kvprefix.router.ray import options as ray_options

# name -> module with `add_arguments(parser)` and `run(args) -> int`, plus a one-line help.
SUBCOMMANDS = {
    "simulate": ("kvprefix.sim.cli", "replay a trace (or the seed example) on the real cache code"),
    "serve": ("kvprefix.server.cli", "OpenAI-compatible server with prefix caching (default: 127.0.0.1:8000)"),
    "route": ("kvprefix.router.cli", "prefix-aware router over kvprefix serve replicas (default: 127.0.0.1:8100)"),
    "doctor": ("kvprefix.doctor.cli", "what breaks prefix reuse in a request log, and what fixing it would win"),
    "cache": ("kvprefix.tiers.cli", "a KV tier directory (--kv-disk): stats, verify (full checksum pass), clear"),
    "lab": ("kvprefix.engine.lab", "the prefix cache on a real engine: shared system prompt, caching on vs off"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvprefix", description="prefix-caching LLM engine, server and planner")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
        if name == "serve":  # the server's replicas on a Ray cluster: the options live with the Ray code
            ray_options.add_arguments(p)
            p.set_defaults(_run=_serve)
    return parser


def _serve(args: argparse.Namespace) -> int:
    """`kvprefix serve`: one server, or with --ray its replicas as a Ray Serve deployment."""
    from kvprefix.server import cli as server_cli

    if not args.ray:
        return server_cli.run(args)
    import dataclasses

    ray_options.check(args)
    engine_args, config = server_cli.prepare(args)
    return ray_options.run_on_ray(args, engine_replica, dataclasses.asdict(engine_args), config)


def engine_replica(engine_args: dict, config):
    """One engine replica of a Ray deployment: an AsyncLLM and `kvprefix serve`'s app over it (run in the replica:
    the router's Ray code takes this function instead of importing the engine and the server)."""
    from kvprefix.engine import AsyncLLM, EngineArgs
    from kvprefix.server.app import create_app

    engine = AsyncLLM(EngineArgs(**engine_args))
    return engine, create_app(engine, config)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args._run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
