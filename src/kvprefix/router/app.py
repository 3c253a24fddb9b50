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

from kvprefix.http.bodies import receive_body
from kvprefix.http.browsers import BrowserGuard
from kvprefix.http.errors import APIError, install_error_handlers
from kvprefix.http.tenancy import Auth
from kvprefix.router.admin import fan_out_response, replica_result
from kvprefix.router.events import follow, http_lines, read_hello
from kvprefix.router.fleet import FleetView, Replica
from kvprefix.router.hashing import RequestHasher, RouteRequest, route_request
from kvprefix.router.metrics import RouterMetrics
from kvprefix.router.policies import make_policy
from kvprefix.router.relay import Relay
from kvprefix.router.upstream import Pool

log = logging.getLogger("kvprefix.router")

HASHING_POLICIES = ("prefix", "kv-events")  # the policies that need the request's block hashes
FORWARD_HEADERS = ("authorization", "content-type", "accept")  # of an admin call fanned out to the replicas
READ_HEADERS = frozenset({b"authorization", b"content-length", b"x-session-id"})  # of a relayed request
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
NO_ROUTE = RouteRequest([], None)


@dataclass
class RouterConfig:
    replicas: list[str]
    policy: str = "round-robin"
    model: str | None = None  # the replicas' checkpoint, where the one their identity names is not here
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
            hasher = await asyncio.to_thread(RequestHasher.for_replica, hello, config.model, first)
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
    if not config.replicas:
        raise ValueError("give at least one --replica URL")
    policy = make_policy(config.policy, config.seed, config.load_cap)
    auth = config.auth or Auth()
    replicas = [Replica(url.rstrip("/")) for url in config.replicas]
    pools = [Pool(rep.url, config.connect_timeout_s) for rep in replicas]
    view = FleetView(replicas)
    metrics = RouterMetrics(view)
    routed = getattr(policy, "routed", None)  # the prefix policy's own memory of where blocks went
    admin_headers = {"authorization": f"Bearer {config.admin_key}"} if config.admin_key else {}
    state: dict = {"hasher": None}

    def client() -> httpx.AsyncClient:
        return state["client"]

    async def check(i: int) -> None:
        rep = replicas[i]
        try:
            ok = (await client().get(rep.url + "/health", timeout=config.connect_timeout_s)).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok and not rep.healthy and routed is not None:
            routed.forget(i)  # back from the dead (a restart, perhaps): it holds nothing we remember sending
        if ok != rep.healthy:
            log.warning("replica %s is %s", rep.url, "up" if ok else "down")
        rep.healthy = ok

    async def health_loop() -> None:
        while True:
            await asyncio.gather(*(check(i) for i in range(len(replicas))))
            await asyncio.sleep(config.health_interval_s)

    def check_hello(rep: Replica):
        def check(hello) -> None:
            if state["hasher"] is not None and hello.root != state["hasher"].hasher.root:
                log.error("replica %s no longer hashes like the router (root %s...): none of its blocks will match "
                          "until the router restarts", rep.url, hello.root.hex()[:16])
        return check

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=config.connect_timeout_s),
                                            limits=limits)
        tasks = [asyncio.create_task(health_loop())]
        try:
            if policy.name in HASHING_POLICIES:
                state["hasher"] = config.hasher or await load_request_hasher(client(), config, admin_headers)
            # What exists now (the tokenizer, the app) lives as long as the router: the collector's full passes
            # no longer walk it (as vLLM does after loading a model).
            gc.freeze()
            if policy.name == "kv-events":
                tasks += [asyncio.create_task(follow(http_lines(client(), rep.url, admin_headers), rep,
                                                     lambda r: metrics.series[r.name].resyncs.inc(),
                                                     on_hello=check_hello(rep)))
                          for rep in replicas]
            yield
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            await state["client"].aclose()
            for pool in pools:
                pool.close()

    app = FastAPI(title="kvprefix router", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)

    def forward_headers(raw: Request) -> dict[str, str]:
        return {k: raw.headers[k] for k in FORWARD_HEADERS if k in raw.headers}

    @app.get("/health")
    async def health() -> Response:
        if not view.usable():
            return APIError(503, "no replica is healthy", type="server_error").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_endpoint(raw: Request) -> Response:
        auth.check_admin(raw.headers.get("authorization"))
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def fan_out(raw: Request) -> JSONResponse:
        """Every replica's answer to the same admin call, side by side; success only if all succeeded."""
        auth.check_admin(raw.headers.get("authorization"))
        headers = forward_headers(raw) if "authorization" in raw.headers else admin_headers

        async def one(i: int) -> dict:
            rep = replicas[i]
            try:
                r = await client().post(rep.url + raw.url.path, params=raw.query_params, headers=headers)
            except httpx.HTTPError as exc:
                return {"replica": rep.url, "status": None, "error": str(exc) or type(exc).__name__}
            if r.status_code == 200 and routed is not None:
                routed.forget(i)
            return replica_result(rep.url, r.status_code, r.content)

        return fan_out_response(await asyncio.gather(*(one(i) for i in range(len(replicas)))))

    app.post("/reset_prefix_cache")(fan_out)
    app.post("/flush_cache")(fan_out)
    relay = Relay(policy, view, pools, metrics)
    parse = policy.name in (*HASHING_POLICIES, "session")  # the others route without reading the body

    async def relayed(scope, receive, send) -> None:
        try:
            if scope["method"] == "POST":
                headers = request_headers(scope)
                tenant = auth.tenant(headers.get("authorization"))
                body = await receive_body(receive, headers.get("content-length", ""))
                hasher = state["hasher"]
                relay.block_size = hasher.hasher.block_size if hasher is not None else 0
                route = route_request(body, headers, tenant, hasher) if parse else NO_ROUTE
            else:
                body, route = b"", NO_ROUTE
            await relay(scope, receive, send, route, body)
        except APIError as exc:
            await exc.response()(scope, receive, send)

    return BrowserGuard(RouterApp(app, relayed, view), allowed_hosts=config.allowed_hosts)


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

    def __init__(self, app: FastAPI, relayed, view: FleetView):
        self.app = app
        self.relayed = relayed
        self.view = view

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (
            (scope["method"] == "POST" and scope["path"] in GENERATE_PATHS)
            or (scope["method"] == "GET" and (scope["path"] == "/v1/models" or scope["path"].startswith("/v1/models/")))
        ):
            await self.relayed(scope, receive, send)
        else:
            await self.app(scope, receive, send)
