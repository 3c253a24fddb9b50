"""Retention on the disk tier, on real files: a retained object is passed over by LRU eviction until its time is
up, keeps that promise across a restart (a note beside the object), is counted per tenant, and a write that could
only make room by deleting retained objects is dropped (counted) so the byte budget still holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from support.tier_blocks import SPEC, chain

from kvprefix.tiers import DiskStore
from kvprefix.tiers import disk_layout as layout
from kvprefix.tiers.objects import encode

SIZE = len(encode(chain(1)[0]))
DAY = 86400.0


def test_a_retained_object_outlives_lru_pressure_and_a_restart(tmp_path) -> None:
    blocks = chain(12)
    store = DiskStore(str(tmp_path), 4 * SIZE, SPEC)
    assert store.store(blocks[0], time.time() + DAY, "alice")  # the oldest: first in line for eviction
    for b in blocks[1:6]:
        assert store.store(b)
    assert store.contains(blocks[0].block_hash)
    assert [store.contains(b.block_hash) for b in blocks[1:6]] == [False, False, True, True, True]
    again = DiskStore(str(tmp_path), 4 * SIZE, SPEC)  # a restart: the retention is read back from the directory
    for b in blocks[6:12]:
        assert again.store(b)
    assert again.contains(blocks[0].block_hash) and again.usage_bytes <= 4 * SIZE
    assert again.retained_bytes("alice") == SIZE and again.retained_bytes("bob") == 0
    assert again.retained_bytes("alice", besides=[blocks[0].block_hash]) == 0


def test_an_expired_retention_is_evicted_like_any_object_with_its_note(tmp_path) -> None:
    blocks = chain(4)
    store = DiskStore(str(tmp_path), 2 * SIZE, SPEC)
    assert store.store(blocks[0], time.time() - 1, "alice")  # kept until a second ago
    assert os.path.exists(layout.retention_path(store.root, blocks[0].block_hash))
    for b in blocks[1:3]:
        assert store.store(b)
    assert not store.contains(blocks[0].block_hash)
    assert not os.path.exists(layout.retention_path(store.root, blocks[0].block_hash))
    assert store.retained_bytes("alice") == 0


def test_a_write_with_only_retained_objects_to_evict_is_dropped_and_counted(tmp_path) -> None:
    blocks = chain(3)
    store = DiskStore(str(tmp_path), 2 * SIZE, SPEC)
    for b in blocks[:2]:
        assert store.store(b, time.time() + DAY, "alice")
    assert not store.store(blocks[2])
    assert store.stats.dropped_writes["retained"] == 1
    assert store.usage_bytes == 2 * SIZE and not store.contains(blocks[2].block_hash)


def test_retaining_a_held_block_only_extends_its_time(tmp_path) -> None:
    (b,) = chain(1)
    store = DiskStore(str(tmp_path), 4 * SIZE, SPEC)
    assert store.store(b)
    assert store.retained_bytes("alice") == 0
    later = time.time() + DAY
    assert store.store(b, later, "alice")  # held already: retained, not rewritten
    assert store.stats.stores == 1 and store.retained_bytes("alice") == SIZE
    assert store.retain(b.block_hash, time.time() + 60, "alice")  # an earlier time does not shorten it
    assert abs(os.stat(layout.retention_path(store.root, b.block_hash)).st_mtime - later) < 1
    assert not store.retain(chain(2, seed=9)[1].block_hash, later, "alice")  # not held: nothing to retain


def test_cache_stats_counts_retained_blocks_per_tenant(tmp_path) -> None:
    blocks = chain(4)
    store = DiskStore(str(tmp_path), 10 * SIZE, SPEC)
    store.store(blocks[0], time.time() + DAY, "alice")
    store.store(blocks[1], time.time() + DAY, "alice")
    store.store(blocks[2], time.time() + DAY, "bob")
    store.store(blocks[3], time.time() - 1, "bob")  # expired: an ordinary object
    r = subprocess.run([sys.executable, "-m", "kvprefix.cli", "cache", "stats", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["blocks"] == 4 and out["retained"] == {"alice": 2, "bob": 1}
