"""A local disk tier: one verified object per block, content-addressed by its hash, under an LRU byte budget.

No index file: a block is found by its hash's path, so a restarted server (or another replica sharing the
directory) finds every block. The byte budget is kept from an in-memory LRU view built by a scan at start and
resynced by a rescan before writes (as often as scanning stays under a tenth of the time, at least every
``rescan_seconds``): processes sharing the directory share its budget. Loads touch the file's mtime, so the LRU
order is shared through the file system. Writes go to a temporary name and are renamed into
place: readers see a whole object or none. A reader whose object is deleted meanwhile gets a miss. A retained
object (``retain``) is passed over by eviction until its time is up; its retention is a note beside it, read back
by the scan, so it survives restarts and is shared by the processes on the directory.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from kvprefix.cache.media import DISK
from kvprefix.tiers import disk_layout as layout
from kvprefix.tiers.lru_bytes import LRUBytes
from kvprefix.tiers.objects import (
    CHECKSUM_SIZE,
    PREFIX_SIZE,
    BlockObject,
    Expected,
    KVSpec,
    ObjectError,
    checksum,
    decode,
    decode_header,
    decode_prefix,
    encode,
    verify,
)
from kvprefix.tiers.presence import TierPresence
from kvprefix.tiers.store import TierStats

HEADER_GUESS = 4096  # read with the prefix: any real header (a 16-token block's is about 300 bytes)


class DiskStore:
    """``DiskStore(root, max_bytes, spec)``: the tier in ``root``, at most ``max_bytes`` of objects, loading
    blocks computed under ``spec``. ``progress(n)`` is told of a long start-up scan."""

    name = "disk"
    medium = DISK
    store_id = ""  # a directory is this machine's: its blocks load on the replicas that open it, not fleet-wide
    sees_evictions = True  # every deletion, this process's or (at a rescan) another's, is told to ``watch``
    local_lookup = True  # a lookup is a stat per block: cheap enough to ask on the engine's step

    def __init__(self, root: str, max_bytes: int, spec: KVSpec, *, progress: Callable[[int], None] | None = None,
                 rescan_seconds: float = 60.0):
        if max_bytes < 1:
            raise ValueError(f"--kv-disk-size must be at least one byte, got {max_bytes}")
        self.root = layout.prepare(root)
        self.max_bytes = max_bytes
        self.spec = spec
        self.stats = TierStats()
        self.rescan_seconds = rescan_seconds
        self._lock = threading.Lock()  # the LRU view: loads (engine thread) and stores (writer thread)
        self._lru = LRUBytes()  # hash -> size, least recently used first
        self._retained: dict[bytes, tuple[float, str]] = {}  # hash -> (kept until, epoch seconds; tenant)
        self._last_scan = 0.0
        self._scan_cost = 0.0  # seconds the last scan took
        self._presence: TierPresence | None = None  # told of what appears and disappears (``watch``)
        self.rescan(progress)
        if self._lru.usage > max_bytes:
            self.evict(self._lru.usage - max_bytes)

    # ---- the LRU view

    def watch(self, presence: TierPresence) -> None:
        """Tells ``presence`` (which tracks this tier's medium) of every object now, and from now on of every object
        written, deleted, or found or missed by a rescan."""
        with self._lock:
            presence.found(self.medium, list(self._lru))
            self._presence = presence

    def rescan(self, progress: Callable[[int], None] | None = None) -> None:
        """Rebuilds the view from the directory: every process's objects, least recently used (by mtime) first.
        File times are coarse (a few ms): objects of one tick keep this process's order, unknown ones first."""
        start = time.monotonic()
        entries = layout.scan(self.root, progress)
        retained = {h: (until, tenant) for h, until, tenant in layout.iter_retained(self.root)}
        self._scan_cost = time.monotonic() - start
        with self._lock:
            self._retained = retained  # eviction deletes an expired one's note with its object
            rank = {h: i for i, h in enumerate(self._lru)}
            entries.sort(key=lambda e: (e.mtime, rank.get(e.block_hash, -1)))
            self._lru = LRUBytes((e.block_hash, e.size) for e in entries)
            self._last_scan = time.monotonic()
            self._gauges()
            presence = self._presence
        if presence is not None:  # what other processes on the directory wrote and deleted meanwhile
            found = {e.block_hash for e in entries}
            presence.removed(self.medium, [h for h in rank if h not in found])
            presence.found(self.medium, [h for h in found if h not in rank])

    def _gauges(self) -> None:
        self.stats.usage_bytes, self.stats.num_objects = self._lru.usage, len(self._lru)

    @property
    def usage_bytes(self) -> int:
        return self._lru.usage

    def _note(self, block_hash: bytes, size: int) -> None:
        """Records (or refreshes) an object as most recently used. Caller holds the lock."""
        self._lru.touch(block_hash, size)
        self._gauges()

    def _forget(self, block_hash: bytes) -> None:
        if self._lru.forget(block_hash) is not None:
            self._gauges()

    # ---- the BlockStore interface

    def contains(self, block_hash: bytes, namespace: str = "") -> bool:
        return os.path.exists(layout.object_path(self.root, block_hash))

    def claim(self, block_hashes: Sequence[bytes], namespace: str, seconds: float) -> int:
        """No claims on a directory: replicas sharing one may compute a block twice (and write it once)."""
        return 0

    def lookup(self, block_hashes: Sequence[bytes], namespace: str = "") -> int:
        self.stats.lookups += 1
        self.stats.lookup_blocks += len(block_hashes)
        for i, h in enumerate(block_hashes):
            if not self.contains(h):
                return i
        return len(block_hashes)

    def load(self, expected: Expected) -> BlockObject | None:
        """The whole verified object (tests and tools; the engine loads with ``load_into``)."""
        def read(fd: int, size: int) -> BlockObject:
            data = os.pread(fd, size, 0)
            if len(data) != size:
                raise ObjectError("truncated", f"read {len(data)} of {size} bytes")
            obj = decode(data)
            verify(obj, self.spec, expected)
            return obj

        return self._guarded(expected, read)

    def load_into(self, expected: Expected, spans: Sequence[memoryview]) -> bool:
        """Reads the block's payload straight into ``spans`` (writable, in payload order: the caller's memory, e.g.
        one block of each layer of the paged KV), after checking its header; True only once the checksum over
        header and the bytes in ``spans`` verifies. On False the spans hold garbage: the caller must not use them."""
        def read(fd: int, size: int) -> bool:
            head = os.pread(fd, min(size, PREFIX_SIZE + HEADER_GUESS), 0)
            prefix = decode_prefix(head, self.spec)
            if size != prefix.total:
                raise ObjectError("truncated", f"file of {size} bytes, its prefix says {prefix.total}")
            if len(head) < PREFIX_SIZE + prefix.header_len:
                head = os.pread(fd, PREFIX_SIZE + prefix.header_len, 0)
            head = head[: PREFIX_SIZE + prefix.header_len]
            verify(decode_header(head), self.spec, expected)
            if sum(len(s) for s in spans) != prefix.payload_len:
                raise ValueError(f"spans of {sum(len(s) for s in spans)} bytes for a {prefix.payload_len}-byte payload")
            if os.preadv(fd, spans, len(head)) != prefix.payload_len:
                raise ObjectError("truncated", "the payload was cut short")
            if checksum(head, *spans) != os.pread(fd, CHECKSUM_SIZE, len(head) + prefix.payload_len):
                raise ObjectError("checksum", "checksum of header and payload does not match")
            return True

        return bool(self._guarded(expected, read))

    def _guarded(self, expected: Expected, read):
        """Runs ``read(fd, file size)`` on the block's object: a missing file is a miss, one that does not verify a
        counted miss (and deleted); a hit touches the file (the shared LRU clock) and is counted."""
        path = layout.object_path(self.root, expected.block_hash)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                out = read(f.fileno(), size)
        except FileNotFoundError:
            return None  # deleted since the lookup (evicted, cleared): a plain miss
        except ObjectError as exc:
            with self.stats.lock:
                self.stats.verify_failures[exc.reason] += 1
            self._discard(expected.block_hash, path)
            return None
        except OSError:
            with self.stats.lock:
                self.stats.verify_failures["io"] += 1
            return None
        try:
            os.utime(path)
        except OSError:
            pass
        with self._lock:
            self._note(expected.block_hash, size)
        with self.stats.lock:
            self.stats.hit_blocks += 1
            self.stats.bytes_read += size
        return out

    def _discard(self, block_hash: bytes, path: str) -> None:
        """An object at a block's name that does not verify serves nobody: deleted, to be rewritten."""
        for doomed in (path, layout.retention_path(self.root, block_hash)):
            try:
                os.unlink(doomed)
            except OSError:
                pass
        with self._lock:
            self._forget(block_hash)
            self._retained.pop(block_hash, None)
        if self._presence is not None:
            self._presence.removed(self.medium, [block_hash])

    def store(self, obj: BlockObject, retain_until: float | None = None, tenant: str = "") -> bool:
        if retain_until is not None and self.contains(obj.block_hash):
            return self.retain(obj.block_hash, retain_until, tenant)
        data = encode(obj)
        if len(data) > self.max_bytes:
            return self._drop("too_large")
        # See what other processes wrote and deleted (a shared directory shares its budget), as often as scanning
        # stays under a tenth of the time: a small directory at every write, a large one every second or two.
        if time.monotonic() - self._last_scan >= min(self.rescan_seconds, 10 * self._scan_cost):
            self.rescan()
        over = self._room_needed(obj.block_hash, len(data))
        if over > 0 and self.evict(over) < over:
            return self._drop("retained")  # what is left to evict is retained (or cannot be deleted)
        path = layout.object_path(self.root, obj.block_hash)
        try:
            self._write(path, data)
        except OSError as exc:
            return self._drop("disk_full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "io")
        with self._lock:
            self._note(obj.block_hash, len(data))
        with self.stats.lock:
            self.stats.stores += 1
            self.stats.bytes_written += len(data)
        return retain_until is None or self.retain(obj.block_hash, retain_until, tenant)

    def retain(self, block_hash: bytes, until: float, tenant: str) -> bool:
        """Keeps a stored block from eviction until ``until`` (epoch seconds; a later time only extends it),
        counted against ``tenant``'s retained bytes; False when the tier does not hold the block."""
        if not self.contains(block_hash):
            return False
        with self._lock:
            kept = self._retained.get(block_hash)
            if kept is not None and kept[0] >= until:
                return True
            self._retained[block_hash] = (until, tenant)
        path = layout.retention_path(self.root, block_hash)
        try:
            self._write(path, tenant.encode(), mtime=until)
        except OSError as exc:
            with self._lock:
                self._retained.pop(block_hash, None)
            return self._drop("disk_full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "io")
        return True

    def retained_bytes(self, tenant: str, besides: Sequence[bytes] = ()) -> int:
        """Bytes of the objects ``tenant`` keeps retained now (unexpired), not counting those of ``besides``."""
        now, skip = time.time(), set(besides)
        with self._lock:
            return sum(self._lru.size(h) for h, (until, t) in self._retained.items()
                       if t == tenant and until > now and h not in skip)

    def _room_needed(self, block_hash: bytes, size: int) -> int:
        """Bytes to free before writing ``size`` bytes for ``block_hash`` (a block stored again replaces itself:
        it is neither room to make nor a victim)."""
        with self._lock:
            return self._lru.room_needed(block_hash, size, self.max_bytes)

    def _drop(self, reason: str) -> bool:
        with self.stats.lock:
            self.stats.dropped_writes[reason] += 1
        return False

    def _write(self, path: str, data: bytes, mtime: float | None = None) -> None:
        """Temporary file (0600), then an atomic rename: concurrent writers of one block each rename a whole
        object, and a reader opens the old file or the new one, never a partial one (``mtime``: set before the
        rename, so no reader sees another)."""
        tmp = os.path.join(self.root, layout.TMP, f"{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with open(fd, "wb") as f:
                f.write(data)
            if mtime is not None:
                os.utime(tmp, (mtime, mtime))
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            os.replace(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def evict(self, num_bytes: int) -> int:
        """Deletes least recently used objects (of this process's view) until ``num_bytes`` are freed, passing
        over those retained until later than now; returns the bytes freed (less when not enough could go)."""
        freed, now, gone = 0, time.time(), []
        with self._lock:
            def retained(block_hash: bytes) -> bool:
                kept = self._retained.get(block_hash)
                return kept is not None and kept[0] > now

            for block_hash, size in self._lru.victims(num_bytes, keep=retained):
                try:
                    os.unlink(layout.object_path(self.root, block_hash))
                except FileNotFoundError:
                    pass  # deleted by another process: its bytes are gone all the same
                except OSError:
                    self._lru.refresh(block_hash)
                    continue
                if self._retained.pop(block_hash, None) is not None:  # an expired retention: its note goes too
                    try:
                        os.unlink(layout.retention_path(self.root, block_hash))
                    except OSError:
                        pass
                self._forget(block_hash)
                gone.append(block_hash)
                freed += size
                self.stats.evictions += 1
        if gone and self._presence is not None:
            self._presence.removed(self.medium, gone)
        return freed

