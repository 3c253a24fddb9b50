"""Write-behind: blocks registered in the pool are written to a tier by one background thread.

``submit`` never blocks: a full queue drops the write (counted in the tier's ``dropped_writes{queue_full}``), so a
step never waits for a disk. A block the tier already holds is skipped (refreshing nothing: it was computed
again, not read) unless it is to be retained; ``submit_retain`` queues only a retention of a held block.
A block written, or found there already, is told to the tier's ``TierPresence`` (its KV events).
``close`` drains what is queued, then stops the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

from kvprefix.tiers.objects import BlockObject
from kvprefix.tiers.presence import TierPresence
from kvprefix.tiers.store import BlockStore

log = logging.getLogger(__name__)
_STOP = object()


class WriteBehind:
    def __init__(self, store: BlockStore, max_queue: int = 256, presence: TierPresence | None = None):
        self.store = store
        self.presence = presence
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name=f"kvprefix-{store.name}-writer", daemon=True)
        self._thread.start()

    def submit(self, obj: BlockObject, retain_until: float | None = None, tenant: str = "") -> bool:
        """Queues one block (retained until ``retain_until`` if given); False (counted) when the queue is full."""
        return self._put((obj, retain_until, tenant))

    def submit_retain(self, block_hashes: Sequence[bytes], until: float, tenant: str) -> bool:
        """Queues, as one item, the retention of blocks the tier may hold (``BlockStore.retain``: one it lacks is
        passed over); False (counted) when full."""
        return self._put((tuple(block_hashes), until, tenant))

    def _put(self, item) -> bool:
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            self.drop()
            return False

    def drop(self) -> None:
        """Counts a write dropped because the queue was full (a caller that checked ``has_room`` first)."""
        with self.store.stats.lock:
            self.store.stats.dropped_writes["queue_full"] += 1

    def has_room(self) -> bool:
        """Whether a submit now would be queued (so a caller can skip copying a payload that would be dropped)."""
        return not self._queue.full()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                obj, until, tenant = item
                if isinstance(obj, tuple):
                    for block_hash in obj:
                        self.store.retain(block_hash, until, tenant)
                elif until is not None or not self.store.contains(obj.block_hash, obj.namespace):
                    start = time.perf_counter()
                    if self.store.store(obj, until, tenant):
                        with self.store.stats.lock:
                            self.store.stats.store_seconds.observe(time.perf_counter() - start)
                        self._held(obj)
                else:
                    self._held(obj)
            except Exception:  # a failing write must not end the writer: the next block may succeed
                log.exception("kv tier write failed")
                with self.store.stats.lock:
                    self.store.stats.dropped_writes["error"] += 1
            finally:
                self._queue.task_done()

    def _held(self, obj: BlockObject) -> None:
        if self.presence is not None:
            self.presence.stored(self.store.medium, [obj.block_hash], obj.parent_hash, obj.namespace)

    def flush(self) -> None:
        """Waits until every queued block is written (tests and shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join()
