"""Write-behind: blocks registered in the pool are written to a tier by one background thread.

``submit`` never blocks: a full queue drops the write (counted in the tier's ``dropped_writes{queue_full}``), so a
step never waits for a disk. A block the tier already holds is skipped (refreshing nothing: it was computed
again, not read). ``close`` drains what is queued, then stops the thread.
"""

from __future__ import annotations

import logging
import queue
import threading

from kvprefix.tiers.objects import BlockObject
from kvprefix.tiers.store import BlockStore

log = logging.getLogger(__name__)
_STOP = object()


class WriteBehind:
    def __init__(self, store: BlockStore, max_queue: int = 256):
        self.store = store
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name=f"kvprefix-{store.name}-writer", daemon=True)
        self._thread.start()

    def submit(self, obj: BlockObject) -> bool:
        """Queues one block; False (counted) when the queue is full."""
        try:
            self._queue.put_nowait(obj)
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
            obj = self._queue.get()
            try:
                if obj is _STOP:
                    return
                if not self.store.contains(obj.block_hash, obj.namespace):
                    self.store.store(obj)
            except Exception:  # a failing write must not end the writer: the next block may succeed
                log.exception("kv tier write failed")
                with self.store.stats.lock:
                    self.store.stats.dropped_writes["error"] += 1
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Waits until every queued block is written (tests and shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join()
