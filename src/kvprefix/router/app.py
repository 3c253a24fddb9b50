"""`kvprefix route`: an OpenAI-compatible proxy in front of `kvprefix serve` replicas, choosing one replica per
request with a ``router.policies`` policy (docs/router.md).

Bytes pass through unchanged and unbuffered (streams included), so ``usage.prompt_tokens_details.cached_tokens``
is the replica's own. A request that fails before the replica answered is retried on another replica; a replica
that fails a health check leaves the rotation until it passes one. Callers authenticate with the same keys and
tenants as `kvprefix serve` (``tenancy.Auth``), and their Authorization travels on to the replica, which checks
it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvprefix.http.admin import fan_out_response, replica_error, replica_result
from kvprefix.http.bodies import receive_body
from kvprefix.http.browsers import BrowserGuard
from kvprefix.http.errors import APIError, install_error_handlers
from kvprefix.http.forwarding import forwarded
from kvprefix.http.metrics import metrics_response
from kvprefix.http.tenancy import Auth
from kvprefix.router.adapters import AdapterFingerprints
from kvprefix.router.events import follow, http_lines, read_hello
from kvprefix.router.fleet import FleetView, Replica
from kvprefix.router.hashing import RequestHasher, RouteRequest, route_request
from kvprefix.router.ledger import Ledger
from kvprefix.router.metrics import RouterMetrics
from kvprefix.router.policies import make_policy
from kvprefix.router.relay import Relay
from kvprefix.router.upstream import Pool
from kvprefix.tokenizer.chat_template import ChatTemplate

log = logging.getLogger("kvprefix.router")

HASHING_POLICIES = ("prefix", "kv-events")  # the policies that need the request's block hashes
READ_HEADERS = frozenset({b"authorization", b"content-length", b"x-session-id"})  # of a relayed request
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
NO_ROUTE = RouteRequest((), None)


@dataclass
class RouterConfig:
    replicas: list[str]
    policy: str = "kv-events"
    model: str | None = None  # the replicas' checkpoint, where the one their identity names is not here
    chat_template: ChatTemplate | None = None  # the replicas' --chat-template options, where they give any
    auth: Auth | None = None
    admin_key: str | None = None  # sent to replicas for KV events and admin fan-out when the caller sends none
    load_cap: float = 1.25
    seed: int = 0
    health_interval_s: float = 1.0
    connect_timeout_s: float = 3.0
    startup_timeout_s: float = 60.0
    allowed_hosts: frozenset[str] | None = None
    hasher: RequestHasher | None = None  # loaded already (`kvprefix route` does, to fail in one line)


async def load_request_hasher(client: httpx.AsyncClient, config: RouterConfig,
                              admin_headers: dict[str, str]) -> RequestHasher:
    """The replicas' hasher, from the identity in their KV event hellos (``RequestHasher.for_replica``); waits up
    to ``startup_timeout_s`` for a first replica. ValueError naming the replica that this router cannot reproduce,
    or that hashes unlike the first."""
    deadline = anyio.current_time() + config.startup_timeout_s
    while True:
        hellos = []
        for url in config.replicas:
            try:
                hellos.append((url, await read_hello(client, url.rstrip("/"), admin_headers)))
            except (httpx.HTTPError, ValueError):
                continue
        if hellos:
            (first, hello), *others = hellos
            hasher = await asyncio.to_thread(RequestHasher.for_replica, hello, config.model, first,
                                             config.chat_template)
            for url, other in others:
                if other.root != hello.root:
                    differs = ("; ".join(other.identity.differences(hello.identity))
                               if other.identity and hello.identity else "another root")
                    raise ValueError(f"replica {url} does not hash like replica {first}: {differs}")
            return hasher
        if anyio.current_time() > deadline:
            raise RuntimeError("no replica answered GET /v1/kv_events: cannot learn their block hashing")
        await asyncio.sleep(0.5)


def create_app(config: RouterConfig) -> BrowserGuard:
    router = Router(config)
    app = FastAPI(title="kvprefix router", version="0.1.0", lifespan=router.lifespan)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if not router.view.usable():
            return APIError(503, "no replica is healthy", type="server_error").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_endpoint(raw: Request) -> Response:
        return metrics_response(router.auth, raw, router.metrics.render)

    app.post("/reset_prefix_cache")(router.fan_out)
    app.post("/flush_cache")(router.fan_out)
    return BrowserGuard(RouterApp(app, router.relayed), allowed_hosts=config.allowed_hosts)


class Router:
    """The router's state and what it does with the replicas: health checks, learning their block identity,
    following their event streams (kv-events), the admin fan-out, and the relayed requests (``Relay``)."""

    def __init__(self, config: RouterConfig):
        if not config.replicas:
            raise ValueError("give at least one --replica URL")
        policy = make_policy(config.policy, config.seed, config.load_cap)
        self.config = config
        self.auth = config.auth or Auth()
        self.replicas = [Replica(url.rstrip("/")) for url in config.replicas]
        self.pools = [Pool(rep.name, config.connect_timeout_s) for rep in self.replicas]
        self.view = FleetView(self.replicas)
        self.metrics = RouterMetrics(self.view)
        self.ledger = Ledger(policy)
        self.relay = Relay(self.ledger, self.view, self.pools, self.metrics)
        self.admin_headers = {"authorization": f"Bearer {config.admin_key}"} if config.admin_key else {}
        self.client: httpx.AsyncClient | None = None
        self.hasher: RequestHasher | None = None
        self.adapters = AdapterFingerprints()
        self._parse = policy.name in (*HASHING_POLICIES, "session")  # the others route without reading the body

    async def check(self, i: int) -> None:
        rep = self.replicas[i]
        try:
            answer = await self.client.get(rep.name + "/health", timeout=self.config.connect_timeout_s)
            ok = answer.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok and not rep.healthy:
            self.ledger.forget(i)  # back from the dead (a restart, perhaps): it holds nothing we remember sending
            if self.ledger.policy.name == "prefix":  # its tiers, with their sizes and load costs, from its hello
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    hello = await read_hello(self.client, rep.name, self.admin_headers)
                    rep.media_info = {m.name: m for m in hello.media}
        if ok != rep.healthy:
            log.warning("replica %s is %s", rep.name, "up" if ok else "down")
        rep.healthy = ok

    async def health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.check(i) for i in range(len(self.replicas))))
            if self.hasher is not None:  # the adapters the replicas serve now, for hashing in their namespaces
                await self.adapters.refresh(self.client, [r.name for r in self.replicas if r.healthy],
                                            self.admin_headers, self.config.connect_timeout_s)
            await asyncio.sleep(self.config.health_interval_s)

    def check_hello(self, rep: Replica):
        """A replica's later hello (it restarted): logged when it no longer hashes like the router."""
        def check(hello) -> None:
            if self.hasher is not None and hello.root != self.hasher.hasher.root:
                log.error("replica %s no longer hashes like the router (root %s...): none of its blocks will match "
                          "until the router restarts", rep.name, hello.root.hex()[:16])
        return check

    def _followers(self) -> list[asyncio.Task]:
        series = self.metrics.series
        return [asyncio.create_task(follow(http_lines(self.client, rep.name, self.admin_headers), rep,
                                           lambda r: series[r.name].resyncs.inc(), on_hello=self.check_hello(rep)))
                for rep in self.replicas]

    @asynccontextmanager
    async def lifespan(self, _: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=self.config.connect_timeout_s),
                                        limits=limits)
        tasks = [asyncio.create_task(self.health_loop())]
        try:
            if self.ledger.policy.name in HASHING_POLICIES:
                self.hasher = self.config.hasher or await load_request_hasher(self.client, self.config,
                                                                              self.admin_headers)
                self.relay.block_size = self.hasher.hasher.block_size
                self.hasher.adapters = self.adapters
            # What exists now (the tokenizer, the app) lives as long as the router: the collector's full passes
            # no longer walk it (as vLLM does after loading a model).
            gc.freeze()
            if self.ledger.policy.name == "kv-events":
                tasks += self._followers()
            yield
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            await self.client.aclose()
            for pool in self.pools:
                pool.close()

    async def fan_out(self, raw: Request) -> JSONResponse:
        """Every replica's answer to the same admin call, side by side; success only if all succeeded."""
        self.auth.check_admin(raw.headers.get("authorization"))
        headers = dict(forwarded(raw.headers)) if "authorization" in raw.headers else self.admin_headers

        async def one(i: int) -> dict:
            rep = self.replicas[i]
            try:
                r = await self.client.post(rep.name + raw.url.path, params=raw.query_params, headers=headers)
            except httpx.HTTPError as exc:
                return replica_error(rep.name, exc)
            if r.status_code == 200:
                self.ledger.forget(i)
            return replica_result(rep.name, r.status_code, r.content)

        return fan_out_response(await asyncio.gather(*(one(i) for i in range(len(self.replicas)))))

    async def relayed(self, scope, receive, send) -> None:
        """A request for a replica: read what the policy needs, then relay it (``Relay``)."""
        try:
            if scope["method"] == "POST":
                headers = request_headers(scope)
                tenant = self.auth.tenant(headers.get("authorization"))
                body = await receive_body(receive, headers.get("content-length", ""))
                route = route_request(body, headers, tenant, self.hasher) if self._parse else NO_ROUTE
            else:
                body, route = b"", NO_ROUTE
            await self.relay(scope, receive, send, route, body)
        except APIError as exc:
            await exc.response()(scope, receive, send)


def request_headers(scope) -> dict[str, str]:
    """The request headers the relay reads (the first of each, as Starlette's ``Headers.get`` gives it), without
    building a ``Request``: that and its body stream cost more than the rest of reading a request."""
    out: dict[str, str] = {}
    for name, value in scope["headers"]:
        if name in READ_HEADERS:
            out.setdefault(name.decode(), value.decode("latin-1"))
    return out


class RouterApp:
    """The relayed endpoints as raw ASGI (the hot path: no routing table, no response objects); the rest (health,
    metrics, the admin fan-out, the lifespan that starts the health checks and event streams) is FastAPI."""

    def __init__(self, app: FastAPI, relayed):
        self.app = app
        self.relayed = relayed

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (
            (scope["method"] == "POST" and scope["path"] in GENERATE_PATHS)
            or (scope["method"] == "GET" and (scope["path"] == "/v1/models" or scope["path"].startswith("/v1/models/")))
        ):
            await self.relayed(scope, receive, send)
        else:
            await self.app(scope, receive, send)
