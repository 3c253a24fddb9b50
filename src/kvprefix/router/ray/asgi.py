"""Running one HTTP request through an ASGI app in-process: how an engine replica serves the calls the ingress
relays to it with `kvprefix serve`'s own app."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any


def _scope(method: str, path: str, query: bytes, headers: list[tuple[str, str]]) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}


async def call_asgi(app, method: str, path: str, query: bytes, headers: list[tuple[str, str]],
                    body: bytes) -> AsyncIterator[Any]:
    """Yields (status, headers), then the body's chunks as they come (a stream stays a stream). Closing the
    generator early is a client disconnect."""
    messages: asyncio.Queue[dict] = asyncio.Queue()
    gone = asyncio.Event()
    request: dict | None = {"type": "http.request", "body": body, "more_body": False}

    async def receive() -> dict:
        nonlocal request
        if request is not None:
            message, request = request, None
            return message
        await gone.wait()
        return {"type": "http.disconnect"}

    task = asyncio.create_task(app(_scope(method, path, query, headers), receive, messages.put))
    task.add_done_callback(lambda _: messages.put_nowait({"type": "done"}))
    try:
        while True:
            message = await messages.get()
            if message["type"] == "http.response.start":
                yield message["status"], [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]]
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    break
            elif message["type"] == "done":
                task.result()  # the app raised before answering: let it show
                break
    finally:
        gone.set()
        await task
