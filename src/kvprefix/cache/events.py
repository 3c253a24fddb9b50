"""KV cache events, for routers and other subscribers that mirror which blocks an engine holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvprefix.cache.hashing import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """Consecutive blocks of one request became cached; ``parent_block_hash`` precedes the first of them."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int] | None
    block_size: int
    extra_keys: list[list[tuple]] | None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks were evicted: their hashes no longer hit."""

    block_hashes: list[BlockHash]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache was reset: no hash hits any more."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
EventCallback = Callable[[KVCacheEvent], None]


class EventPublisher:
    """Calls subscribers synchronously. Emitters test ``active`` first, so an unwatched pool builds no events."""

    def __init__(self) -> None:
        self._subscribers: list[EventCallback] = []
        self.active = False

    # Copy-on-write: (un)subscribe may run on another thread (or in a callback) while publish iterates, so they
    # assign a new list and publish iterates whichever list it read.

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
        for callback in self._subscribers:
            callback(event)
