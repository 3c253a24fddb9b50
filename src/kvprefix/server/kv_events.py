"""`GET /v1/kv_events`: the replica's KV cache events as an NDJSON stream, for prefix-aware routers.

Nothing is subscribed until the first stream opens: a replica nobody listens to pays nothing. The first stream
subscribes the publisher to the engine together with a snapshot of the pool, atomically on the engine thread;
from then on the publisher numbers every event, keeps the index of what is cached (for later snapshots) and a
ring buffer of recent encoded events (for resumes). Each subscriber has a bounded queue filled on the engine
thread and drained by its response; one that falls behind is dropped with a goodbye, never waited for. The tiers
below the pool deliver their events (the same numbering) from their own threads. Each stream's hello says where the
replica holds blocks and what loading from each tier costs; a ``load_costs`` message follows when that moves.
Wire format and protocol: docs/kv-events.md.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator

from fastapi import FastAPI, Query, Request
from fastapi.responses import StreamingResponse

from kvprefix.cache import KVCacheEvent
from kvprefix.cache.event_index import MediaIndex
from kvprefix.cache.event_wire import (
    Event,
    Goodbye,
    Heartbeat,
    Hello,
    LoadCosts,
    SnapshotBlocks,
    SnapshotEnd,
    SnapshotStart,
    dumps,
)
from kvprefix.cache.media import POOL, Medium
from kvprefix.http.errors import APIError
from kvprefix.http.tenancy import Auth

BUFFER_BYTES = 16 * 2**20  # recent events kept for resumes
QUEUE_BYTES = 4 * 2**20  # per subscriber; smaller than the buffer, so a dropped subscriber can usually resume
HEARTBEAT_S = 10.0
COSTS_CHECK_S = 5.0  # a stream looks at the tiers' load costs at most this often
COSTS_STEP = 0.01  # and sends them when one moved by at least this many blocks of prefill since it last did
_RUNS_PER_LINE = 64


class _Subscriber:
    """One stream's queue. Pushed on the engine thread and taken on the event loop, both under the publisher's
    lock; the loop is woken once per batch, not once per event."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int):
        self.loop = loop
        self.limit = limit
        self.wake = asyncio.Event()
        self.lines: list[tuple[int, bytes]] = []
        self.size = 0
        self.notified = False
        self.ended: str | None = None  # "overflow" or "shutdown"

    def push(self, seq: int, line: bytes) -> bool:
        """False when the subscriber overflowed (and so must be dropped). One line always fits an empty queue,
        so an event larger than the limit cannot make a subscriber fail forever."""
        if self.lines and self.size + len(line) > self.limit:
            self.lines, self.size = [], 0  # freed now: the subscriber will resume or resync anyway
            self.end("overflow")
            return False
        self.lines.append((seq, line))
        self.size += len(line)
        self._notify()
        return True

    def end(self, reason: str) -> None:
        self.ended = self.ended or reason
        self._notify()

    def _notify(self) -> None:
        if not self.notified:
            self.notified = True
            try:
                self.loop.call_soon_threadsafe(self.wake.set)
            except RuntimeError:  # the loop is closed: nobody reads this stream any more
                pass

    def take(self) -> tuple[list[tuple[int, bytes]], str | None]:
        lines, self.lines, self.size, self.notified = self.lines, [], 0, False
        return lines, self.ended


class KVEventPublisher:
    """Turns one engine's (an AsyncLLM's) events into streams; ``on_event`` runs on the engine thread."""

    def __init__(self, replica_id: str, engine, buffer_bytes: int = BUFFER_BYTES, queue_bytes: int = QUEUE_BYTES,
                 heartbeat_s: float = HEARTBEAT_S):
        self.replica_id = replica_id
        self.epoch = secrets.token_hex(8)  # a restarted replica starts a new epoch: its numbers start over
        self._engine = engine
        self._hasher = engine.hasher
        self._identity = engine.identity
        self._max_model_len = engine.max_sequence_tokens
        self._buffer_limit = buffer_bytes
        self._queue_limit = queue_bytes
        self._heartbeat_s = heartbeat_s
        self._lock = threading.Lock()
        self._index = MediaIndex()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffer_size = 0
        self._subscribed = False
        self._subscribing = asyncio.Lock()
        self._subscribers: list[_Subscriber] = []
        self._closed = False

    @property
    def last_seq(self) -> int:
        """The number of the latest event (0 before any)."""
        return self._seq

    async def _subscribe_once(self) -> None:
        async with self._subscribing:
            if not self._subscribed:
                await self._engine.subscribe_kv_events_from_snapshot(self._load_snapshot, self.on_event)
                self._subscribed = True

    def _load_snapshot(self, blocks: list[tuple]) -> None:
        """The blocks one source (the pool, the tiers) holds when the subscription to it starts: event 0's state."""
        with self._lock:
            self._index.add(blocks)

    def on_event(self, event: KVCacheEvent) -> None:
        with self._lock:
            self._seq += 1
            self._index.apply(event)
            line = dumps(Event(self._seq, self.replica_id, event))
            self._buffer.append((self._seq, line))
            self._buffer_size += len(line)
            while self._buffer_size > self._buffer_limit and len(self._buffer) > 1:
                self._buffer_size -= len(self._buffer.popleft()[1])
            if self._subscribers:
                self._subscribers = [s for s in self._subscribers if s.push(self._seq, line)]

    def close(self) -> None:
        """Ends every stream with a goodbye (shutdown): open streams would otherwise hold the server open."""
        with self._lock:
            self._closed = True
            for sub in self._subscribers:
                sub.end("shutdown")
            self._subscribers = []

    async def stream(self, since: int | None, epoch: str | None) -> AsyncIterator[bytes]:
        """A new subscriber's stream: hello, then the events after ``since`` if this epoch's buffer still holds
        them all, else a snapshot, then the live events. Registered atomically with the state it starts from, so
        nothing is missed or repeated."""
        await self._subscribe_once()
        sub = _Subscriber(asyncio.get_running_loop(), self._queue_limit)
        with self._lock:
            if self._closed:
                raise APIError(503, "the server is shutting down", type="server_error")
            last = self._seq
            buffer = self._buffer
            resume = epoch == self.epoch and since is not None and (
                since == last or (since < last and bool(buffer) and buffer[0][0] <= since + 1))
            # Copies only (C-speed) under the lock: the engine thread waits on it; encoding happens outside.
            replay = [line for seq, line in buffer if seq > since] if resume and since != last else []
            index = None if resume else self._index.copy()
            self._subscribers.append(sub)
        hello = Hello(self.replica_id, self.epoch, self._hasher.block_size, self._hasher.algo, self._hasher.root,
                      last, resume, identity=self._identity, max_model_len=self._max_model_len,
                      media=tuple(self._engine.kv_media()))
        return self._lines(sub, hello, replay, index)

    def _costs_moved(self, sent: dict[str, float]) -> dict[str, float] | None:
        """The tiers' load costs now, if one moved by ``COSTS_STEP`` or more since ``sent``."""
        costs = _costs(self._engine.kv_media())
        return costs if any(abs(c - sent.get(name, c)) >= COSTS_STEP for name, c in costs.items()) else None

    async def _lines(self, sub: _Subscriber, hello: Hello, replay: list[bytes],
                     index: MediaIndex | None) -> AsyncIterator[bytes]:
        sent, checked = _costs(hello.media), time.monotonic()
        try:
            yield dumps(hello)
            delivered = hello.seq
            if index is None:
                if replay:
                    yield b"".join(replay)
            else:
                yield dumps(SnapshotStart(delivered, len(index)))
                runs = await asyncio.to_thread(index.runs)  # a big pool: keep the loop serving
                for i in range(0, len(runs), _RUNS_PER_LINE):
                    yield dumps(SnapshotBlocks(runs[i : i + _RUNS_PER_LINE]))
                yield dumps(SnapshotEnd(delivered))
            while True:
                sub.wake.clear()
                with self._lock:
                    lines, ended = sub.take()
                if lines:
                    delivered = lines[-1][0]
                    yield b"".join(line for _, line in lines)
                if ended:
                    message = ("this subscriber read too slowly and was dropped; reconnect with since and epoch"
                               if ended == "overflow" else "the replica is shutting down")
                    yield dumps(Goodbye(delivered, ended, message))
                    return
                if time.monotonic() - checked >= COSTS_CHECK_S:
                    checked, moved = time.monotonic(), self._costs_moved(sent)
                    if moved is not None:
                        sent = moved
                        yield dumps(LoadCosts(moved))
                if not lines:
                    try:
                        await asyncio.wait_for(sub.wake.wait(), self._heartbeat_s)
                    except asyncio.TimeoutError:
                        yield dumps(Heartbeat(delivered))
        finally:
            with self._lock:
                if sub in self._subscribers:
                    self._subscribers.remove(sub)


def _costs(media: tuple[Medium, ...] | list[Medium]) -> dict[str, float]:
    """The load cost of each tier below the pool, by medium."""
    return {m.name: m.load_cost for m in media if m.name != POOL}


def add_kv_event_routes(app: FastAPI, engine, auth: Auth, replica_id: str) -> KVEventPublisher:
    """Serves ``GET /v1/kv_events`` from ``engine``'s events. Call after ``app.state.drain`` is set: shutdown
    ends the streams first."""
    publisher = KVEventPublisher(replica_id, engine)
    drain = app.state.drain

    async def close_then_drain(timeout: float) -> None:
        publisher.close()
        await drain(timeout)

    app.state.drain = close_then_drain

    @app.get("/v1/kv_events")
    async def kv_events(raw: Request, since: int | None = Query(None, ge=0),
                        epoch: str | None = Query(None, max_length=64)) -> StreamingResponse:
        """Every tenant's block hashes and activity: the admin rule of docs/security.md."""
        auth.check_admin(raw.headers.get("authorization"))
        return StreamingResponse(await publisher.stream(since, epoch), media_type="application/x-ndjson",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    return publisher
