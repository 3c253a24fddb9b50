"""In-process servers: the real app (`kvprefix.server.app.create_app`) over the real `AsyncLLM` with the tests' model,
configured from `kvprefix serve` arguments as the command does, and reached by httpx and the official openai client
through an ASGI transport, without a process, a port or a socket.

The app runs on one event loop in a background thread, as under uvicorn; clients on any thread or loop hand their
requests to it. httpx's own `ASGITransport` collects a whole response before returning it, so a stream that holds
a slot or a client that leaves mid-stream could not be tested through it; `AppTransport` streams each body chunk as
the app sends it and tells the app `http.disconnect` when the client closes the response or times out, as uvicorn
does. What needs a real process (signals, timeouts on the socket, kill -9, the CLI) stays on `support.servers`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import openai

from support.servers import Endpoint

# The app (its log) that the code running now belongs to; records from elsewhere (the engine thread) go to all.
_CURRENT: contextvars.ContextVar[AppServer | None] = contextvars.ContextVar("kvprefix_test_app", default=None)
log = logging.getLogger("kvprefix.tests.asgi")


class AppLoop:
    """One event loop in a daemon thread: the loop every in-process app lives on."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvprefix-test-app-loop", daemon=True)
        self._thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def wait(self, coro, timeout: float | None = None) -> Any:
        """Awaits ``coro`` on the app loop from any loop (cancelling it there on a timeout)."""
        if asyncio.get_running_loop() is self.loop:
            return await asyncio.wait_for(coro, timeout)
        return await asyncio.wait_for(asyncio.wrap_future(self.submit(coro)), timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class _Exchange:
    """One request/response on the app loop: the response's chunks as the app sends them, and the disconnect."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.started: asyncio.Future = loop.create_future()
        self.chunks: asyncio.Queue = asyncio.Queue()
        self.gone = asyncio.Event()  # the client closed the response (or gave up waiting)

    def disconnect(self) -> None:
        """Thread-safe."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.gone.set)

    async def next(self) -> bytes | None:
        item = await self.chunks.get()
        if isinstance(item, BaseException):
            raise item
        return item


class AppTransport(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """An httpx transport (sync and async) to an ASGI ``app`` on ``loop``, with streamed responses."""

    def __init__(self, app, loop: AppLoop, owner: AppServer, state: dict, server: tuple[str, int]) -> None:
        self.app, self.loop, self.owner, self.state, self.server = app, loop, owner, state, server
        self._peers = iter(range(40000, 60000))
        self.tasks: set[asyncio.Task] = set()  # the apps running now (a reference keeps each alive)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = list(request.stream)  # chunk boundaries kept: a streamed body arrives in the same pieces
        timeout = request.extensions.get("timeout", {}).get("read")
        exchange = None
        future = self.loop.submit(self._open(request, body))
        try:
            exchange, status, headers = future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise httpx.ReadTimeout("timed out waiting for the response", request=request) from None
        return httpx.Response(status, headers=headers, stream=_SyncBody(self.loop, exchange, timeout, request),
                              request=request)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = [chunk async for chunk in request.stream]
        timeout = request.extensions.get("timeout", {}).get("read")
        try:
            exchange, status, headers = await self.loop.wait(self._open(request, body), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            raise httpx.ReadTimeout("timed out waiting for the response", request=request) from None
        return httpx.Response(status, headers=headers, stream=_AsyncBody(self.loop, exchange, timeout, request),
                              request=request)

    async def _open(self, request: httpx.Request, body: list[bytes]) -> tuple[_Exchange, int, list]:
        """Starts the app on this request; returns once the response has started (or the app failed before)."""
        _CURRENT.set(self.owner)
        exchange = _Exchange(asyncio.get_running_loop())
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": request.method, "scheme": request.url.scheme, "path": request.url.path,
            "raw_path": request.url.raw_path.split(b"?")[0], "query_string": request.url.query, "root_path": "",
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "client": ("127.0.0.1", next(self._peers)), "server": self.server, "state": dict(self.state),
        }
        pieces, sent = body or [b""], 0

        async def receive() -> dict:
            nonlocal sent
            if sent < len(pieces):  # the body, in the client's pieces
                sent += 1
                return {"type": "http.request", "body": pieces[sent - 1], "more_body": sent < len(pieces)}
            await exchange.gone.wait()  # as uvicorn: the next message is the disconnect (or the response's end)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if exchange.gone.is_set():
                return  # as uvicorn: whatever the app sends after the client left goes nowhere
            if message["type"] == "http.response.start":
                exchange.started.set_result((message["status"], message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body") and request.method != "HEAD":
                    exchange.chunks.put_nowait(message["body"])
                if not message.get("more_body", False):
                    exchange.chunks.put_nowait(None)
                    exchange.gone.set()

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            except Exception as exc:
                log.exception("Exception in ASGI application")  # a Traceback in the log, as uvicorn writes
                if not exchange.started.done():
                    exchange.started.set_result((500, [(b"content-type", b"text/plain")]))
                    exchange.chunks.put_nowait(b"Internal Server Error")
                    exchange.chunks.put_nowait(None)
                else:
                    exchange.chunks.put_nowait(httpx.RemoteProtocolError(f"the server closed the response: {exc}"))
            if not exchange.started.done():  # the app returned without a response: uvicorn answers 500
                exchange.started.set_result((500, []))
            exchange.chunks.put_nowait(None)

        self.tasks.add(task := asyncio.get_running_loop().create_task(run()))
        task.add_done_callback(self.tasks.discard)
        try:
            status, headers = await asyncio.shield(exchange.started)
        except asyncio.CancelledError:  # the client gave up before the response started: it disconnects
            exchange.gone.set()
            raise
        return exchange, status, headers


class _SyncBody(httpx.SyncByteStream):
    def __init__(self, loop: AppLoop, exchange: _Exchange, timeout: float | None, request: httpx.Request) -> None:
        self.loop, self.exchange, self.timeout, self.request = loop, exchange, timeout, request

    def __iter__(self) -> Iterator[bytes]:
        while True:
            future = self.loop.submit(self.exchange.next())
            try:
                chunk = future.result(self.timeout)
            except concurrent.futures.TimeoutError:
                future.cancel()
                self.exchange.disconnect()
                raise httpx.ReadTimeout("timed out reading the response", request=self.request) from None
            if chunk is None:
                return
            yield chunk

    def close(self) -> None:
        self.exchange.disconnect()


class _AsyncBody(httpx.AsyncByteStream):
    def __init__(self, loop: AppLoop, exchange: _Exchange, timeout: float | None, request: httpx.Request) -> None:
        self.loop, self.exchange, self.timeout, self.request = loop, exchange, timeout, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            try:
                chunk = await self.loop.wait(self.exchange.next(), self.timeout)
            except (asyncio.TimeoutError, TimeoutError):
                self.exchange.disconnect()
                raise httpx.ReadTimeout("timed out reading the response", request=self.request) from None
            if chunk is None:
                return
            yield chunk

    async def aclose(self) -> None:
        self.exchange.disconnect()


class _AppLog(logging.Handler):
    """Writes each record to the log file of the app it came from (all open apps' for the engine thread's)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)  # the subprocess servers run with --log-level warning
        self.apps: list[AppServer] = []
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        current = _CURRENT.get()
        text = self.format(record) + "\n"
        for app in [current] if current is not None else list(self.apps):
            with open(app.log_path, "a") as f:
                f.write(text)


class AppServer(Endpoint):
    """One app of `kvprefix serve ARGS` in this process: the `Server` interface (client, async_client, post, get,
    metrics, wait_idle, log_path, request_log) over `AppTransport`."""

    def __init__(self, loop: AppLoop, handler: _AppLog, tmp: Path, model: str, args: list[str], port: int,
                 request_log: bool = False) -> None:
        self.url = f"http://127.0.0.1:{port}"  # never listened on: the Host and Origin a client would send
        self.log_path = tmp / f"app-{port}.log"
        self.log_path.write_text("")
        self.request_log = tmp / f"app-requests-{port}.jsonl" if request_log else None
        self.loop, self.handler = loop, handler
        args = ["--port", str(port), "--model", model, "--served-model-name", "default-model-v1", "--dtype",
                "float32", "--max-num-seqs", "80", *args]
        if self.request_log is not None:
            args += ["--request-log", str(self.request_log)]
        self.app, self.shutdown_timeout = build_app(args)
        self._stack = AsyncExitStack()
        handler.apps.append(self)
        state = loop.submit(self._start()).result(120)
        self.transport = AppTransport(self.app, loop, self, state, ("127.0.0.1", port))
        self.http = httpx.Client(transport=self.transport, base_url=self.url, timeout=60)

    async def _start(self) -> dict:
        _CURRENT.set(self)
        state = await self._stack.enter_async_context(self.app.router.lifespan_context(self.app))
        return dict(state or {})

    async def _stop(self) -> None:
        _CURRENT.set(self)
        await self.app.state.drain(self.shutdown_timeout)  # as `serve` does on SIGTERM, then the lifespan ends
        await self._stack.aclose()

    def client(self, api_key: str = "none", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60,
                             http_client=httpx.Client(transport=self.transport), **kwargs)

    def async_client(self, api_key: str = "none") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120,
                                  http_client=httpx.AsyncClient(transport=self.transport))

    def get(self, path: str, headers: dict | list | None = None, **kw) -> httpx.Response:
        return self.http.get(path, headers=headers, **kw)

    def post(self, path: str, body: bytes | dict | None = None, headers: dict | None = None, **kw) -> httpx.Response:
        return self.http.post(path, **self.post_args(body, headers), **kw)

    def close(self) -> None:
        """Drains and shuts the app and its engine down; fails if the log holds a traceback (a clean exit)."""
        try:
            self.loop.submit(self._stop()).result(self.shutdown_timeout + 30)
        finally:
            self.http.close()
            self.handler.apps.remove(self)
        log_text = self.log_path.read_text()
        assert "Traceback" not in log_text, log_text


def build_app(argv: list[str]):
    """The app and its drain timeout from `kvprefix serve` arguments, built as `kvprefix.server.cli.run` builds
    them (``prepare``: options -> EngineArgs, ServerConfig; then AsyncLLM -> create_app)."""
    from kvprefix.cli import build_parser
    from kvprefix.engine import AsyncLLM
    from kvprefix.server.app import create_app
    from kvprefix.server.cli import prepare

    args = build_parser().parse_args(["serve", *argv])
    engine_args, config = prepare(args)
    return create_app(AsyncLLM(engine_args), config), args.shutdown_timeout


class AppRegistry:
    """The in-process apps the tests share, one per configuration (like `ServerRegistry`'s processes), on one loop;
    closed at the end of the session."""

    def __init__(self, tmp: Path, model: str) -> None:
        self.tmp, self.model = tmp, model
        self.loop: AppLoop | None = None
        self.handler = _AppLog()
        self.apps: dict[tuple, AppServer] = {}
        self._lock = threading.Lock()

    def get(self, args: tuple[str, ...], request_log: bool = False, api_keys: dict[str, str] | None = None
            ) -> AppServer:
        key = (args, request_log, tuple(sorted((api_keys or {}).items())))
        with self._lock:
            if key not in self.apps:
                if self.loop is None:
                    self.loop = AppLoop()
                    logging.getLogger("kvprefix").addHandler(self.handler)
                extra = []
                if api_keys:
                    keys = self.tmp / f"keys-{len(self.apps)}.json"
                    keys.write_text(json.dumps(api_keys))
                    extra = ["--api-keys-file", str(keys)]
                self.apps[key] = AppServer(self.loop, self.handler, self.tmp, self.model, [*args, *extra],
                                           port=8000 + len(self.apps), request_log=request_log)
            return self.apps[key]

    def close(self) -> None:
        errors = []
        for app in self.apps.values():
            try:
                app.close()
            except AssertionError as exc:
                errors.append(str(exc))
        self.apps.clear()
        if self.loop is not None:
            logging.getLogger("kvprefix").removeHandler(self.handler)
            self.loop.close()
        assert not errors, "\n\n".join(errors)
