"""What a replica announces of its tiers (``tiers.presence``), on real files: every block the write-behind writes
or finds, every block the disk deletes (budget, a failed verification), what a rescan finds another process wrote
or deleted, each once, with its medium; a known-blocks bound that forgets (and announces) the oldest; a
subscription that starts atomically with its snapshot."""

from __future__ import annotations

import os
import threading

from support.tier_blocks import SPEC, chain, expected

from kvprefix.cache.event_index import MediaIndex
from kvprefix.cache.events import BlockRemoved, BlockStored
from kvprefix.cache.media import DISK, SHARED
from kvprefix.tiers import DiskStore
from kvprefix.tiers import disk_layout as layout
from kvprefix.tiers.objects import encode
from kvprefix.tiers.presence import TierPresence
from kvprefix.tiers.write_behind import WriteBehind


class Watcher:
    """A subscriber that mirrors the presence from its snapshot, as the KV event publisher does."""

    def __init__(self, presence: TierPresence):
        self.index, self.events = MediaIndex(), []
        self.unsubscribe = presence.subscribe_from_snapshot(self.index.add, self.on_event)

    def on_event(self, event) -> None:
        self.events.append(event)
        self.index.apply(event)

    def held(self, medium: str) -> set[bytes]:
        return set(self.index.of(medium).blocks())


def test_stored_once_removed_once_and_the_bound_forgets_the_oldest():
    presence = TierPresence(block_size=4)
    presence.track(DISK)
    presence.track(SHARED, capacity_blocks=3)
    watcher = Watcher(presence)
    a, b, c, d = (bytes([i]) * 32 for i in range(4))
    presence.stored(SHARED, [a, b], b"\x00" * 32, "ns")
    presence.stored(SHARED, [a, b], b"\x00" * 32, "ns")  # known: refreshed, not announced again
    presence.stored(SHARED, [c, d], b, "ns")  # four blocks for a bound of three: the oldest one, a, goes
    presence.removed(SHARED, [a, b"\x09" * 32])  # a is gone already, the other was never known: nothing
    presence.removed(SHARED, [c])
    assert watcher.events == [
        BlockStored([a, b], b"\x00" * 32, None, 4, None, "ns", SHARED),
        BlockStored([c, d], b, None, 4, None, "ns", SHARED),
        BlockRemoved([a], SHARED),
        BlockRemoved([c], SHARED),
    ]
    assert watcher.held(SHARED) == {b, d} and presence.held(SHARED) == 2 and not watcher.held(DISK)
    watcher.unsubscribe()
    presence.stored(DISK, [a], None, "")
    assert len(watcher.events) == 4


def test_the_disk_announces_its_objects_writes_and_evictions(tmp_path):
    blocks = chain(8)
    size = len(encode(blocks[0]))
    first = DiskStore(str(tmp_path), 100 * size, SPEC)
    for obj in blocks[:2]:
        assert first.store(obj)  # on disk before the replica below starts: found by its scan
    store = DiskStore(str(tmp_path), 4 * size, SPEC, rescan_seconds=1e9)
    presence = TierPresence(SPEC.block_size)
    presence.track(DISK)
    store.watch(presence)
    watcher = Watcher(presence)
    assert watcher.held(DISK) == {b.block_hash for b in blocks[:2]}
    assert all(watcher.index.of(DISK).blocks()[b.block_hash] == (None, "") for b in blocks[:2])  # headers unread
    writer = WriteBehind(store, presence=presence)
    try:
        for obj in blocks[2:6]:  # six objects for a budget of four: the two oldest are deleted
            writer.submit(obj)
        writer.submit(blocks[5])  # held already: found, not written again, not announced again
        writer.flush()
    finally:
        writer.close()
    assert watcher.held(DISK) == {b.block_hash for b in blocks[2:6]}
    assert store.stats.evictions == 2
    removed = [e for e in watcher.events if isinstance(e, BlockRemoved)]
    assert [h for e in removed for h in e.block_hashes] == [b.block_hash for b in blocks[:2]]
    stored = [e for e in watcher.events if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == [b.block_hash for b in blocks[2:6]]
    assert stored[0].parent_block_hash == blocks[1].block_hash and stored[0].namespace == blocks[2].namespace
    # A block that does not verify is deleted and announced gone.
    path = layout.object_path(store.root, blocks[5].block_hash)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 1)
        f.write(b"\xff" if f.read(1) != b"\xff" else b"\x00")
    assert store.load(expected(blocks[5])) is None
    assert blocks[5].block_hash not in watcher.held(DISK)


def test_a_rescan_announces_what_other_processes_wrote_and_deleted(tmp_path):
    blocks = chain(5)
    mine = DiskStore(str(tmp_path), 1 << 30, SPEC, rescan_seconds=1e9)
    other = DiskStore(str(tmp_path), 1 << 30, SPEC, rescan_seconds=1e9)  # another replica on the directory
    presence = TierPresence(SPEC.block_size)
    presence.track(DISK)
    mine.watch(presence)
    watcher = Watcher(presence)
    for obj in blocks[:3]:
        assert mine.store(obj)
        presence.stored(DISK, [obj.block_hash], obj.parent_hash, obj.namespace)  # what the write-behind says
    for obj in blocks[3:]:
        assert other.store(obj)
    os.unlink(layout.object_path(mine.root, blocks[0].block_hash))  # deleted by the other process (say)
    mine.rescan()
    assert watcher.held(DISK) == {b.block_hash for b in blocks[1:]}


def test_a_subscription_starts_atomically_with_its_snapshot():
    """Writers announcing from many threads while subscribers join: each subscriber's snapshot plus its events is
    exactly what the presence holds at the end."""
    presence = TierPresence(block_size=4)
    presence.track(SHARED, capacity_blocks=50)
    stop = threading.Event()

    def write(k: int) -> None:
        i = 0
        while not stop.is_set():
            h = bytes([k]) + i.to_bytes(31, "big")
            presence.stored(SHARED, [h], None, "")
            if i % 3 == 0:
                presence.removed(SHARED, [h])
            i += 1

    threads = [threading.Thread(target=write, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    watchers = []
    try:
        for _ in range(20):
            watchers.append(Watcher(presence))
    finally:
        stop.set()
        for t in threads:
            t.join()
    final = Watcher(presence).held(SHARED)
    assert len(final) == presence.held(SHARED) <= 50
    assert all(w.held(SHARED) == final for w in watchers)
