"""`kvprefix serve --ray`: the options that put the server's replicas on a Ray cluster, and the run that deploys
them. Light at import (no Ray): the `kvprefix` command adds these options to `serve` (``kvprefix.cli``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from typing import Any

from kvprefix.paths import positive_int
from kvprefix.router.policies import POLICIES

log = logging.getLogger("kvprefix.router.ray")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ray = parser.add_argument_group("Ray Serve: replicas on a Ray cluster, routed by a policy (docs/router.md)")
    ray.add_argument("--ray", action="store_true", help="serve --replicas engine replicas as a Ray Serve deployment")
    ray.add_argument("--replicas", type=positive_int, default=2, help="with --ray: engine replicas (default 2)")
    ray.add_argument("--ray-address", default=None,
                     help="with --ray: a running cluster (auto, or HEAD_IP:6379); default: start a local one")
    ray.add_argument("--policy", default="kv-events", choices=list(POLICIES),
                     help="with --ray: how to pick a replica (default kv-events: by each replica's exact cached "
                          "blocks, from its KV event stream, weighed against its queued work)")
    ray.add_argument("--load-cap", type=float, default=1.25,
                     help="with --ray: session, prefix and kv-events pass over replicas above this x the mean load")
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="with --ray: CPUs reserved per replica")


def check(args: argparse.Namespace) -> None:
    """Refuses what the Ray deployment cannot do, before anything loads."""
    if args.ray and args.request_log:
        raise SystemExit("kvprefix serve: --request-log is not supported with --ray (the replicas would share it)")


def run_on_ray(args: argparse.Namespace, make_replica: Callable[[dict[str, Any], Any], tuple[Any, Any]],
               engine_args: dict[str, Any], config: Any) -> int:
    """Deploys replicas made by ``make_replica`` (``build_app``) on the cluster at ``--ray-address`` (default: a
    new local one, stopped whole on exit) and serves until interrupted (Ctrl-C or SIGTERM)."""
    from ray import serve

    from kvprefix.router.ray.app import build_app
    from kvprefix.router.ray.cluster import ray_cluster

    try:
        application = build_app(make_replica, engine_args, config, args.replicas, args.policy, args.seed,
                                args.load_cap, num_cpus=args.replica_cpus, num_gpus=1.0 if args.device == "cuda" else 0.0,
                                admin_key=args.admin_key)
    except ValueError as exc:
        raise SystemExit(f"kvprefix serve --ray: {exc}") from None
    with ray_cluster(args.ray_address):
        try:
            serve.start(http_options={"host": args.host, "port": args.port})
            serve.run(application, name="kvprefix", route_prefix="/")
            log.info("serving %d replicas on http://%s:%d (policy %s)", args.replicas, args.host, args.port,
                     args.policy)
            asyncio.run(asyncio.Event().wait())
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (ray_cluster)
            pass
        finally:
            serve.shutdown()
    return 0
