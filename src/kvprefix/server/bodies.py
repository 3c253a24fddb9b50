"""Reading a request body within the limit: the one reader for the server, the router and the Ray ingress."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from kvprefix.server.errors import APIError, bad_request

MAX_BODY_BYTES = 16 * 2**20


async def read_body(raw: Request) -> bytes:
    """The whole body, or 413 as soon as it is over the limit: an oversized (or unannounced chunked) body is never
    held in memory."""
    declared = raw.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_big()
    chunks, size = [], 0
    try:
        async for chunk in raw.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise _too_big()
            chunks.append(chunk)
    except ClientDisconnect:  # the client went, or --timeout-body closed it: nobody reads this answer
        raise bad_request("the connection closed before the whole body arrived") from None
    return b"".join(chunks)


def _too_big() -> APIError:
    return APIError(413, f"request body is over the limit of {MAX_BODY_BYTES} bytes")
