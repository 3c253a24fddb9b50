"""Which blocks each tier below the pool holds, as this replica knows it, and the KV events that announce it.

A router credits a block on a replica's disk or in the shared tier (docs/router.md), so a replica announces them as
it announces its pool's: ``BlockStored`` / ``BlockRemoved`` with the tier's medium (``cache.media``). Known, per tier:

- stored: a write succeeded, or the writer found the block there already; for the disk also the start-up scan and
  each rescan (blocks other processes on the directory wrote: their parent and namespace are not read);
- removed: the disk deleted it (its byte budget, a failed verification, a rescan that no longer finds it), or a
  lookup or a load here found it missing or not verifying. That is how the shared tier's evictions and expiries are
  seen at all: Redis tells no one, so a block it dropped is announced removed once a replica misses it.

A tier with a capacity keeps at most that many blocks here, forgetting (and announcing the removal of) the least
recently stored first: the shared tier's ``maxmemory`` over a block's size, as its ``allkeys-lru`` would (roughly).
Events are delivered at once, on the thread that learned of the change, under one lock, so every subscriber sees
them in order and a subscription starts atomically with its snapshot. With no subscriber no event is built.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvprefix.cache.events import BlockRemoved, BlockStored, EventCallback

Snapshot = list[tuple[bytes, bytes | None, str, str]]  # (hash, parent, namespace id, medium)


class TierPresence:
    """``track(medium, capacity)`` each tier, then ``stored`` / ``removed`` from any thread."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._lock = threading.Lock()
        self._held: dict[str, OrderedDict[bytes, tuple[bytes | None, str]]] = {}
        self._capacity: dict[str, int | None] = {}
        self._subscribers: list[EventCallback] = []

    def track(self, medium: str, capacity_blocks: int | None = None) -> None:
        with self._lock:
            self._held.setdefault(medium, OrderedDict())
            self._capacity[medium] = capacity_blocks

    def held(self, medium: str) -> int:
        """How many blocks of ``medium`` are known here."""
        with self._lock:
            return len(self._held.get(medium, ()))

    def stored(self, medium: str, block_hashes: Sequence[bytes], parent: bytes | None, namespace: str) -> None:
        """``block_hashes`` (each the parent of the next; ``parent`` precedes the first) are in ``medium``; those
        known already are only refreshed."""
        entries = []
        for h in block_hashes:
            entries.append((h, parent, namespace))
            parent = h
        self._add(medium, entries)

    def found(self, medium: str, block_hashes: Sequence[bytes]) -> None:
        """Blocks found in ``medium`` without their header read (a directory scan): parent and namespace unknown."""
        self._add(medium, [(h, None, "") for h in block_hashes])

    def _add(self, medium: str, entries: list[tuple[bytes, bytes | None, str]]) -> None:
        with self._lock:
            held = self._held[medium]
            new: list[bytes] = []
            for h, parent, namespace in entries:
                if h in held:
                    held.move_to_end(h)
                else:
                    held[h] = (parent, namespace)
                    new.append(h)
            if self._subscribers:
                for first, hashes in _chained(new, held):
                    self._deliver(BlockStored(hashes, held[first][0], None, self.block_size, None,
                                              held[first][1], medium))
            capacity = self._capacity[medium]
            gone = [held.popitem(last=False)[0] for _ in range(len(held) - capacity)] if capacity else []
            if gone and self._subscribers:
                self._deliver(BlockRemoved(gone, medium))

    def removed(self, medium: str, block_hashes: Sequence[bytes]) -> None:
        """``block_hashes`` are no longer in ``medium``; those not known here are passed over."""
        with self._lock:
            held = self._held[medium]
            gone = [h for h in block_hashes if held.pop(h, None) is not None]
            if gone and self._subscribers:
                self._deliver(BlockRemoved(gone, medium))

    def _deliver(self, event) -> None:
        for callback in self._subscribers:
            callback(event)

    def subscribe_from_snapshot(self, on_snapshot: Callable[[Snapshot], None],
                                on_event: EventCallback) -> Callable[[], None]:
        """Atomically: ``on_snapshot`` with every block known now, then ``on_event`` subscribed to every change after
        it (no change can come between); returns the function that unsubscribes."""
        with self._lock:
            on_snapshot([(h, parent, namespace, medium) for medium, held in self._held.items()
                         for h, (parent, namespace) in held.items()])
            self._subscribers = [*self._subscribers, on_event]

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers = [s for s in self._subscribers if s is not on_event]

        return unsubscribe


def _chained(hashes: list[bytes], held: OrderedDict) -> list[tuple[bytes, list[bytes]]]:
    """``hashes`` as runs of blocks each the parent of the next (first hash, run): one event per run."""
    runs: list[tuple[bytes, list[bytes]]] = []
    for h in hashes:
        parent, namespace = held[h]
        if runs and parent is not None and parent == runs[-1][1][-1] and namespace == held[runs[-1][0]][1]:
            runs[-1][1].append(h)
        else:
            runs.append((h, [h]))
    return runs
