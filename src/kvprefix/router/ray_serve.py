"""Ray Serve: N engine replicas as one deployment, routed by the same policy objects as `kvprefix route`.

Two deployments. ``Ingress`` (FastAPI, no engine) takes the OpenAI request, renders and hashes its prompt with the
replicas' own tokenizer and block identity (``RequestHasher``), and calls the engine deployment through a handle
with the ``RouteRequest`` as a keyword argument. That handle routes with ``PolicyRequestRouter``: Ray's custom
request router, which asks a ``router.policies`` policy over a ``ReplicaView`` of the engine replicas (fixed
positions, load = requests in flight through this router). Each ``Engine`` replica runs an AsyncLLM behind the
server's own app (``server.app.create_app``), called in-process over ASGI, so answers are what `kvprefix serve`
gives, streams included; the ``x-kvprefix-replica`` header names the replica that served.

Ray is imported here only: ``kvprefix.router`` stays importable without it (and without torch).
"""

import argparse
import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvprefix.router.app import HASHING_POLICIES
from kvprefix.router.hashing import RouteRequest, route_request
from kvprefix.router.policies import make_policy
from kvprefix.server.bodies import read_body
from kvprefix.server.errors import install_error_handlers
from kvprefix.server.tenancy import Auth

if TYPE_CHECKING:  # server.app loads the engine and torch: only the engine replicas do
    from kvprefix.server.app import ServerConfig

log = logging.getLogger("kvprefix.router.ray")

REPLICA_HEADER = "x-kvprefix-replica"
NO_ROUTE = RouteRequest([], None)


class _SlotView:
    """``ReplicaView`` over the router's slots: position i is ``slots[i]`` (None: a replica that went away)."""

    def __init__(self, slots: list[ReplicaID | None], up: set[ReplicaID], in_flight: dict[ReplicaID, int]):
        self.slots = slots
        self.num_replicas = len(slots)
        self._up = up
        self._in_flight = in_flight

    def healthy(self, replica: int) -> bool:
        return self.slots[replica] in self._up

    def cached_prefix_blocks(self, replica: int, block_hashes: Sequence[Hashable]) -> int:
        return 0  # no event-fed view here: the prefix policy keeps its own index of where blocks went

    def load(self, replica: int) -> float:
        return self._in_flight.get(self.slots[replica], 0)


class PolicyRequestRouter(RequestRouter):
    """Ray Serve request router that asks a kvprefix policy. Replicas keep a fixed position (the session ring and
    the routed-prefix index are keyed by it, Ray's replica ids change on every restart): the first replicas fill
    positions in replica-id order, a new one takes the first position a gone one left, forgotten by the index."""

    def initialize_state(self, policy: str = "round-robin", seed: int = 0, load_cap: float = 1.25, **kwargs):
        self.policy = make_policy(policy, seed, load_cap)
        self.slots: list[ReplicaID | None] = []
        self.in_flight: dict[ReplicaID, int] = {}

    def _place(self, replicas: Sequence[RunningReplica]) -> None:
        up = {r.replica_id for r in replicas}
        routed = getattr(self.policy, "routed", None)
        self.slots = [s if s in up else None for s in self.slots]
        for rid in sorted(up - set(self.slots), key=lambda r: r.unique_id):
            if None in self.slots:
                i = self.slots.index(None)
                self.slots[i] = rid
                if routed is not None:
                    routed.forget(i)
            else:
                self.slots.append(rid)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        self._place(candidate_replicas)
        route = pending_request.kwargs.get("route") if pending_request is not None else None
        if route is None:  # not a client request (the block identity, a health probe): any replica
            return [candidate_replicas]
        by_id = {r.replica_id: r for r in candidate_replicas}
        chosen = by_id.get(self.slots[self.policy.choose(route, _SlotView(self.slots, set(by_id), self.in_flight))])
        return [[chosen]] if chosen is not None else [candidate_replicas]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.in_flight.get(replica_id, 0) > 0:
            self.in_flight[replica_id] -= 1


async def _call_asgi(app, method: str, path: str, query: bytes, headers: list[tuple[str, str]],
                     body: bytes) -> AsyncIterator[Any]:
    """Runs one HTTP request through an ASGI app in-process: yields (status, headers), then the body's chunks as
    they come (a stream stays a stream). Closing the generator early is a client disconnect."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    messages: asyncio.Queue[dict] = asyncio.Queue()
    gone = asyncio.Event()
    request = {"type": "http.request", "body": body, "more_body": False}

    async def receive() -> dict:
        nonlocal request
        if request is not None:
            message, request = request, None
            return message
        await gone.wait()
        return {"type": "http.disconnect"}

    task = asyncio.create_task(app(scope, receive, messages.put))
    task.add_done_callback(lambda _: messages.put_nowait({"type": "done"}))
    try:
        while True:
            message = await messages.get()
            if message["type"] == "http.response.start":
                yield message["status"], [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]]
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    break
            elif message["type"] == "done":
                task.result()  # the app raised before answering: let it show
                break
    finally:
        gone.set()
        await task


@serve.deployment
class Engine:
    """One engine replica: an AsyncLLM behind `kvprefix serve`'s app."""

    async def __init__(self, engine_args: dict[str, Any], config: "ServerConfig"):
        from kvprefix.engine import AsyncLLM, EngineArgs
        from kvprefix.server.app import create_app

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = AsyncLLM(EngineArgs(**engine_args))
        self.app = create_app(self.engine, dataclasses.replace(config, replica_id=self.replica_id))
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()

    def block_identity(self) -> tuple[Any, int, str, Any]:
        """What the ingress needs to hash prompts as this replica does (the hasher itself does not pickle)."""
        h = self.engine.hasher
        return self.engine.tokenizer, h.block_size, h.algo, h.context

    async def handle(self, method: str, path: str, query: bytes, headers: list[tuple[str, str]], body: bytes,
                     route: RouteRequest | None) -> AsyncIterator[Any]:
        # ``route`` is for the request router (it reads the call's kwargs); the replica has no use for it.
        async for item in _call_asgi(self.app, method, path, query, headers, body):
            if isinstance(item, tuple):
                status, response_headers = item
                item = status, [*response_headers, (REPLICA_HEADER, self.replica_id)]
            yield item

    async def __del__(self):
        await self._lifespan.__aexit__(None, None, None)


FORWARD_HEADERS = ("authorization", "content-type", "accept", "x-session-id")


_app = FastAPI(title="kvprefix on Ray Serve")
install_error_handlers(_app)


@serve.deployment
@serve.ingress(_app)
class Ingress:
    """The HTTP entry: hashes the prompt (for the prefix policies), then lets the handle's router pick a replica."""

    def __init__(self, engine, policy: str, auth: Auth):
        self.engine = engine
        self.auth = auth  # the tenant names the namespace to hash in; the replica checks the key again
        self.hashing = policy in HASHING_POLICIES
        self.hasher = None

    async def _hasher(self):
        if self.hasher is None:
            from kvprefix.cache import BlockHasher
            from kvprefix.router.hashing import RequestHasher

            tokenizer, block_size, algo, context = await self.engine.block_identity.remote()
            self.hasher = RequestHasher(tokenizer, BlockHasher(block_size, algo, context))
        return self.hasher

    async def _send(self, raw, route: RouteRequest | None, body: bytes):
        headers = [(k, raw.headers[k]) for k in FORWARD_HEADERS if k in raw.headers]
        stream = self.engine.options(stream=True).handle.remote(raw.method, raw.url.path, raw.url.query.encode(),
                                                                headers, body, route=route)
        status, response_headers = await stream.__anext__()
        drop = {"content-length", "transfer-encoding"}
        return StreamingResponse(stream, status_code=status,
                                  headers={k: v for k, v in response_headers if k.lower() not in drop})

    @_app.post("/v1/completions")
    @_app.post("/v1/chat/completions")
    async def generate(self, raw: Request):
        tenant = self.auth.tenant(raw.headers.get("authorization"))
        body = await read_body(raw)
        hasher = await self._hasher() if self.hashing else None
        return await self._send(raw, route_request(body, raw.headers, tenant, hasher), body)

    @_app.get("/v1/models")
    @_app.get("/v1/models/{model_id:path}")
    async def relay(self, raw: Request):
        return await self._send(raw, NO_ROUTE, b"")

    @_app.get("/health")
    async def health(self, raw: Request):
        return await self._send(raw, None, b"")  # any replica: a probe must not move the policy's rotation


def build_app(engine_args: dict[str, Any], num_replicas: int, policy: str, seed: int = 0, load_cap: float = 1.25,
              config: "ServerConfig | None" = None, num_cpus: float = 1.0, num_gpus: float = 0.0):
    """The Ray Serve application: ``num_replicas`` engine replicas routed by ``policy``, each a `kvprefix serve`
    with ``config`` (its replica_id replaced by Ray's)."""
    if config is None:
        from kvprefix.server.app import ServerConfig

        config = ServerConfig()
    if make_policy(policy, seed, load_cap).name == "kv-events":  # an unknown name fails here too, not in a replica
        raise ValueError("--policy kv-events reads the replicas' KV event streams, which the Ray Serve app does not "
                         "follow yet; use prefix (it predicts the caches from where it routed)")
    router = RequestRouterConfig(request_router_class=PolicyRequestRouter,
                                 request_router_kwargs={"policy": policy, "seed": seed, "load_cap": load_cap})
    engine = Engine.options(num_replicas=num_replicas, request_router_config=router, max_ongoing_requests=256,
                            ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus}).bind(engine_args, config)
    return Ingress.options(ray_actor_options={"num_cpus": 0}).bind(engine, policy, config.auth or Auth())


def run_on_ray(args: argparse.Namespace, engine_args: dict[str, Any], config: "ServerConfig") -> int:
    """`kvprefix serve --ray`: deploys on the cluster at ``--ray-address`` (default: a new local one) and serves
    until interrupted."""
    import ray

    try:
        application = build_app(engine_args, args.replicas, args.policy, args.seed, args.load_cap, config,
                                num_cpus=args.replica_cpus, num_gpus=1.0 if args.device == "cuda" else 0.0)
    except ValueError as exc:
        raise SystemExit(f"kvprefix serve --ray: {exc}") from None
    ray.init(address=args.ray_address, include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(application, name="kvprefix", route_prefix="/")
    log.info("serving %d replicas on http://%s:%d (policy %s)", args.replicas, args.host, args.port, args.policy)
    try:
        asyncio.run(asyncio.Event().wait())
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
    return 0


if __name__ == "__main__":  # python -m kvprefix.router.ray_serve ... == kvprefix serve --ray ...
    import sys

    from kvprefix.cli import main

    sys.exit(main(["serve", "--ray", *sys.argv[1:]]))
