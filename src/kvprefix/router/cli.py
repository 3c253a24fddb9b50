"""`kvprefix route`: the prefix-aware router in front of `kvprefix serve` replicas. Light at import; the web stack
loads in run()."""

from __future__ import annotations

import argparse

from kvprefix.paths import ReadableFile
from kvprefix.router.policies import POLICIES
from kvprefix.tokenizer import chat_template


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replica", action="append", required=True, metavar="URL",
                        help="a replica's base URL, e.g. http://10.0.0.5:8000 (repeat for each replica)")
    parser.add_argument("--policy", default="kv-events", choices=list(POLICIES),
                        help="how to pick a replica (docs/router.md; default kv-events: by each replica's exact "
                             "cached blocks, from its KV event stream, weighed against its queued work)")
    parser.add_argument("--model", default=None,
                        help="the replicas' checkpoint, for prefix and kv-events (they render prompts with its "
                             "tokenizer); needed only where the checkpoint the replicas announce (its path, or the "
                             "built-in default model) is not on this machine")
    chat_template.add_arguments(parser)  # prefix and kv-events render as the replicas do: give theirs
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                        help="comma-separated Host names to serve, * for any (as for kvprefix serve)")
    parser.add_argument("--load-cap", type=float, default=1.25,
                        help="session, prefix, kv-events: pass over replicas above this x the mean requests in flight")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random choices (ties, two choices)")
    parser.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks")
    parser.add_argument("--api-key", default=None, help="as for kvprefix serve: callers form the tenant 'default'")
    parser.add_argument("--api-keys-file", default=None, action=ReadableFile, help='as for kvprefix serve: {"<key>": "<tenant>"}')
    parser.add_argument("--admin-key", default=None,
                        help="the replicas' admin key: guards the router's /metrics and cache resets, and reads "
                             "the replicas' KV events")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from kvprefix.http.browsers import allowed_hosts
    from kvprefix.http.connections import timed_protocol
    from kvprefix.http.launch import run_server
    from kvprefix.http.tenancy import Auth
    from kvprefix.router.app import HASHING_POLICIES, RouterConfig, create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = RouterConfig(
            replicas=args.replica, policy=args.policy, model=args.model,
            chat_template=chat_template.from_arguments(args),
            auth=Auth.from_options(args.api_key, args.api_keys_file, args.admin_key), admin_key=args.admin_key,
            load_cap=args.load_cap, seed=args.seed, health_interval_s=args.health_interval,
            allowed_hosts=allowed_hosts(args.allowed_hosts, args.host),
        )
        app = create_app(config)
        # Before serving: a replica whose identity this router cannot reproduce is a one-line error.
        if config.policy in HASHING_POLICIES:
            config.hasher = asyncio.run(_load_hasher(config))
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"kvprefix route: {exc}") from None
    try:  # the C parser: the relay is the router's hot path (docs/benchmarks.md, router overhead)
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    # uvloop when installed (loop="auto"); no access log: a line per request would cost more than the relay; no
    # X-Forwarded-* rewriting of the client's address and scheme, which the router never reads
    run_server(app, args.host, args.port, log_level=args.log_level, http=timed_protocol(20.0, 60.0, base),
               timeout_keep_alive=5, access_log=False, proxy_headers=False)
    return 0


async def _load_hasher(config):
    import httpx

    from kvprefix.router.app import load_request_hasher

    headers = {"authorization": f"Bearer {config.admin_key}"} if config.admin_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=config.connect_timeout_s)) as client:
        return await load_request_hasher(client, config, headers)
