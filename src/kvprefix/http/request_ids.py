"""The ``x-request-id`` header (vLLM's): every response carries the caller's id or a new one, to follow a request
through the client's, the router's and our logs."""

from __future__ import annotations

import uuid

from starlette.requests import Request

from kvprefix.http.errors import APIError

HEADER = b"x-request-id"
MAX_REQUEST_ID_LEN = 256
_SCOPE_KEY = "kvprefix.request_id"  # (id, whether the client sent it)


def valid_request_id(value: str) -> bool:
    """Printable ASCII without spaces, 1 to 256 characters: safe in a header, a log line and an engine id."""
    return 0 < len(value) <= MAX_REQUEST_ID_LEN and all("!" <= c <= "~" for c in value)


def request_id_of(raw: Request) -> tuple[str, bool]:
    """This request's id and whether the client chose it (set by RequestIdMiddleware)."""
    return raw.scope[_SCOPE_KEY]


class RequestIdMiddleware:
    """ASGI middleware: reads or makes the id and adds it to the response's headers (streams included)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = [v.decode("latin-1") for k, v in scope["headers"] if k == HEADER]
        if sent and (len(sent) > 1 or not valid_request_id(sent[0])):
            error = APIError(400, f"send one x-request-id header of 1 to {MAX_REQUEST_ID_LEN} printable ASCII "
                             "characters without spaces", param="x-request-id")
            await error.response()(scope, receive, send)
            return
        rid = sent[0] if sent else uuid.uuid4().hex
        scope[_SCOPE_KEY] = (rid, bool(sent))
        header = (HEADER, rid.encode("ascii"))

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_with_id)
