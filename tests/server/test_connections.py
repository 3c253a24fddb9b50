"""Connection limits, with raw sockets on loopback: an idle, slow-header or slow-body connection is closed within
its timeout, and past --limit-concurrency a request gets 503 while the server keeps serving the others."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest
from support.server_registry import shared_server
from support.servers import Server

KEEP_ALIVE, HEADERS, BODY, LIMIT = 1, 1, 2, 3


limited = shared_server("limited", "--num-gpu-blocks", "256", "--timeout-keep-alive", str(KEEP_ALIVE),
                        "--timeout-headers", str(HEADERS), "--timeout-body", str(BODY),
                        "--limit-concurrency", str(LIMIT), scope="module")


def _connect(server: Server) -> socket.socket:
    u = urlsplit(server.url)
    return socket.create_connection((u.hostname, u.port), timeout=10)


def _request(path: str = "/health", method: str = "GET", body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
    if body:
        head += "Content-Type: application/json\r\n"
    return head.encode() + b"\r\n" + body


def _seconds_until_closed(sock: socket.socket, trickle: bytes = b"", limit: float = 8.0) -> float:
    """Sends ``trickle`` a byte every 0.2 s (slowloris) or nothing, reading until the server closes."""
    start = time.monotonic()
    sock.settimeout(0.2)
    sent = 0
    while time.monotonic() - start < limit:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - start
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.monotonic() - start
        if sent < len(trickle):
            try:
                sock.sendall(trickle[sent:sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - start
            sent += 1
    raise AssertionError(f"connection still open after {limit} s")


@pytest.mark.slow
def test_idle_keep_alive_connection_is_closed(limited: Server) -> None:
    with _connect(limited) as sock:
        sock.sendall(_request())
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert _seconds_until_closed(sock) < KEEP_ALIVE + 2


@pytest.mark.slow
def test_connection_that_never_sends_is_closed(limited: Server) -> None:
    with _connect(limited) as sock:
        assert HEADERS * 0.8 < _seconds_until_closed(sock) < HEADERS + 2


@pytest.mark.slow
def test_slow_headers_are_cut_off(limited: Server) -> None:
    with _connect(limited) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert _seconds_until_closed(sock, trickle=b"X-Slow: " + b"a" * 100) < HEADERS + 2


@pytest.mark.slow
def test_the_next_request_on_a_connection_has_its_own_headers_deadline(limited: Server) -> None:
    """The deadline for a request's head runs from the previous response, not from when the connection opened."""
    with _connect(limited) as sock:
        time.sleep(HEADERS * 0.6)
        sock.sendall(_request())
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # the next head, then a trickle
        assert HEADERS * 0.8 < _seconds_until_closed(sock, trickle=b"X-Slow: " + b"a" * 100) < HEADERS + 2


@pytest.mark.slow
def test_slow_body_is_cut_off(limited: Server) -> None:
    body = json.dumps({"model": "default-model-v1", "prompt": "x" * 200, "max_tokens": 1}).encode()
    with _connect(limited) as sock:
        sock.sendall(_request("/v1/completions", "POST", body)[:-len(body)])  # the head, then a trickle
        assert _seconds_until_closed(sock, trickle=body) < BODY + 2


def _status(server: Server) -> int:
    with _connect(server) as sock:
        sock.sendall(_request())
        return int(sock.recv(65536).split(b" ", 2)[1])


@pytest.mark.slow
def test_past_the_connection_limit_503_then_serving_again(limited: Server) -> None:
    body = json.dumps({"model": "default-model-v1", "prompt": "hold", "max_tokens": 4000, "stream": True,
                       "ignore_eos": True}).encode()
    held = []
    try:
        for _ in range(LIMIT - 1):  # streaming requests hold their connections as long as we like
            sock = _connect(limited)
            held.append(sock)
            sock.sendall(_request("/v1/completions", "POST", body))
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert _status(limited) == 503
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while _status(limited) != 200:
        assert time.monotonic() < deadline, "the server did not serve again after the held connections went"
        time.sleep(0.1)
    limited.wait_idle()


def test_writes_of_one_loop_iteration_go_out_as_one():
    """The transport uvicorn writes responses to (``CoalescingTransport``, over a real loopback connection): the
    writes of one event-loop iteration reach the socket as one write, in order, by the end of that iteration (a
    stream's chunks are not held back), and closing sends what was gathered before it closes."""
    import asyncio

    from kvprefix.http.connections import CoalescingTransport

    class Counted:  # the real transport, with its writes counted
        def __init__(self, transport):
            self.transport, self.writes = transport, 0

        def write(self, data):
            self.writes += 1
            self.transport.write(data)

        def __getattr__(self, name):
            return getattr(self.transport, name)

    async def run() -> None:
        received: asyncio.Queue[bytes] = asyncio.Queue()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(65536):
                await received.put(data)
            await received.put(b"")  # the end
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        real, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
        counted = Counted(real)
        out = CoalescingTransport(counted, loop)
        out.write(b"HTTP/1.1 200 OK\r\n\r\n")
        out.write(b"one")
        assert counted.writes == 0
        await asyncio.sleep(0)  # the end of this iteration
        assert counted.writes == 1 and not out.is_closing()
        assert await asyncio.wait_for(received.get(), 5) == b"HTTP/1.1 200 OK\r\n\r\none"
        out.write(b"two")  # a stream's next chunk, in its own iteration: out at once
        await asyncio.sleep(0)
        assert counted.writes == 2 and await asyncio.wait_for(received.get(), 5) == b"two"
        out.write(b"last")
        out.close()  # gathered, then closed: nothing is lost
        rest = b""
        while chunk := await asyncio.wait_for(received.get(), 5):
            rest += chunk
        assert rest == b"last" and counted.writes == 3
        await asyncio.sleep(0)
        out.write(b"after close")  # the flush of a closed transport sends nothing and raises nothing
        await asyncio.sleep(0)
        assert counted.writes == 3
        server.close()
        await server.wait_closed()

    asyncio.run(run())
