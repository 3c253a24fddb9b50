"""The disk tier on real files: found by hash after a restart, verified on every load (a bad object is a counted
miss and is deleted), atomic writes, an LRU byte budget, 0600 files in 0700 directories, and races between
writers, readers and eviction that end in whole objects or misses."""

from __future__ import annotations

import dataclasses
import os
import stat
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import tmpfs
from support.tier_blocks import SPEC, chain, expected

from kvprefix.tiers import DiskStore
from kvprefix.tiers import disk_layout as layout
from kvprefix.tiers.objects import decode, encode

BIG = 1 << 30


def test_a_restarted_store_finds_and_loads_every_block(tmp_path) -> None:
    blocks = chain(6)
    store = DiskStore(str(tmp_path), BIG, SPEC)
    for b in blocks[:4]:
        assert store.store(b)
    again = DiskStore(str(tmp_path), BIG, SPEC)  # a new process: no index, only the directory
    assert again.stats.num_objects == 4 and again.usage_bytes == 4 * len(encode(blocks[0]))
    assert again.lookup([b.block_hash for b in blocks]) == 4
    assert [again.load(expected(b)) for b in blocks[:4]] == blocks[:4]
    assert again.load(expected(blocks[4])) is None
    assert again.stats.hit_blocks == 4 and again.stats.bytes_read == again.usage_bytes


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def corrupt(kind: str, tmp_path, blocks, store) -> None:
    a, b = blocks
    pa = layout.object_path(store.root, a.block_hash)
    if kind == "bit flip":
        flip_byte(pa, os.path.getsize(pa) // 2)
    elif kind == "truncated":
        os.truncate(pa, os.path.getsize(pa) - 100)
    elif kind == "swapped payloads":
        da, db = open(pa, "rb").read(), encode(b)
        cut = len(da) - 16 - len(a.payload)
        open(pa, "wb").write(da[:cut] + db[cut:])
    elif kind == "another model":
        other = dataclasses.replace(a, spec=dataclasses.replace(SPEC, model="another"))
        open(pa, "wb").write(encode(other))
    elif kind == "another namespace":
        open(pa, "wb").write(encode(dataclasses.replace(a, namespace="f" * 16)))
    elif kind == "another version":
        data = bytearray(open(pa, "rb").read())
        data[4] += 1
        open(pa, "wb").write(bytes(data))
    elif kind == "another block's object":
        open(pa, "wb").write(encode(b))


KINDS = ["bit flip", "truncated", "swapped payloads", "another model", "another namespace", "another version",
         "another block's object"]


def load_into(store, obj):
    """``load_into`` over spans the way the engine gives them (one per layer); the bytes, or None for a miss."""
    buf = bytearray(SPEC.payload_bytes)
    layer = SPEC.payload_bytes // SPEC.num_layers
    spans = [memoryview(buf)[i : i + layer] for i in range(0, len(buf), layer)]
    return bytes(buf) if store.load_into(expected(obj), spans) else None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("into", [False, True], ids=["load", "load_into"])
def test_an_object_that_does_not_verify_is_a_counted_miss(tmp_path, kind, into) -> None:
    blocks = chain(2, seed=3)
    store = DiskStore(str(tmp_path), BIG, SPEC)
    for b in blocks:
        store.store(b)
    corrupt(kind, tmp_path, blocks, store)
    if into:
        assert load_into(store, blocks[0]) is None
        assert load_into(store, blocks[1]) == blocks[1].payload
    else:
        assert store.load(expected(blocks[0])) is None
        assert store.load(expected(blocks[1])) == blocks[1]
    assert sum(store.stats.verify_failures.values()) == 1
    assert not store.contains(blocks[0].block_hash)  # deleted: the next computation rewrites it


def test_another_engine_spec_never_loads(tmp_path) -> None:
    (b,) = chain(1)
    DiskStore(str(tmp_path), BIG, SPEC).store(b)
    other = DiskStore(str(tmp_path), BIG, dataclasses.replace(SPEC, kv_dtype="bfloat16", element_size=2))
    assert other.load(expected(b)) is None
    assert other.stats.verify_failures["identity"] == 1


def test_files_are_private(tmp_path) -> None:
    root = tmp_path / "tier"
    store = DiskStore(str(root), BIG, SPEC)
    (b,) = chain(1)
    store.store(b)
    path = layout.object_path(store.root, b.block_hash)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for d in (root, root / "objects", os.path.dirname(path), root / "tmp"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_the_budget_evicts_least_recently_used_and_loads_refresh(tmp_path) -> None:
    blocks = chain(5)
    size = len(encode(blocks[0]))
    store = DiskStore(str(tmp_path), 3 * size, SPEC)
    for b in blocks[:3]:
        store.store(b)
    assert store.load(expected(blocks[0])) is not None  # 0 is now the most recently used
    store.store(blocks[3])
    store.store(blocks[4])
    held = [store.contains(b.block_hash) for b in blocks]
    assert held == [True, False, False, True, True]
    assert store.usage_bytes == 3 * size and store.stats.evictions == 2
    # The order survives a restart: loads touch the file's mtime.
    os.utime(layout.object_path(store.root, blocks[3].block_hash), (1, 1))
    again = DiskStore(str(tmp_path), 2 * size, SPEC)
    assert not again.contains(blocks[3].block_hash) and again.usage_bytes == 2 * size


def test_a_write_past_the_disk_is_dropped_and_counted(tmp_path) -> None:
    (b,) = chain(1)
    store = DiskStore(str(tmp_path), 10, SPEC)
    assert not store.store(b)
    assert store.stats.dropped_writes["too_large"] == 1 and store.usage_bytes == 0


def test_start_refuses_a_file_and_an_unwritable_directory(tmp_path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        DiskStore(str(f), BIG, SPEC)
    with pytest.raises(ValueError, match="cannot write in /proc"):
        DiskStore("/proc/kvprefix-tier-test", BIG, SPEC)  # /proc takes no new directories, even from root


def test_stale_temporary_files_are_removed_and_never_read(tmp_path) -> None:
    store = DiskStore(str(tmp_path), BIG, SPEC)
    (b,) = chain(1)
    partial = os.path.join(store.root, "tmp", b.block_hash.hex() + ".kvb.123.abc")
    open(partial, "wb").write(encode(b)[:500])  # what a kill -9 mid-write leaves
    os.utime(partial, (1, 1))
    again = DiskStore(str(tmp_path), BIG, SPEC)
    assert again.lookup([b.block_hash]) == 0 and not os.path.exists(partial)


def test_concurrent_writers_readers_and_eviction_see_whole_objects_or_misses(tmp_path) -> None:
    blocks = chain(40, seed=9)
    size = len(encode(blocks[0]))
    stores = [DiskStore(str(tmp_path), 10 * size, SPEC) for _ in range(3)]  # as three processes sharing it
    errors: list[BaseException] = []
    loaded: list = []

    def write(store) -> None:
        for _ in range(5):
            for b in blocks:
                store.store(b)

    def read(store) -> None:
        for _ in range(5):
            for b in blocks:
                obj = store.load(expected(b))
                if obj is not None:
                    loaded.append(obj == b)

    def guard(fn, store):
        try:
            fn(store)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=guard, args=(fn, s)) for s in stores for fn in (write, read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert loaded and all(loaded)
    assert all(sum(s.stats.verify_failures.values()) == 0 for s in stores)
    # One budget for the directory: each writer sees the others' objects before evicting (one write in flight each).
    assert len(list(layout.iter_objects(str(tmp_path)))) <= 10 + 3


WRITER = """
import sys
from support.tier_blocks import SPEC, chain
from kvprefix.tiers import DiskStore
store = DiskStore(sys.argv[1], int(sys.argv[2]), SPEC)
print("ready", flush=True)
for seed in range(10**6):
    for b in chain(8, seed=seed):
        store.store(b)
"""


@pytest.mark.slow  # a writer process killed mid-stream: 2 s of the fast lane's 90
def test_kill_9_during_heavy_writes_leaves_only_whole_objects_within_budget(tmp_path) -> None:
    import subprocess
    import sys
    import time

    size = len(encode(chain(1)[0]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["src", "tests", os.environ.get("PYTHONPATH", "")])}
    for attempt in range(3):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(50 * size)],
                                stdout=subprocess.PIPE, env=env)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.3 + 0.2 * attempt)
        proc.kill()  # SIGKILL: no cleanup, whatever write was in progress
        proc.wait()
    store = DiskStore(str(tmp_path), 50 * size, SPEC)
    entries = list(layout.iter_objects(store.root))
    assert entries and store.usage_bytes <= 50 * size + size
    for e in entries:
        assert decode(open(e.path, "rb").read()).block_hash == e.block_hash


POOL = chain(12, seed=21)
SIZE = len(encode(POOL[0]))


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(1, 4), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=30))
def test_usage_matches_the_files_and_stays_within_budget(tmp_path_factory, budget, ops) -> None:
    """Any sequence of stores and loads: the tracked usage equals the bytes on disk, never over the budget, and
    what is evicted is the least recently stored or loaded."""
    root = str(tmp_path_factory.mktemp("lru"))
    store = DiskStore(root, budget * SIZE, SPEC)
    recent: list[int] = []  # model: most recently used last
    for is_store, i in ops:
        if is_store:
            store.store(POOL[i])
        elif store.load(expected(POOL[i])) is None:
            assert i not in recent
            continue
        recent = [j for j in recent if j != i] + [i]
        recent = recent[-budget:]
        on_disk = sum(e.size for e in layout.iter_objects(root))
        assert store.usage_bytes == on_disk <= budget * SIZE
        assert {POOL.index(next(b for b in POOL if b.block_hash == e.block_hash))
                for e in layout.iter_objects(root)} == set(recent)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB tmpfs (needs the right to mount: skipped without it), unmounted at the end."""
    with tmpfs.small_tmpfs(tmp_path / "small") as mnt:
        yield mnt


def test_a_full_disk_drops_writes_counted_and_leaves_only_whole_objects(small_tmpfs) -> None:
    spec = dataclasses.replace(SPEC, num_layers=64, head_size=64)  # 64 KiB payloads: 16 fill the file system
    store = DiskStore(str(small_tmpfs / "tier"), BIG, spec)
    results = [store.store(b) for b in chain(40, spec=spec)]
    assert results[0] and not all(results)
    assert store.stats.dropped_writes["disk_full"] == results.count(False)
    assert not os.listdir(os.path.join(store.root, "tmp"))  # no partial file left behind
    entries = list(layout.iter_objects(store.root))
    assert len(entries) == results.count(True) and store.usage_bytes == sum(e.size for e in entries)
    for e in entries:
        assert decode(open(e.path, "rb").read()).block_hash == e.block_hash


def test_a_read_only_file_system_is_refused_at_start(small_tmpfs) -> None:
    tmpfs.remount_read_only(small_tmpfs)
    with pytest.raises(ValueError, match="read-only file system"):
        DiskStore(str(small_tmpfs / "tier"), BIG, SPEC)
