"""The Ray Serve application: the engine deployment behind the ingress, placed by the policy's request router."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ray.serve.config import RequestRouterConfig

from kvprefix.http.tenancy import Auth
from kvprefix.router.policies import make_policy
from kvprefix.router.ray.engine import Engine
from kvprefix.router.ray.ingress import Ingress
from kvprefix.router.ray.routing import PolicyRequestRouter


def build_app(make_replica: Callable[[dict[str, Any], Any], tuple[Any, Any]], engine_args: dict[str, Any],
              config: Any, num_replicas: int, policy: str, seed: int = 0, load_cap: float = 1.25,
              num_cpus: float = 1.0, num_gpus: float = 0.0, admin_key: str | None = None):
    """``num_replicas`` engine replicas routed by ``policy``, each a `kvprefix serve` made by ``make_replica`` with
    ``engine_args`` and the server's ``config`` (its replica_id replaced by Ray's). ``admin_key``: the replicas'
    admin key, with which the ingress reads their KV events (kv-events) when they have keys."""
    policy = make_policy(policy, seed, load_cap).name  # an unknown name or load cap fails here, not in a replica
    router = RequestRouterConfig(request_router_class=PolicyRequestRouter)
    engine = Engine.options(num_replicas=num_replicas, request_router_config=router, max_ongoing_requests=256,
                            ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus}).bind(make_replica, engine_args,
                                                                                          config)
    return Ingress.options(ray_actor_options={"num_cpus": 0}).bind(engine, policy, seed, load_cap,
                                                                   config.auth or Auth(), num_replicas, admin_key)
