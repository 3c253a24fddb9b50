"""What the router reads of a request without a Starlette ``Request``: its few headers and its body, from the ASGI
scope and messages as uvicorn hands them over."""

from __future__ import annotations

import asyncio

import pytest

from kvprefix.http import bodies
from kvprefix.http.errors import APIError
from kvprefix.router.app import request_headers


def messages(*items: dict):
    queue = list(items)

    async def receive() -> dict:
        return queue.pop(0)

    return receive


def test_the_relay_reads_the_first_of_each_header_it_needs():
    scope = {"headers": [(b"host", b"r"), (b"authorization", b"Bearer k\xe9"), (b"x-session-id", b"s1"),
                         (b"x-session-id", b"s2"), (b"content-length", b"12")]}
    assert request_headers(scope) == {"authorization": "Bearer k\u00e9", "x-session-id": "s1", "content-length": "12"}


def test_a_body_that_does_not_parse_routes_without_hashes_or_session():
    """Not JSON, not an object, or nested deeper than Python's parser recurses (well within the body limit): the
    router routes it blind and the replica answers what is wrong with it; the router itself never fails it."""
    from kvprefix.router.hashing import route_request

    deep = b"[" * 200_000 + b"]" * 200_000
    for body in (b"{", b"[1, 2]", deep, b'{"messages": ' + deep + b', "user": "u"}'):
        route = route_request(body, {"x-session-id": "s"}, None, None)
        assert (list(route.block_hashes), route.num_blocks, route.session) == ([], 0, "s")


def test_a_body_is_read_whole_within_the_limit(monkeypatch):
    chunked = messages({"type": "http.request", "body": b"ab", "more_body": True},
                       {"type": "http.request", "body": b"", "more_body": True}, {"type": "http.request", "body": b"c"})
    assert asyncio.run(bodies.receive_body(chunked)) == b"abc"
    monkeypatch.setattr(bodies, "MAX_BODY_BYTES", 4)
    with pytest.raises(APIError) as declared:  # refused on its Content-Length before a byte is read
        asyncio.run(bodies.receive_body(messages(), "5"))
    over = messages({"type": "http.request", "body": b"abc", "more_body": True},
                    {"type": "http.request", "body": b"de", "more_body": True})
    with pytest.raises(APIError) as streamed:  # an unannounced body: refused as soon as it is over
        asyncio.run(bodies.receive_body(over))
    assert declared.value.status == streamed.value.status == 413
    gone = messages({"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.disconnect"})
    with pytest.raises(APIError) as left:
        asyncio.run(bodies.receive_body(gone))
    assert left.value.status == 400
