"""KV cache events, for routers and other subscribers that mirror which blocks an engine holds.

The manager delivers queued events (``EventPublisher.flush``) only once its bookkeeping is complete, so a failing
subscriber can never leave blocks unaccounted for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvprefix.cache.hashing import BlockHash
from kvprefix.cache.media import POOL


@dataclass(frozen=True)
class BlockStored:
    """Consecutive blocks of one request became cached; ``parent_block_hash`` precedes the first (the namespace's
    root for a first block; None for trace replays and for blocks a tier found without their header). ``namespace``:
    the public id, never the salt. ``medium``: where (``cache.media``): the pool, or a tier below it."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int] | None
    block_size: int
    extra_keys: list[list[tuple]] | None
    namespace: str = ""
    medium: str = POOL


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left ``medium`` (evicted, deleted, found missing): their hashes no longer hit there."""

    block_hashes: list[BlockHash]
    medium: str = POOL


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache (the pool) was reset: no hash hits there any more. The tiers below keep theirs."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
EventCallback = Callable[[KVCacheEvent], None]


class EventPublisher:
    """Queues events while anyone subscribes and delivers them, in order, on ``flush``. Emitters test ``active``
    first, so an unwatched pool builds no events."""

    def __init__(self) -> None:
        self._subscribers: list[EventCallback] = []
        self._pending: list[KVCacheEvent] = []
        self.active = False

    # Copy-on-write: (un)subscribe may run on another thread (or in a callback) while flush iterates, so they
    # assign a new list and flush iterates whichever list it read.

    def subscribe(self, callback: EventCallback) -> Callable[[], None]:
        """Adds a subscriber; returns a function that removes it."""
        self._subscribers = [*self._subscribers, callback]
        self.active = True

        def unsubscribe() -> None:
            subscribers = list(self._subscribers)
            subscribers.remove(callback)
            self._subscribers = subscribers
            self.active = bool(subscribers)

        return unsubscribe

    def publish(self, event: KVCacheEvent) -> None:
        """Queues ``event`` for the next ``flush``."""
        self._pending.append(event)

    def flush(self) -> None:
        """Delivers the queued events to every subscriber. Taken off the queue first: a subscriber that raises
        loses its events but can never make another flush deliver them twice."""
        if not self._pending:
            return
        events, self._pending = self._pending, []
        subscribers = self._subscribers
        for event in events:
            for callback in subscribers:
                callback(event)
