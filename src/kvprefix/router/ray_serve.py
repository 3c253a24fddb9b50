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
from collections.abc import AsyncIterator, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvprefix.cache.event_wire import loads
from kvprefix.http.bodies import read_body
from kvprefix.http.errors import install_error_handlers
from kvprefix.http.tenancy import Auth
from kvprefix.router.admin import fan_out_response, replica_result
from kvprefix.router.app import HASHING_POLICIES
from kvprefix.router.events import Lines, follow
from kvprefix.router.fleet import FleetView, Replica
from kvprefix.router.hashing import RouteRequest, route_request
from kvprefix.router.metrics import TAIL_BYTES, RouterMetrics, decision_reason, reported_cached_tokens
from kvprefix.router.pending import Outstanding, Routed
from kvprefix.router.policies import RoutedIndex, make_policy

if TYPE_CHECKING:  # server.app loads the engine and torch: only the engine replicas do
    from kvprefix.server.app import ServerConfig

log = logging.getLogger("kvprefix.router.ray")

REPLICA_HEADER = "x-kvprefix-replica"


class _SlotView:
    """``ReplicaView`` over the router's slots: position i is ``slots[i]`` (None: a replica that went away). Load
    is what this router sent there and has not finished; ``cached`` the exact cached prefix per replica id that
    the ingress read from the replicas' event streams (kv-events), to which the blocks of requests in flight add."""

    def __init__(self, slots: list[ReplicaID | None], up: set[ReplicaID], outstanding: dict[ReplicaID, Outstanding],
                 cached: Mapping[str, int] | None = None):
        self.slots = slots
        self.num_replicas = len(slots)
        self._up = up
        self._outstanding = outstanding
        self._cached = cached or {}

    def _of(self, replica: int) -> Outstanding | None:
        return self._outstanding.get(self.slots[replica])

    def healthy(self, replica: int) -> bool:
        return self.slots[replica] in self._up

    def cached_prefix_blocks(self, replica: int, block_hashes: Sequence[Hashable]) -> int:
        rid = self.slots[replica]
        exact = self._cached.get(rid.unique_id, 0) if self._cached and rid is not None else 0
        out = self._of(replica)
        # Pending blocks are whole chains: counting on from the exact prefix through pending blocks would reach
        # the pending prefix when that is longer, and stop at once otherwise.
        return max(exact, out.blocks.cached_prefix_blocks(block_hashes)) if out is not None else exact

    def load(self, replica: int) -> float:
        out = self._of(replica)
        return out.requests if out is not None else 0

    def queued_prefill_blocks(self, replica: int) -> float:
        out = self._of(replica)
        return out.queued_prefill_blocks if out is not None else 0


class ReplicaSlots:
    """The engine replicas at fixed policy positions, and what this router sent each (``Outstanding``).

    The session ring and the routed-prefix index are keyed by position, and Ray's replica ids change on every
    restart: the first replicas fill positions in replica-id order, a new one takes the first position a gone one
    left, which the index (``routed``) forgets. ``resets`` are (replica id, how many times its cache was reset
    through the ingress so far): every call carries them, and each reset is forgotten once, by the first call that
    brings it (a request Ray asks about again, or the calls after it, forget nothing more)."""

    def __init__(self, routed: RoutedIndex | None = None):
        self.routed = routed
        self.slots: list[ReplicaID | None] = []
        self.outstanding: dict[ReplicaID, Outstanding] = {}
        self._resets_applied: dict[str, int] = {}

    def place(self, up: set[ReplicaID], resets: Sequence[tuple[str, int]] = ()) -> None:
        routed = self.routed
        for replica_id, count in resets:
            if count <= self._resets_applied.get(replica_id, 0):
                continue
            self._resets_applied[replica_id] = count
            for i, rid in enumerate(self.slots):
                if routed is not None and rid is not None and rid.unique_id == replica_id:
                    routed.forget(i)
        self.slots = [s if s in up else None for s in self.slots]
        for rid in sorted(up - set(self.slots), key=lambda r: r.unique_id):
            self.outstanding[rid] = Outstanding()
            if None in self.slots:
                i = self.slots.index(None)
                self.slots[i] = rid
                if routed is not None:
                    routed.forget(i)
            else:
                self.slots.append(rid)


class PolicyRequestRouter(RequestRouter):
    """Ray Serve request router that asks a kvprefix policy over the replicas' fixed positions (``ReplicaSlots``).
    A call with ``exclude=ids`` goes to a replica whose id is not among them (the ingress follows each replica's
    event stream once, and fans admin calls out to every one; while Ray knows no other replica yet, any); a call
    with no ``route`` to any replica. ``forget=((id, resets), ...)``: the replicas whose cache was reset through the
    ingress, and how often; the routed-prefix index forgets a new reset before this call is placed, as `kvprefix
    route` does."""

    def initialize_state(self, policy: str = "round-robin", seed: int = 0, load_cap: float = 1.25, **kwargs):
        self.policy = make_policy(policy, seed, load_cap)
        self.placement = ReplicaSlots(getattr(self.policy, "routed", None))
        # request id -> (route, credited blocks, replica chosen, replicas chosen before that refused it)
        self._chosen: dict[str, tuple[RouteRequest, int, ReplicaID | None, tuple[str, ...]]] = {}
        self._routed: dict[str, Routed] = {}  # request id -> its share of the replica's load, until it completes

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        placement = self.placement
        placement.place({r.replica_id for r in candidate_replicas}, kwargs.get("forget") or ())
        by_id = {r.replica_id: r for r in candidate_replicas}
        exclude = kwargs.get("exclude")
        if exclude is not None:  # a replica the caller has not reached yet; none: any (the ingress sees the repeat)
            others = [r for r in candidate_replicas if r.replica_id.unique_id not in exclude]
            return [others or candidate_replicas]
        route = kwargs.get("route")
        if route is None:  # not a client request (the block identity, a health probe): any replica
            return [candidate_replicas]
        view = _SlotView(placement.slots, set(by_id), placement.outstanding, route.replica_cached)
        chosen = by_id.get(placement.slots[self.policy.choose(route, view)])
        request_id = pending_request.metadata.internal_request_id
        earlier = self._chosen.get(request_id)  # asked again: the replica chosen before refused it (full)
        refused = () if earlier is None else (*earlier[3], *([earlier[2].unique_id] if earlier[2] else []))
        self._chosen[request_id] = route, self.policy.credited, chosen and chosen.replica_id, refused
        return [[chosen]] if chosen is not None else [candidate_replicas]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request_id = pending_request.metadata.internal_request_id
        chosen = self._chosen.pop(request_id, None)
        if chosen is None:
            return
        route, credited, _, refused = chosen
        route.decision = (decision_reason(bool(refused), credited, self.policy.name == "session", route.session),
                          credited, refused)
        out = self.placement.outstanding.setdefault(replica_id, Outstanding())
        # The router sees no first token: a request's prefill counts as queued until it completes.
        self._routed[request_id] = out.add(route.block_hashes, max(route.num_blocks - credited, 0))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        routed = self._routed.pop(internal_request_id, None)
        if routed is not None:
            routed.finish()


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

    def block_identity(self) -> tuple[Any, Any, int]:
        """What the ingress needs to hash prompts as this replica does: its tokenizer, ``BlockIdentity`` and context
        length (a hasher does not pickle)."""
        return self.engine.tokenizer, self.engine.identity, self.engine.max_sequence_tokens

    async def handle(self, method: str, path: str, query: bytes, headers: list[tuple[str, str]], body: bytes,
                     route: RouteRequest | None, exclude: tuple[str, ...] | None = None,
                     forget: tuple[tuple[str, int], ...] = ()) -> AsyncIterator[Any]:
        # ``route``, ``exclude`` and ``forget`` are for the request router (it reads the call's kwargs); the
        # replica has no use for them.
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
    """The HTTP entry: hashes the prompt (for the prefix policies), then lets the handle's router pick a replica.
    For kv-events it follows every replica's event stream (``router.events.follow``, into one ``StreamMirror``
    each, as `kvprefix route` does) and hands the router each replica's exact cached prefix with the request."""

    async def __init__(self, engine, policy: str, auth: Auth, num_replicas: int, admin_key: str | None = None):
        self.engine = engine
        self.auth = auth  # the tenant names the namespace to hash in; the replica checks the key again
        self.hashing = policy in HASHING_POLICIES
        self.hasher = None
        self.num_replicas = num_replicas
        self.admin_headers = [("authorization", f"Bearer {admin_key}")] if admin_key else []
        self.block_size = 0  # tokens per block, once the block identity is known (for the predicted metric)
        # The router's metrics (docs/router.md), by Ray replica id, each replica from the first time it answers or
        # its event stream says hello; in flight = calls this ingress sent there whose answer has not ended.
        self.replicas: dict[str, Replica] = {}
        self.view = FleetView([])
        self.metrics = RouterMetrics(self.view)
        self.followed: list[Replica] = []
        self._claimed: dict[int, str] = {}  # follower -> the replica id its event stream comes from
        self._resets: dict[str, int] = {}  # replica id -> resets through the fan-out, for the router to forget
        self._followers: list[asyncio.Task] = []
        if policy == "kv-events":
            self.followed = [Replica(f"events-{k}") for k in range(num_replicas)]
            self._followers = [asyncio.create_task(follow(self._event_lines(k), rep, self._resynced(k)))
                               for k, rep in enumerate(self.followed)]

    def _resynced(self, follower: int):
        def count(_: Replica) -> None:
            replica_id = self._claimed.get(follower)
            if replica_id is not None:
                self.metrics.series[replica_id].resyncs.inc()
        return count

    def _event_lines(self, follower: int) -> Lines:
        """The event stream of a replica no other follower follows, through the engine handle (Ray has no port of
        its own per replica): the stream's lines, as ``follow`` reads them over HTTP from a `kvprefix serve`.

        Which replica is whatever Ray's router picks outside the others' (``exclude``), not a position: a stream
        opened while Ray knew one replica could otherwise hold the other follower's replica for ever (and leave a
        replica unfollowed, its credit never given). A follower that got a replica already followed (Ray knew no
        other yet) gives it up and tries again."""
        async def lines(params: dict[str, str]) -> AsyncIterator[bytes]:
            others = tuple(r for k, r in self._claimed.items() if k != follower)
            stream = self.engine.options(stream=True).handle.remote(
                "GET", "/v1/kv_events", urlencode(params).encode(), self.admin_headers, b"", route=None,
                exclude=others)
            status, _ = await stream.__anext__()
            if status != 200:
                raise ValueError(f"GET /v1/kv_events answered {status}")
            pending, claimed = b"", False
            try:
                async for chunk in stream:
                    *complete, pending = (pending + chunk).split(b"\n")
                    for line in complete:
                        if line and not claimed:  # the hello names the replica
                            replica_id = loads(line).replica_id
                            if replica_id in self._claimed.values():
                                raise ValueError(f"replica {replica_id} is followed already")
                            self._claimed[follower], claimed = replica_id, True
                            rep = self._replica(replica_id)
                            rep.healthy, rep.mirror = True, self.followed[follower].mirror
                        yield line
            finally:
                if claimed:
                    del self._claimed[follower]
                    self.replicas[replica_id].healthy = False  # until it answers again (Ray replaces a dead one)
                stream.cancel()  # the replica stops streaming to nobody

        return lines

    def _cached_by_replica(self, block_hashes: Sequence[Hashable]) -> dict[str, int]:
        """Each synced replica's exact cached prefix of the request, by replica id (as its hello named it)."""
        out = {}
        for rep in self.followed:
            mirror = rep.mirror
            if mirror is None or not mirror.ready or mirror.replica_id is None:
                continue
            out[mirror.replica_id] = mirror.index.cached_prefix_blocks(block_hashes)
        return out

    async def _hasher(self):
        if self.hasher is None:
            from kvprefix.router.hashing import RequestHasher

            tokenizer, identity, max_model_len = await self.engine.block_identity.remote()
            self.hasher = RequestHasher(tokenizer, identity.hasher(), max_model_len)
            self.block_size = identity.block_size
        return self.hasher

    def _replica(self, replica_id: str) -> Replica:
        rep = self.replicas.get(replica_id)
        if rep is None:
            rep = self.replicas[replica_id] = Replica(replica_id)
            self.view.replicas.append(rep)
            self.metrics.add_replica(rep)
        return rep

    async def _send(self, raw, route: RouteRequest | None, body: bytes):
        """Relays the call through the handle (its router picks the replica) and counts it in the metrics: a
        client request (``route``) by the router's decision, every answer's in-flight time and cached tokens."""
        headers = [(k, raw.headers[k]) for k in FORWARD_HEADERS if k in raw.headers]
        stream = self.engine.options(stream=True).handle.remote(raw.method, raw.url.path, raw.url.query.encode(),
                                                                headers, body, route=route,
                                                                forget=tuple(self._resets.items()))
        status, response_headers = await stream.__anext__()
        rep = self._replica(dict(response_headers).get(REPLICA_HEADER, "unknown"))
        rep.healthy = True
        if route is not None and route.decision is not None:
            reason, credited, refused = route.decision
            series = self.metrics.series[rep.name]
            series.requests[reason].inc()
            series.predicted_cached.inc(credited * self.block_size)
            for other in refused:
                self.metrics.series[self._replica(other).name].retries.inc()
        drop = {"content-length", "transfer-encoding"}
        return StreamingResponse(self._counted(stream, rep), status_code=status,
                                 headers={k: v for k, v in response_headers if k.lower() not in drop})

    async def _counted(self, stream, rep: Replica) -> AsyncIterator[bytes]:
        """The answer's chunks, in flight until its end; its ``cached_tokens`` into the reported metric."""
        routed, tail, ended = rep.outstanding.add((), 0), b"", False
        try:
            async for chunk in stream:
                tail = (tail + chunk)[-TAIL_BYTES:]
                yield chunk
            ended = True
            reported = reported_cached_tokens(tail)
            if reported is not None:
                self.metrics.series[rep.name].reported_cached.inc(reported)
        finally:
            routed.finish()
            if not ended:
                stream.cancel()  # the client left mid-answer: the replica stops

    @_app.post("/v1/completions")
    @_app.post("/v1/chat/completions")
    async def generate(self, raw: Request):
        tenant = self.auth.tenant(raw.headers.get("authorization"))
        body = await read_body(raw)
        hasher = await self._hasher() if self.hashing else None
        route = route_request(body, raw.headers, tenant, hasher)
        if self.followed and route.block_hashes:
            route = dataclasses.replace(route, replica_cached=self._cached_by_replica(route.block_hashes))
        return await self._send(raw, route, body)

    @_app.get("/v1/models")
    @_app.get("/v1/models/{model_id:path}")
    async def relay(self, raw: Request):
        return await self._send(raw, RouteRequest([], None), b"")  # its own: the router writes its decision

    @_app.get("/metrics")
    async def metrics_endpoint(self, raw: Request):
        """The router's metrics, as `kvprefix route` serves them (admin rule); replicas named by Ray replica id."""
        self.auth.check_admin(raw.headers.get("authorization"))
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @_app.get("/health")
    async def health(self, raw: Request):
        return await self._send(raw, None, b"")  # any replica: a probe must not move the policy's rotation

    @_app.post("/reset_prefix_cache")
    @_app.post("/flush_cache")
    async def fan_out(self, raw: Request):
        """Every replica's answer to the same admin call, as `kvprefix route` gives it."""
        self.auth.check_admin(raw.headers.get("authorization"))
        headers = [(k, raw.headers[k]) for k in FORWARD_HEADERS if k in raw.headers] or self.admin_headers

        reached: list[str] = []

        async def one() -> dict:
            try:
                stream = self.engine.options(stream=True).handle.remote(
                    "POST", raw.url.path, raw.url.query.encode(), headers, b"", route=None, exclude=tuple(reached))
                status, response_headers = await stream.__anext__()
                text = b"".join([chunk async for chunk in stream])
            except Exception as exc:  # the replica died under the call
                return {"replica": None, "status": None, "error": str(exc) or type(exc).__name__}
            replica = dict(response_headers).get(REPLICA_HEADER, "")
            if replica in reached:  # Ray knows fewer replicas than the deployment should have
                return {"replica": replica, "status": None, "error": "reached twice: a replica is not running"}
            reached.append(replica)
            if status == 200:  # it holds nothing the router remembers sending (as `kvprefix route` forgets)
                self._resets[replica] = self._resets.get(replica, 0) + 1
            return replica_result(replica, status, text)

        # One after another, each to a replica not reached yet (two pinned calls pending at once hung in Ray
        # 2.60's request router on the test's local cluster).
        return fan_out_response([await one() for _ in range(self.num_replicas)])


def build_app(engine_args: dict[str, Any], num_replicas: int, policy: str, seed: int = 0, load_cap: float = 1.25,
              config: "ServerConfig | None" = None, num_cpus: float = 1.0, num_gpus: float = 0.0,
              admin_key: str | None = None):
    """The Ray Serve application: ``num_replicas`` engine replicas routed by ``policy``, each a `kvprefix serve`
    with ``config`` (its replica_id replaced by Ray's). ``admin_key``: the replicas' admin key, with which the
    ingress reads their KV events (kv-events) when they have keys."""
    if config is None:
        from kvprefix.server.app import ServerConfig

        config = ServerConfig()
    policy = make_policy(policy, seed, load_cap).name  # an unknown name fails here, not in a replica
    router = RequestRouterConfig(request_router_class=PolicyRequestRouter,
                                 request_router_kwargs={"policy": policy, "seed": seed, "load_cap": load_cap})
    engine = Engine.options(num_replicas=num_replicas, request_router_config=router, max_ongoing_requests=256,
                            ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus}).bind(engine_args, config)
    return Ingress.options(ray_actor_options={"num_cpus": 0}).bind(engine, policy, config.auth or Auth(), num_replicas,
                                                                   admin_key)


def run_on_ray(args: argparse.Namespace, engine_args: dict[str, Any], config: "ServerConfig") -> int:
    """`kvprefix serve --ray`: deploys on the cluster at ``--ray-address`` (default: a new local one) and serves
    until interrupted."""
    import ray

    try:
        application = build_app(engine_args, args.replicas, args.policy, args.seed, args.load_cap, config,
                                num_cpus=args.replica_cpus, num_gpus=1.0 if args.device == "cuda" else 0.0,
                                admin_key=args.admin_key)
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
