"""The router's upstream client against a replica that goes away: a connection it resets just after accepting
(a replica being killed) fails the request as ReplicaDown, which the relay retries elsewhere; it neither raises
something else nor waits for an answer that never comes."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from kvprefix.router.upstream import Pool, ReplicaDown


def _loops():
    yield "asyncio", asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        return
    yield "uvloop", uvloop.new_event_loop  # what the router runs on: it raises writing to a closed connection


@pytest.mark.parametrize("make_loop", [make for _, make in _loops()], ids=[name for name, _ in _loops()])
def test_a_connection_reset_at_once_is_replica_down(make_loop):
    async def run() -> None:
        def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
            writer.transport.abort()

        server = await asyncio.start_server(reset, "127.0.0.1", 0)
        pool = Pool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", connect_timeout_s=5)
        try:
            for _ in range(30):
                with pytest.raises(ReplicaDown):
                    await asyncio.wait_for(pool.request(b"POST", b"/v1/completions", [], b"{}"), 5)
        finally:
            pool.close()
            server.close()
            await server.wait_closed()

    loop = make_loop()
    try:
        loop.run_until_complete(run())
    finally:
        loop.close()
