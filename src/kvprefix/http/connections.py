"""Deadlines for receiving a request, which uvicorn lacks; and a response in one write.

uvicorn sets no limit on how long a client may take to *send* a request (uvicorn issue #157), so slow clients can
hold connections open for ever and exhaust the process (slowloris). This protocol adds two deadlines: the head
within ``headers_timeout`` of the connection opening or the previous response, the body within ``body_timeout`` of
the head. Once a request is in, none applies (a long generation streams as long as it takes).

uvicorn writes a response's head and body separately; ``CoalescingTransport`` gathers one event-loop iteration's
writes into one, so a short answer goes out in one segment and a stream's chunks still go out as they come.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


def timed_protocol(headers_timeout: float, body_timeout: float, base: type = H11Protocol) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol (or ``base``: its httptools one has the same hooks) with the two deadlines, for
    ``uvicorn.Config(http=...)``."""

    class TimedH11Protocol(base):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            self._timer: asyncio.TimerHandle | None = None
            self._head = self._received = None  # the latest request whose head, whose whole body arrived
            super().connection_made(transport)
            self.transport = CoalescingTransport(transport, self.loop)  # what the requests' cycles write to
            self._arm(headers_timeout)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._on_progress()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm(headers_timeout)  # for the next request on this connection
                self._on_progress()  # a pipelined one may already be parsed

        def connection_lost(self, exc: Exception | None) -> None:
            if self._timer is not None:
                self._timer.cancel()
            super().connection_lost(exc)

        def _on_progress(self) -> None:
            cycle = self.cycle
            if cycle is None or cycle is self._received:
                return
            if not cycle.more_body:
                self._received = cycle
                self._arm(None)
            elif cycle is not self._head:
                self._head = cycle
                self._arm(body_timeout)

        def _arm(self, timeout: float | None) -> None:
            """Sets the deadline: a time, not a timer; one timer per connection checks it when due and waits again
            if it moved later (no timer created and cancelled per request)."""
            self._deadline = None if timeout is None else self.loop.time() + timeout
            if self._deadline is not None and (self._timer is None or self._deadline < self._timer.when()):
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = self.loop.call_at(self._deadline, self._expire)

        def _expire(self) -> None:
            self._timer = None
            if self._deadline is None or self.transport.is_closing():
                return
            if self.loop.time() < self._deadline:
                self._timer = self.loop.call_at(self._deadline, self._expire)
            else:
                self.transport.close()

    return TimedH11Protocol


class CoalescingTransport:
    """A transport whose writes in one event-loop iteration reach the socket as one write, in order, at the end of
    the iteration; closing sends what is gathered first. Everything else is the wrapped transport's."""

    __slots__ = ("_transport", "_loop", "_gathered")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._gathered: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._gathered:
            self._loop.call_soon(self.flush)
        self._gathered.append(data)

    def flush(self) -> None:
        gathered, self._gathered = self._gathered, []
        if gathered and not self._transport.is_closing():
            self._transport.write(gathered[0] if len(gathered) == 1 else b"".join(gathered))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)
