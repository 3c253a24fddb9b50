"""Reading a request body within the limit: the one reader for the server, the router and the Ray ingress."""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import Receive

from kvprefix.http.errors import APIError, bad_request

MAX_BODY_BYTES = 16 * 2**20


async def read_body(raw: Request) -> bytes:
    """``receive_body`` of a Starlette request."""
    return await receive_body(raw.receive, raw.headers.get("content-length", ""))


async def receive_body(receive: Receive, content_length: str = "") -> bytes:
    """The whole body from the ASGI messages, or 413 as soon as it is over the limit (never held in memory).
    ``content_length``: the request's header, "" when it has none."""
    if content_length.isdigit() and int(content_length) > MAX_BODY_BYTES:
        raise _too_big()
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":  # the client went, or --timeout-body closed it: nobody reads this
            raise bad_request("the connection closed before the whole body arrived")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_big()
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _too_big() -> APIError:
    return APIError(413, f"request body is over the limit of {MAX_BODY_BYTES} bytes")
