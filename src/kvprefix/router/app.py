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
import logging
import re
from collections.abc import AsyncIterator, Hashable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvprefix.router.events import follow, read_hello
from kvprefix.router.fleet import FleetView, Replica
from kvprefix.router.hashing import RequestHasher, RouteRequest, route_request
from kvprefix.router.metrics import RouterMetrics
from kvprefix.router.policies import make_policy
from kvprefix.server.bodies import read_body
from kvprefix.server.browsers import BrowserGuard
from kvprefix.server.errors import APIError, install_error_handlers
from kvprefix.server.tenancy import Auth

log = logging.getLogger("kvprefix.router")

HASHING_POLICIES = ("prefix", "kv-events")  # the policies that need the request's block hashes
FORWARD_HEADERS = ("authorization", "content-type", "accept")
DROP_RESPONSE_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_TAIL_BYTES = 4096  # usage comes last in a body or stream: enough of the end to find it


@dataclass
class RouterConfig:
    replicas: list[str]
    policy: str = "round-robin"
    model: str | None = None  # checkpoint (tokenizer) of the replicas: needed by the hashing policies
    auth: Auth | None = None
    admin_key: str | None = None  # sent to replicas for KV events and admin fan-out when the caller sends none
    load_cap: float = 1.25
    seed: int = 0
    health_interval_s: float = 1.0
    connect_timeout_s: float = 3.0
    startup_timeout_s: float = 60.0
    allowed_hosts: frozenset[str] | None = None


@dataclass
class _Relay:
    """One upstream response on its way to the client; its bookkeeping is settled exactly once, however the
    response ends (finished, replica gone, client gone), and ``close`` releases the upstream connection."""

    upstream: httpx.Response
    replica: Replica
    block_hashes: Sequence[Hashable]
    metrics: RouterMetrics
    tail: bytes = b""
    closed: bool = field(default=False)

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.upstream.aiter_raw():
                self.tail = (self.tail + chunk)[-_TAIL_BYTES:]
                yield chunk
        except httpx.HTTPError as exc:  # the replica went away mid-stream: nothing to retry once bytes went out
            log.warning("stream from %s cut off: %s", self.replica.url, exc)
        # Settled before the response's end goes out: a client that sends its next request as soon as it has this
        # one must find the replica's load already released.
        self.settle()

    def settle(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.replica.in_flight -= 1
        self.replica.pending.drop(self.block_hashes)
        found = _CACHED_TOKENS.findall(self.tail)
        if found:
            self.metrics.reported_cached.labels(self.replica.name).inc(int(found[-1]))

    async def close(self) -> None:
        self.settle()
        with anyio.CancelScope(shield=True):  # runs even when the client's disconnect cancelled the response
            await self.upstream.aclose()


class _RelayResponse(StreamingResponse):
    def __init__(self, relay: _Relay):
        headers = {k: v for k, v in relay.upstream.headers.items() if k.lower() not in DROP_RESPONSE_HEADERS}
        headers["x-kvprefix-replica"] = relay.replica.url
        super().__init__(relay.chunks(), status_code=relay.upstream.status_code, headers=headers)
        self.relay = relay

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.close()


def create_app(config: RouterConfig) -> FastAPI:
    if not config.replicas:
        raise ValueError("give at least one --replica URL")
    policy = make_policy(config.policy, config.seed, config.load_cap)
    if policy.name in HASHING_POLICIES and config.model is None:
        raise ValueError(f"--policy {policy.name} hashes prompts like the replicas: give --model, the replicas' "
                         f"checkpoint directory")
    auth = config.auth or Auth()
    replicas = [Replica(url.rstrip("/")) for url in config.replicas]
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

    async def load_hasher() -> RequestHasher:
        deadline = anyio.current_time() + config.startup_timeout_s
        while True:
            for rep in replicas:
                try:
                    hello = await read_hello(client(), rep.url, admin_headers)
                except (httpx.HTTPError, ValueError):
                    continue
                return await asyncio.to_thread(RequestHasher.for_replica, config.model, hello)
            if anyio.current_time() > deadline:
                raise RuntimeError("no replica answered GET /v1/kv_events: cannot learn their block hashing")
            await asyncio.sleep(0.5)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=config.connect_timeout_s),
                                            limits=limits)
        tasks = [asyncio.create_task(health_loop())]
        try:
            if policy.name in HASHING_POLICIES:
                state["hasher"] = await load_hasher()
            if policy.name == "kv-events":
                tasks += [asyncio.create_task(follow(client(), rep, admin_headers,
                                                     lambda r: metrics.resyncs.labels(r.name).inc()))
                          for rep in replicas]
            yield
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            await state["client"].aclose()

    app = FastAPI(title="kvprefix router", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BrowserGuard, allowed_hosts=config.allowed_hosts)

    def forward_headers(raw: Request) -> dict[str, str]:
        return {k: raw.headers[k] for k in FORWARD_HEADERS if k in raw.headers}

    async def send(raw: Request, request: RouteRequest, body: bytes | None) -> Response:
        """Picks a replica and relays its answer; a failure before the answer began retries elsewhere."""
        current, attempt = view, 0
        credit = getattr(policy, "cached", None)
        while True:
            if not current.usable():
                metrics.unroutable.inc()
                raise APIError(503, "no replica can take the request now (all down or all failed it)",
                               type="server_error", code="no_replica")
            before = [credit(r, request, current) if credit else current.cached_prefix_blocks(r, request.block_hashes)
                      for r in range(len(replicas))] if request.block_hashes else None
            i = policy.choose(request, current)
            rep = replicas[i]
            rep.in_flight += 1
            rep.pending.add(request.block_hashes)
            upstream_req = client().build_request(raw.method, rep.url + raw.url.path, params=raw.query_params,
                                                  content=body, headers=forward_headers(raw))
            try:
                upstream = await client().send(upstream_req, stream=True)
            except httpx.TransportError as exc:
                log.warning("replica %s failed before answering: %s; retrying elsewhere", rep.url, exc)
                rep.healthy = False
                upstream = None
            relay = _Relay(upstream, rep, request.block_hashes, metrics) if upstream is not None else None
            again = current.excluding(i)
            if upstream is None or (upstream.status_code == 503 and again.usable()):
                if relay is not None:
                    await relay.close()  # overloaded or shutting down: another replica may take it
                else:
                    rep.in_flight -= 1
                    rep.pending.drop(request.block_hashes)
                metrics.retries.labels(rep.name).inc()
                current, attempt = again, attempt + 1
                continue
            predicted = before[i] if before else 0
            reason = ("retry" if attempt else "cached_prefix" if predicted else
                      "session" if request.session is not None and policy.name == "session" else "no_prefix")
            metrics.requests.labels(rep.name, reason).inc()
            if predicted:
                metrics.predicted_cached.labels(rep.name).inc(predicted * state["hasher"].hasher.block_size)
            return _RelayResponse(relay)

    async def generate(raw: Request) -> Response:
        tenant = auth.tenant(raw.headers.get("authorization"))
        body = await read_body(raw)
        return await send(raw, route_request(body, raw.headers, tenant, state["hasher"]), body)

    app.post("/v1/completions")(generate)
    app.post("/v1/chat/completions")(generate)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        return await send(raw, RouteRequest([], None), None)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, raw: Request) -> Response:
        return await send(raw, RouteRequest([], None), None)

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
            try:
                answer = r.json()
            except ValueError:
                answer = r.text
            if r.status_code == 200 and routed is not None:
                routed.forget(i)
            return {"replica": rep.url, "status": r.status_code, "response": answer}

        results = await asyncio.gather(*(one(i) for i in range(len(replicas))))
        ok = all(r["status"] == 200 for r in results)
        return JSONResponse({"success": ok, "replicas": results}, status_code=200 if ok else 502)

    app.post("/reset_prefix_cache")(fan_out)
    app.post("/flush_cache")(fan_out)
    app.state.view = view
    return app
