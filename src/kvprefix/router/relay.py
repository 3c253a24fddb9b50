"""Relaying one request to the replica a policy chose, as raw ASGI: the router's hot path.

The answer goes back byte for byte as it arrives (``upstream.Pool``), so ``cached_tokens`` is the replica's own
and a stream stays a stream. A replica that fails before answering, or answers 503, is passed over for another
(never the same one twice); once bytes went to the client nothing is retried. Every path settles the request's
share of the replica's load (``pending.Routed``): its queued prefill when its first token is out, the rest when
it ends however it ends (finished, replica gone, client gone, retried elsewhere), and before the end goes out, so
a client that sends its next request at once finds its previous one settled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kvprefix.http.errors import APIError
from kvprefix.http.forwarding import FORWARD_RAW_HEADERS
from kvprefix.router.fleet import FleetView, Replica
from kvprefix.router.hashing import RouteRequest
from kvprefix.router.ledger import Ledger
from kvprefix.router.metrics import TAIL_BYTES, RouterMetrics, reported_cached_tokens
from kvprefix.router.pending import Routed
from kvprefix.router.upstream import Pool, ReplicaDown

log = logging.getLogger("kvprefix.router")

DROP_RESPONSE_HEADERS = frozenset({b"transfer-encoding", b"connection", b"keep-alive", b"date",
                                   b"server"})
REPLICA_HEADER = b"x-kvprefix-replica"


class Relay:
    def __init__(self, ledger: Ledger, view: FleetView, pools: list[Pool], metrics: RouterMetrics):
        self.ledger = ledger
        self.view = view
        self.pools = pools
        self.metrics = metrics
        self.block_size = 0  # tokens per block, once the hashing identity is known (for the predicted metric)
        self._series = [metrics.series[rep.name] for rep in view.replicas]

    async def __call__(self, scope, receive, send, route: RouteRequest, body: bytes) -> None:
        """Answers the request from a replica; APIError (503 no_replica) when none can take it."""
        headers = [(k, v) for k, v in scope["headers"] if k in FORWARD_RAW_HEADERS]
        target = scope["raw_path"] or scope["path"].encode()
        if scope["query_string"]:
            target += b"?" + scope["query_string"]
        method = scope["method"].encode()
        view = self.view
        while True:
            if not view.usable():
                self.metrics.unroutable.inc()
                raise APIError(503, "no replica can take the request now (all down or all failed it)",
                               type="server_error", code="no_replica")
            decision, routed = self.ledger.route(route, view, view.excluded_names())
            i = decision.replica
            rep = view.replicas[i]
            try:
                upstream = await self.pools[i].request(method, target, headers, body)
            except ReplicaDown as exc:
                routed.finish()
                log.warning("replica %s failed before answering: %s; retrying elsewhere", rep.name, exc)
                rep.healthy = False
                self._series[i].retries.inc()
                view = view.excluding(i)
                continue
            except BaseException:
                routed.finish()
                raise
            if upstream.status == 503 and view.excluding(i).usable():  # full or shutting down: another may take it
                upstream.close()
                routed.finish()
                self._series[i].retries.inc()
                view = view.excluding(i)
                continue
            self._series[i].count(decision, self.block_size)
            await self._answer(scope, receive, send, i, rep, routed, upstream)
            return

    async def _answer(self, scope, receive, send, i: int, rep: Replica, routed: Routed, upstream) -> None:
        """Sends the replica's answer to the client: whole when it has arrived whole (most non-streamed answers:
        one body, nothing to watch), else streamed chunk by chunk as it arrives."""
        headers = [(k, v) for k, v in upstream.headers if k.lower() not in DROP_RESPONSE_HEADERS]
        headers.append((REPLICA_HEADER, rep.name.encode()))
        start = {"type": "http.response.start", "status": upstream.status, "headers": headers}
        if not upstream.complete:
            await self._stream(scope, receive, send, i, rep, routed, upstream, start)
            return
        try:
            body = upstream.body()
            routed.finish()  # the replica is done with it: settled before the client can send its next request
            self._count_reported(i, body[-TAIL_BYTES:])
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})
        finally:
            routed.finish()
            upstream.close()

    def _count_reported(self, i: int, tail: bytes) -> None:
        reported = reported_cached_tokens(tail)
        if reported is not None:
            self._series[i].reported_cached.inc(reported)

    async def _stream(self, scope, receive, send, i: int, rep: Replica, routed: Routed, upstream, start) -> None:
        """A client that leaves closes the upstream connection (the replica aborts the request), which ends the
        relay as a cut-off answer would."""
        client_gone = False

        async def watch() -> None:
            nonlocal client_gone
            while (await receive())["type"] != "http.disconnect":
                pass
            client_gone = True
            upstream.abort()

        watcher = asyncio.create_task(watch())
        sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in upstream.headers)
        # The first token is out with the first event of a completion stream, the second of a chat stream (a
        # role-only event comes first), the first bytes of a whole answer.
        first_token_event = (2 if scope["path"].endswith("/chat/completions") else 1) if sse else 0
        tail, events, last = b"", 0, b""
        try:
            await send(start)
            try:
                async for chunk in upstream.chunks():
                    tail = (tail + chunk)[-TAIL_BYTES:]
                    if events < first_token_event:
                        events += chunk.count(b"data:")
                    if events >= first_token_event:
                        routed.prefilled()
                    if upstream.exhausted:  # the answer's last bytes: they go with its end (one send less)
                        last = chunk
                        continue
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except ReplicaDown as exc:  # the replica went away mid-answer: nothing to retry once bytes went out
                if not client_gone:
                    log.warning("answer from %s cut off: %s", rep.name, exc)
            routed.finish()
            self._count_reported(i, tail)
            await send({"type": "http.response.body", "body": last, "more_body": False})
        finally:
            routed.finish()
            upstream.close()
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
