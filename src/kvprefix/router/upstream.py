"""The router's HTTP/1.1 client to one replica: a pool of keep-alive connections, bodies passed through as bytes.

The relay is the router's hot path, and a general client (httpx: URL objects, header models, anyio streams,
a timeout scope per call) cost most of its time. This one writes the request head and body in one write and
parses the answer with httptools (the C parser uvicorn uses), handing the body on chunk by chunk as it arrives,
so a stream stays a stream; reading pauses while a slow client has not taken what is buffered.

``ReplicaDown`` means the replica failed before any byte of an answer (refused, reset, closed): the request may
go to another replica. A pooled connection the replica closed while idle (its keep-alive timeout) is not that:
the request is sent again once on a fresh connection before the replica is blamed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 1 << 20  # bytes buffered from the replica before reading pauses


class ReplicaDown(Exception):
    """The replica failed before answering: nothing reached the client, another replica may take the request."""


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.head: asyncio.Future | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.error: Exception | None = None
        self.wakeup: asyncio.Future | None = None
        self.paused = False

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ReplicaDown(f"bad HTTP from the replica: {exc}"))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self._fail(ReplicaDown(str(exc) if exc else "the replica closed the connection"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the message is complete
        if self.head is not None and not self.head.done():
            self.head.set_result(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, exc: Exception) -> None:
        self.error = exc
        if self.head is not None and not self.head.done():
            self.head.set_exception(exc)
        self._wake()

    def _wake(self) -> None:
        if self.wakeup is not None and not self.wakeup.done():
            self.wakeup.set_result(None)


class Response:
    """An answer being received: ``status`` and ``headers`` now, the body from ``chunks()``; ``close()`` gives the
    connection back to the pool when the answer was read to its end (else closes it)."""

    def __init__(self, pool: Pool, conn: _Connection, status: int):
        self.status = status
        self.headers = conn.headers
        self._pool = pool
        self._conn = conn

    @property
    def complete(self) -> bool:
        """Whether the whole answer has arrived (a short answer comes with its head)."""
        return self._conn is not None and self._conn.complete

    @property
    def exhausted(self) -> bool:
        """Whether the chunks ``chunks()`` gave so far are the whole answer."""
        return self.complete and not self._conn.chunks

    def body(self) -> bytes:
        """The whole answer, once it is ``complete``: what ``chunks()`` would give, without iterating."""
        conn = self._conn
        data = b"".join(conn.chunks)
        conn.chunks.clear()
        conn.buffered = 0
        if conn.paused:
            conn.paused = False
            conn.transport.resume_reading()
        return data

    async def chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            while conn.chunks:
                chunk = conn.chunks.popleft()
                conn.buffered -= len(chunk)
                if conn.paused and conn.buffered < _HIGH_WATER // 2:
                    conn.paused = False
                    conn.transport.resume_reading()
                yield chunk
            if conn.complete:
                return
            if conn.error is not None:
                raise conn.error
            conn.wakeup = asyncio.get_running_loop().create_future()
            await conn.wakeup
            conn.wakeup = None

    def abort(self) -> None:
        """Drops the connection now (the client left): the replica sees the request abandoned."""
        if self._conn is not None:
            self._conn.transport.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.complete and not conn.closed and not conn.transport.is_closing() and conn.keep_alive:
            conn._reset()
            self._pool._idle.append(conn)
        else:
            conn.transport.close()


class Pool:
    """Keep-alive connections to one replica (``http://host:port``); as many as there are requests in flight."""

    def __init__(self, url: str, connect_timeout_s: float = 3.0):
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"replica URL {url!r}: give http://HOST:PORT (the router speaks plain HTTP/1.1)")
        self.host, self.port = parts.hostname, parts.port or 80
        self.host_header = parts.netloc.encode("latin-1")
        self.base_path = parts.path.rstrip("/").encode("latin-1")
        self.connect_timeout_s = connect_timeout_s
        self._idle: deque[_Connection] = deque()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(_Connection, self.host, self.port),
                                             self.connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            raise ReplicaDown(f"cannot connect to {self.host}:{self.port}: {exc or type(exc).__name__}") from None
        return conn

    async def request(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> Response:
        """Sends the request and waits for the answer's status and headers."""
        head = [method, b" ", self.base_path, target, b" HTTP/1.1\r\nhost: ", self.host_header, b"\r\n"]
        for name, value in headers:
            head += [name, b": ", value, b"\r\n"]
        if body or method == b"POST":
            head += [b"content-length: ", str(len(body)).encode(), b"\r\n"]
        head.append(b"\r\n")
        data = b"".join(head) + body
        while True:
            conn = self._idle.pop() if self._idle else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            # Closed while idle, or reset between connecting and now (the replica going down): writing to it would
            # raise (uvloop) or wait for an answer that never comes (asyncio).
            if conn.closed or conn.transport.is_closing():
                if reused:
                    continue
                raise ReplicaDown("the replica closed the connection before the request was sent")
            conn.used = True
            conn.head = asyncio.get_running_loop().create_future()
            conn.transport.write(data)
            try:
                status = await conn.head
            except ReplicaDown:
                conn.transport.close()
                if reused:
                    continue  # closed while idle (keep-alive timeout): once more on a fresh connection
                raise
            except BaseException:
                conn.transport.close()
                raise
            return Response(self, conn, status)

    def close(self) -> None:
        while self._idle:
            self._idle.pop().transport.close()
