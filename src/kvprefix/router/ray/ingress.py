"""The HTTP entry of the Ray Serve app: reads and hashes a request like `kvprefix route`, then lets the engine
handle's request router (``routing.PolicyRequestRouter``) place it. No ``from __future__ import annotations``:
FastAPI must see the endpoints' ``Request`` annotations through Ray's ingress wrapper."""

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Hashable, Sequence
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve

from kvprefix.cache.event_wire import loads
from kvprefix.cache.media import DISK, POOL, SHARED
from kvprefix.http.admin import fan_out_response, replica_error, replica_result
from kvprefix.http.bodies import read_body
from kvprefix.http.errors import install_error_handlers
from kvprefix.http.forwarding import forwarded
from kvprefix.http.metrics import metrics_response
from kvprefix.http.tenancy import Auth
from kvprefix.router.app import HASHING_POLICIES
from kvprefix.router.events import Lines, follow
from kvprefix.router.fleet import FleetView, Replica
from kvprefix.router.hashing import RequestHasher, RouteRequest, route_request
from kvprefix.router.metrics import TAIL_BYTES, RouterMetrics, reported_cached_tokens
from kvprefix.router.policies import make_policy
from kvprefix.router.ray.engine import REPLICA_HEADER
from kvprefix.router.ray.routing import RayRouting

_app = FastAPI(title="kvprefix on Ray Serve")
install_error_handlers(_app)


@serve.deployment
@serve.ingress(_app)
class Ingress:
    """Hashes the prompt (for the prefix policies), then calls the engine deployment, whose request router asks
    this ingress's ``routing``. For kv-events it follows every replica's event stream (``router.events.follow``,
    into one ``StreamMirror`` each, as `kvprefix route` does) and hands over, with each request, the request's
    blocks each replica holds."""

    async def __init__(self, engine, policy: str, seed: int, load_cap: float, auth: Auth, num_replicas: int,
                       admin_key: str | None = None):
        self.engine = engine
        self.auth = auth  # the tenant names the namespace to hash in; the replica checks the key again
        self.hashing = policy in HASHING_POLICIES
        self.hasher: RequestHasher | None = None
        self.num_replicas = num_replicas
        self.admin_headers = [("authorization", f"Bearer {admin_key}")] if admin_key else []
        # The router's metrics (docs/router.md), by Ray replica id, each replica from the first time it is placed,
        # answers or its event stream says hello. Ray's request router runs on a loop of its own: one lock.
        self.replicas: dict[str, Replica] = {}
        self.media: dict = {}  # where the replicas hold blocks, from the first one asked (for `prefix`)
        self._lock = threading.Lock()
        self.view = FleetView([])
        self.metrics = RouterMetrics(self.view)
        self.routing = RayRouting(make_policy(policy, seed, load_cap), self.metrics, self._replica)
        self.followed: list[Replica] = []
        self._claimed: dict[int, str] = {}  # follower -> the replica id its event stream comes from
        self._resets: dict[str, int] = {}  # replica id -> resets through the fan-out, for the router to forget
        self._followers: list[asyncio.Task] = []
        if policy == "kv-events":
            self.followed = [Replica(f"events-{k}") for k in range(num_replicas)]
            self._followers = [asyncio.create_task(follow(self._event_lines(k), rep, self._resynced(k)))
                               for k, rep in enumerate(self.followed)]

    async def __del__(self):
        """Serve stops the ingress before the engines: its event streams end here, or each engine replica would
        count its stream as a request in flight and wait out its graceful shutdown timeout before stopping."""
        for task in self._followers:
            task.cancel()
        await asyncio.gather(*self._followers, return_exceptions=True)

    def _replica(self, replica_id: str) -> Replica:
        with self._lock:
            rep = self.replicas.get(replica_id)
            if rep is None:
                rep = self.replicas[replica_id] = Replica(replica_id, media_info=self.media)
                self.view.replicas.append(rep)
                self.view.num_replicas += 1
                self.metrics.add_replica(rep)
            return rep

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

    def _held_by_replica(self, block_hashes: Sequence[Hashable]) -> dict[str, dict[str, frozenset[Hashable]]]:
        """The request's blocks each synced replica holds, by replica id (as its hello named it) and medium: in its
        pool, on its disk, and in the shared tier it reads (what any replica reading that store announced: the
        same union as ``FleetView.shared_held``)."""
        synced = [rep for rep in self.followed
                  if rep.mirror is not None and rep.mirror.ready and rep.mirror.replica_id is not None]
        view = FleetView(synced)
        out = {}
        for rep in synced:
            mirror = rep.mirror
            held = {POOL: mirror.index, DISK: mirror.blocks.of(DISK)}
            if SHARED in mirror.media:
                held[SHARED] = view.shared_held(rep, mirror.media[SHARED].store)
            out[mirror.replica_id] = {medium: frozenset(h for h in block_hashes if h in blocks)
                                      for medium, blocks in held.items() if medium == POOL or medium in mirror.media}
        return out

    async def _hasher(self) -> RequestHasher:
        if self.hasher is None:
            tokenizer, identity, max_model_len, media = await self.engine.block_identity.remote()
            self.hasher = RequestHasher(tokenizer, identity.hasher(), max_model_len)
            self.routing.block_size = identity.block_size
            with self._lock:  # the replicas are configured alike: one replica's tiers stand for every one's
                self.media = {m.name: m for m in media}
                for rep in self.replicas.values():
                    rep.media_info = self.media
        return self.hasher

    async def _send(self, raw: Request, route: RouteRequest | None, body: bytes) -> StreamingResponse:
        """Relays the call through the handle (its router places a client request, ``route``, and counts it)."""
        stream = self.engine.options(stream=True).handle.remote(raw.method, raw.url.path, raw.url.query.encode(),
                                                                forwarded(raw.headers), body, route=route,
                                                                forget=tuple(self._resets.items()))
        status, response_headers = await stream.__anext__()
        rep = self._replica(dict(response_headers).get(REPLICA_HEADER, "unknown"))
        rep.healthy = True
        drop = {"content-length", "transfer-encoding"}
        return StreamingResponse(self._counted(stream, rep), status_code=status,
                                 headers={k: v for k, v in response_headers if k.lower() not in drop})

    async def _counted(self, stream, rep: Replica) -> AsyncIterator[bytes]:
        """The answer's chunks; its ``cached_tokens`` into the reported metric."""
        tail, ended = b"", False
        try:
            async for chunk in stream:
                tail = (tail + chunk)[-TAIL_BYTES:]
                yield chunk
            ended = True
            reported = reported_cached_tokens(tail)
            if reported is not None:
                self.metrics.series[rep.name].reported_cached.inc(reported)
        finally:
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
            route = dataclasses.replace(route, held=self._held_by_replica(route.block_hashes))
        return await self._send(raw, route, body)

    @_app.get("/v1/models")
    @_app.get("/v1/models/{model_id:path}")
    async def relay(self, raw: Request):
        return await self._send(raw, RouteRequest((), None), b"")

    @_app.get("/metrics")
    async def metrics_endpoint(self, raw: Request):
        """The router's metrics, as `kvprefix route` serves them (admin rule); replicas named by Ray replica id."""
        return metrics_response(self.auth, raw, self.metrics.render)

    @_app.get("/health")
    async def health(self, raw: Request):
        return await self._send(raw, None, b"")  # any replica: a probe must not move the policy's rotation

    @_app.post("/reset_prefix_cache")
    @_app.post("/flush_cache")
    async def fan_out(self, raw: Request):
        """Every replica's answer to the same admin call, as `kvprefix route` gives it."""
        self.auth.check_admin(raw.headers.get("authorization"))
        headers = forwarded(raw.headers) or self.admin_headers
        reached: list[str] = []

        async def one() -> dict:
            try:
                stream = self.engine.options(stream=True).handle.remote(
                    "POST", raw.url.path, raw.url.query.encode(), headers, b"", route=None, exclude=tuple(reached))
                status, response_headers = await stream.__anext__()
                text = b"".join([chunk async for chunk in stream])
            except Exception as exc:  # the replica died under the call
                return replica_error(None, exc)
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
