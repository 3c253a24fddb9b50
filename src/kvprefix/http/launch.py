"""The one uvicorn launch of every front end we run (`kvprefix serve`, `kvprefix route`): until SIGINT or SIGTERM,
with the timed HTTP protocol (header and body deadlines, coalesced writes: ``connections``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


def run_server(app, host: str, port: int, *, log_level: str = "info", http: type | None = None,
               timeout_keep_alive: float = 5.0, limit_concurrency: int | None = None, access_log: bool = True,
               proxy_headers: bool = True, on_shutdown: Callable[[], Awaitable[None]] | None = None,
               graceful_timeout_s: float | None = None) -> None:
    """Serves ``app``. ``http``: the protocol class (default: ``timed_protocol`` over h11). ``on_shutdown`` runs
    while uvicorn waits for open connections to close (the server's drain); uvicorn's own deadline,
    ``graceful_timeout_s``, only backs it up."""
    import uvicorn

    from kvprefix.http.connections import timed_protocol

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            drain = asyncio.create_task(on_shutdown()) if on_shutdown is not None else None
            await super().shutdown(sockets)
            if drain is not None:
                await drain

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=http or timed_protocol(20.0, 60.0),
                            timeout_keep_alive=timeout_keep_alive, limit_concurrency=limit_concurrency,
                            access_log=access_log, proxy_headers=proxy_headers,
                            timeout_graceful_shutdown=graceful_timeout_s)
    _Server(config).run()
